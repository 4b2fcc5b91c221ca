"""Control ticks of a cameras node while its cameras stream JPEG frames, through ROS.

The policy node (observation_type cameras, lock-step, the demo SmolVLA with three 480 x 640
cameras, CompressedImage JPEG) runs in its own process, from the tree --tree names (default:
this one; an older checkout measures the code before a change). A camera process publishes
JPEG frames (renders of the G1 from docs/) on the three topics; this process publishes one
joint state at a time and times joint state -> action on the node's ~/action, which is what
the robot waits for. Blocks of ticks alternate between the cameras quiet (their last frames
kept) and streaming at --fps each, so both conditions meet the same machine; the ratio
streaming / quiet is the cost of the frames to the control path. Ticks that compute a chunk
(every n_action_steps-th) are reported apart from those that pop the queue.

Needs rclpy and the generated interfaces (source tools/env.sh) and lerobot (requirements/
vla.txt). CPU figures: the model is the demo's, so a tick is mostly ROS and the node's Python.
"""
import argparse
import datetime
import io
import multiprocessing
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from .environment import device_slug, environment, results_stem, ROOT
from .report import checks_and_command, environment_line, log, micros, Report
from .timing import stats

CAMERAS = ('top', 'left_wrist', 'right_wrist')
JOINTS = [f'j{i}' for i in range(6)]


def _jpegs(quality=90):
    """Three 640 x 480 JPEG frames per camera set: the G1 renders in docs/ (one mirrored)."""
    from PIL import Image, ImageOps
    renders = [Image.open(ROOT / 'docs' / f).convert('RGB').resize((640, 480))
               for f in ('g1_walk.png', 'g1_push.png')]
    renders.append(ImageOps.mirror(renders[0]))
    out = []
    for image in renders:
        buffer = io.BytesIO()
        image.save(buffer, format='JPEG', quality=quality)
        out.append(buffer.getvalue())
    return out


def _decode_ms(jpegs, n=50):
    """PIL's decode of one frame, as the node does it (camera_inputs.compressed_pixels)."""
    from PIL import Image
    took = []
    for i in range(n):
        t = time.perf_counter()
        np.asarray(Image.open(io.BytesIO(jpegs[i % len(jpegs)])).convert('RGB'))
        took.append((time.perf_counter() - t) * 1e3)
    return float(np.median(took))


def frame_costs(device, jpegs, n=200):
    """Per 640 x 480 frame, whole calls (the device synchronised after each), us: what the
    camera thread does off the lock (PIL's decode, CameraObservation.stage) and what a tick
    waits for at most (put_staged, one copy under the lock), beside the old path's cost
    under the lock (decode + put_image on the control thread)."""
    import torch

    from flashrt_ros.runtime.camera_inputs import CameraObservation, compressed_pixels
    obs = CameraObservation(6, {'top': (3, 480, 640)}, 0, device)
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
    pixels = [compressed_pixels(j, (480, 640)) for j in jpegs]
    ops = {'decode (PIL)': lambda i: compressed_pixels(jpegs[i % 3], (480, 640)),
           'stage (to the device, converted)': lambda i: obs.stage('top', pixels[i % 3]),
           'put_staged (under the lock)': lambda i: obs.put_staged('top'),
           'decode + put_image (the old path, all under the lock)': lambda i: obs.put_image(
               'top', compressed_pixels(jpegs[i % 3], (480, 640)))}
    out = {}
    for name, op in ops.items():
        took = []
        for i in range(n + 10):
            t = time.perf_counter()
            op(i)
            sync()
            took.append((time.perf_counter() - t) * 1e6)
        out[name] = stats(took[10:])
    return out


def _publish_cameras(jpegs, fps, streaming, stop):
    """The camera process: while `streaming` is set, each camera publishes a JPEG frame
    every 1 / fps s (the cameras out of phase with each other)."""
    import rclpy
    from sensor_msgs.msg import CompressedImage
    rclpy.init()
    node = rclpy.create_node('camera_ticks_cameras')
    pubs = [node.create_publisher(CompressedImage, f'/bench_cam_{c}', 10) for c in CAMERAS]
    period, frame = 1.0 / fps, 0
    next_at = time.monotonic()
    while not stop.is_set():
        if not streaming.wait(0.05):
            next_at = time.monotonic()
            continue
        for i, pub in enumerate(pubs):
            pub.publish(CompressedImage(format='jpeg', data=jpegs[(frame + i) % len(jpegs)]))
            time.sleep(period / len(pubs) / 2)
        frame += 1
        next_at += period
        time.sleep(max(0.0, next_at - time.monotonic()))
    node.destroy_node()
    rclpy.shutdown()


def _params_file(folder, obs_dim, act_dim, path):
    import yaml
    params = dict(policy_type='smolvla', policy_file=folder, obs_dim=obs_dim, act_dim=act_dim,
                  seed=3, observation_type='cameras', joint_names=JOINTS,
                  camera_topics=[f'observation.images.{c}=/bench_cam_{c}' for c in CAMERAS],
                  compressed_cameras=[f'observation.images.{c}' for c in CAMERAS],
                  instruction='pick up the red cube', status_period=1.0)
    path.write_text(yaml.safe_dump({'flashrt_policy': {'ros__parameters': params}}))
    return str(path)


class _Actions:
    """The node's ~/action messages as they arrive: each one's arrival time."""

    def __init__(self):
        self.times, self._came = [], threading.Condition()

    def __call__(self, _msg):
        with self._came:
            self.times.append(time.perf_counter())
            self._came.notify_all()

    def wait(self, count, timeout):
        """The count-th action's arrival time, or None if it has not come within timeout."""
        with self._came:
            if self._came.wait_for(lambda: len(self.times) >= count, timeout):
                return self.times[count - 1]
        return None


def _tick(js, actions, stamp, rng, timeout=30.0):
    """One joint state out; ms until the action answering it came back (lock-step: the next
    one after those already come), or None (refused: no action within timeout)."""
    from builtin_interfaces.msg import Time
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Header
    msg = JointState(name=JOINTS, header=Header(stamp=Time(sec=stamp)),
                     position=rng.standard_normal(len(JOINTS)).tolist())
    count = len(actions.times) + 1
    t = time.perf_counter()
    js.publish(msg)
    came = actions.wait(count, timeout)
    return None if came is None else (came - t) * 1e3


def run(args, tmp, jpegs):
    import rclpy
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float32MultiArray

    from flashrt_ros.runtime.policies import lerobot_demo as demo
    from flashrt_ros.runtime.policies.lerobot_checkpoint import observation_size
    folder = demo.checkpoint(demo.vlm_folder(tmp / 'vlm'), tmp / 'checkpoint', size='cameras')
    z = demo.SIZES['cameras']
    obs_dim = observation_size(z['dims'][0], z['cameras'], z['policy']['tokenizer_max_length'])
    chunk_every = z['policy']['n_action_steps']
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(args.tree), os.environ.get('PYTHONPATH', '')]))
    log_path = tmp / 'node.log'
    node_proc = subprocess.Popen(
        [sys.executable, '-m', 'flashrt_ros.node.policy_node', '--ros-args', '--params-file',
         _params_file(folder, obs_dim, z['dims'][1], tmp / 'params.yaml')],
        env=env, stdout=open(log_path, 'w'), stderr=subprocess.STDOUT,
        cwd=str(args.tree))     # python -m puts the cwd first on sys.path, before PYTHONPATH
    spawn = multiprocessing.get_context('spawn')
    streaming, stop = spawn.Event(), spawn.Event()
    cameras = spawn.Process(target=_publish_cameras, args=(jpegs, args.fps, streaming, stop),
                            daemon=True)     # never left behind by a failed run
    cameras.start()
    rclpy.init()
    node = rclpy.create_node('camera_ticks')
    actions = _Actions()
    node.create_subscription(Float32MultiArray, '/flashrt_policy/action', actions, 100)
    js = node.create_publisher(JointState, '/joint_states', 10)
    from flashrt_ros.client import spin_in_thread
    spinner = spin_in_thread(node)
    rng = np.random.default_rng(0)
    results = {'quiet': [], 'streaming': []}
    try:
        deadline = time.monotonic() + 120
        while js.get_subscription_count() == 0:
            if node_proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f'the node did not come up: {log_path.read_text()[-2000:]}')
            time.sleep(0.1)
        streaming.set()     # the first frames: the node steps once it has every camera's
        stamp = 1
        while _tick(js, actions, stamp, rng, timeout=0.5) is None:
            stamp += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f'no first action: {log_path.read_text()[-2000:]}')
        time.sleep(2.0)     # a step refused meanwhile answers nothing; a late one lands now
        ticks = []
        for block in range(2 * args.blocks + 1):    # block 0: warm-up, not counted
            condition = ('streaming', 'quiet')[block % 2]
            (streaming.set if condition == 'streaming' else streaming.clear)()
            time.sleep(0.3)
            for _ in range(args.block_ticks):
                stamp += 1
                index = len(actions.times)  # the node's tick index: a chunk every n-th
                ms = _tick(js, actions, stamp, rng)
                if ms is None:
                    raise RuntimeError(f'no action for stamp {stamp}: '
                                       f'{log_path.read_text()[-2000:]}')
                if block:
                    ticks.append((condition, index % chunk_every == 0, ms))
                time.sleep(args.spacing * rng.uniform(0.5, 1.5))    # out of the cameras' phase
        for condition in results:
            for chunked in (False, True):
                took = [ms * 1e3 for c, ch, ms in ticks if c == condition and ch == chunked]
                results[condition].append(stats(took))
        return dict(results=results, decode_ms=_decode_ms(jpegs),
                    jpeg_bytes=[len(j) for j in jpegs], chunk_every=chunk_every,
                    ticks=len(ticks), node_alive=node_proc.poll() is None)
    finally:
        stop.set()
        cameras.join(10)
        if cameras.is_alive():      # (seen once: stuck in rclpy's shutdown)
            cameras.kill()
        spinner.shutdown()
        node.destroy_node()
        rclpy.shutdown()
        node_proc.terminate()
        node_proc.wait(20)


def _render_ticks(r):
    out = [f'- node from {r["tree"]} (commit {r["tree_commit"]}); three 640 x 480 JPEG '
           f'cameras ({min(r["jpeg_bytes"]) // 1000}-{max(r["jpeg_bytes"]) // 1000} kB a '
           f'frame, PIL decode {r["decode_ms"]:.2f} ms each here) at {r["fps"]:g} fps each '
           f'when streaming; joint state -> action through ROS, lock-step; {r["ticks"]} ticks '
           'in alternating blocks\n',
           '| ticks | cameras quiet p50 / p99 / max | streaming p50 / p99 / max | '
           'ratio p50 / p99 |', '|' + ' --- |' * 4]
    for i, what in enumerate(('queue pop', f'chunk (every {r["chunk_every"]}th)')):
        q, s = r['results']['quiet'][i], r['results']['streaming'][i]
        out.append(f'| {what} ({q["n"]} + {s["n"]}) | {micros(q["p50"])} / '
                   f'{micros(q["p99"])} / {micros(q["max"])} | {micros(s["p50"])} / '
                   f'{micros(s["p99"])} / {micros(s["max"])} | {s["p50"] / q["p50"]:.2f} / '
                   f'{s["p99"] / q["p99"]:.2f} |')
    return out


def render(results):
    env, sections = results['environment'], results['sections']
    out = [f'# Camera frames and control ticks: {env["device_name"]}\n', environment_line(env)]
    if 'ticks' in sections:
        out += _render_ticks(sections['ticks'])
    frames = sections.get('frames', {})
    out += [f'\n## One 640 x 480 JPEG frame on {env["device"]}, whole calls\n',
            '| part | p50 / p99 |', '| --- | --- |']
    out += [f'| {name} | {micros(v["p50"])} / {micros(v["p99"])} |' for name, v in
            frames.items()]
    out.append('\n(microseconds unless marked)')
    return '\n'.join(out + checks_and_command(results)) + '\n'


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--tree', default=str(ROOT), help='the checkout whose node is measured')
    ap.add_argument('--fps', type=float, default=30.0)
    ap.add_argument('--blocks', type=int, default=4, help='blocks of each condition')
    ap.add_argument('--block-ticks', type=int, default=60)
    ap.add_argument('--spacing', type=float, default=0.02, help='s between ticks (mean)')
    ap.add_argument('--frames-only', default='', metavar='DEVICE',
                    help="only the per-frame costs, on DEVICE ('cpu', 'cuda'): no ROS")
    ap.add_argument('--commit', default='', help='the commit measured (a copy, not a checkout)')
    ap.add_argument('--out', default='')
    args = ap.parse_args(argv)
    import torch
    tree = pathlib.Path(args.tree).resolve()
    commit = args.commit or subprocess.run(['git', '-C', str(tree), 'rev-parse', '--short',
                                            'HEAD'], capture_output=True, text=True).stdout.strip()
    device = torch.device(args.frames_only or 'cpu')
    env = environment(device, 'camera-frames' if args.frames_only else 'camera-ticks',
                      args.commit)
    what = 'camera-frames' if args.frames_only else 'camera-ticks'
    stem = f'{datetime.date.today().isoformat()}-{device_slug(env)}-{what}-{commit}'
    report = Report(results_stem(args.out, stem), env, vars(args), render_md=render)
    report.results['command'] = 'python -m benchmarks.camera_ticks ' + ' '.join(
        sys.argv[1:] if argv is None else argv)
    jpegs = _jpegs()
    report.publish('frames', frame_costs(device, jpegs))
    if not args.frames_only:
        with tempfile.TemporaryDirectory(prefix='frt-cam-') as tmp:
            section = run(args, pathlib.Path(tmp), jpegs)
        section.update(tree=str(tree), tree_commit=commit, fps=args.fps)
        report.results['checks'].append({'name': 'the node outlived the run',
                                         'passed': section.pop('node_alive')})
        report.publish('ticks', section)
    log(render(report.results))
    return 0 if all(c['passed'] for c in report.results['checks']) else 1


if __name__ == '__main__':
    sys.exit(main())
