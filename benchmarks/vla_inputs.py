"""Camera frames into a LeRobot policy's step: the observation packed on the host as float32
(what a ~/observation Float32MultiArray carries) vs assembled on the engine's device from
the uint8 frames (observation_type cameras, runtime/camera_inputs.py).

    python -m benchmarks.vla_inputs --device cuda --commit <sha>

A control step with new frames from every camera (a camera at the control rate), the whole
call as the node makes it: host: each frame to float32 / 255, the vector concatenated,
engine.step (validated, copied to the device, stepped, the action back); device: each frame
through CameraObservation.put_image (uint8 to the device, converted there), the state, then
engine.step_all on the device vector (validated there, stepped, the action back). The policy
is the demo SmolVLA checkpoint (tiny, random weights: its chunk costs little, so the inputs'
cost shows) with its two cameras at the sizes given; steps that pop the queue and steps that
compute a chunk are reported apart. Without ROS: the host path's Float32MultiArray over DDS
(four bytes a pixel, serialised and copied) comes on top of its figures.
Identity checks (exit 1 on failure): the device path's actions equal the host path's bit
for bit over the episode, replayed 8 times from its start capsule.
"""
import argparse
import datetime
import sys
import tempfile
import time

import numpy as np
import torch

from .environment import device_slug, environment, resolve_device, results_stem
from .report import checks_and_command, environment_line, log, Report
from .sections import check
from .timing import stats

CONFIGS = {'smoke': {'steps': 20, 'sizes': [(48, 64)]},
           'gpu': {'steps': 200, 'sizes': [(224, 224), (480, 640), (720, 1280)]}}


def run(device, size, cfg, tmp, checks):
    from flashrt_ros.runtime.camera_inputs import as_floats, CameraObservation
    from flashrt_ros.runtime.engine import PolicyEngine
    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_inputs
    from flashrt_ros.runtime.policies.lerobot_demo import checkpoint, STATE_DIM, vlm_folder
    from flashrt_ros.runtime.policies.lerobot_smolvla import SmolVLAChunkPolicy
    folder = checkpoint(vlm_folder(f'{tmp}/vlm'), f'{tmp}/checkpoint')
    keys, _, tokenize = checkpoint_inputs(folder)
    cameras = {k: (3, *size) for k in keys}
    ids, mask = tokenize('pick up the red cube')
    engines = {p: PolicyEngine(SmolVLAChunkPolicy.from_pretrained(folder, cameras=cameras,
                                                                  seed=3),
                               device=device, capsule_dir=f'{tmp}/{p}')
               for p in ('host', 'device')}
    steps = engines['host'].policy.steps
    rng = np.random.default_rng(0)
    readings = [(rng.standard_normal(STATE_DIM).astype(np.float32),
                 [rng.integers(0, 256, (*size, 3), dtype=np.uint8) for _ in cameras])
                for _ in range(cfg['steps'])]
    assembled = CameraObservation(STATE_DIM, cameras, len(ids), device)
    assembled.put_tokens(ids, mask)

    def host(state, frames):
        vector = np.concatenate([state, *[as_floats(f).ravel() for f in frames], ids, mask])
        return engines['host'].step(vector)

    def on_device(state, frames):
        for key, frame in zip(cameras, frames):
            assembled.put_image(key, frame)
        assembled.put_state(state)
        return engines['device'].step_all(assembled.vector.view(1, -1))[0].cpu()
    times, actions = {'host': [], 'device': []}, {'host': [], 'device': []}
    for e in engines.values():
        e.snapshot('start')
    for state, frames in readings:      # interleaved: a noisy machine moves both
        for path, fn in (('host', host), ('device', on_device)):
            t0 = time.perf_counter()
            actions[path].append(fn(state, frames))
            times[path].append((time.perf_counter() - t0) * 1e6)
    name = f'2 cameras {size[0]} x {size[1]}'
    same = all(torch.equal(a, b) for a, b in zip(actions['host'], actions['device']))
    for _ in range(8):
        engines['device'].restore('start')
        same &= all(torch.equal(on_device(s, f), a)
                    for (s, f), a in zip(readings, actions['host']))
    check(checks, f'{name}: the device-assembled observation acts as the host-packed one, bit '
          f'for bit over {len(readings)} steps, 8 replays', same)
    # steps after the first chunk's: pops, and the chunks' (every n_action_steps-th)
    row = {'cameras': name, 'observation_mb': 4 * assembled.vector.numel() / 2 ** 20,
           'frames_mb': len(cameras) * size[0] * size[1] * 3 / 2 ** 20}
    for path, ts in times.items():
        row[path] = {'pop': stats([t for i, t in enumerate(ts) if i % steps and i > steps]),
                     'chunk': stats([t for i, t in enumerate(ts) if not i % steps and i])}
    return row


def render(results):
    env, out = results['environment'], []
    out += [f'# Camera frames into the policy step: host float32 vector vs device assembly: '
            f'{env["device_name"]} ({env["mode"]})\n', environment_line(env),
            '- the demo SmolVLA checkpoint (tiny, random weights), new frames from both '
            'cameras every step; whole call, host wall in us (p50 / p99); pop: a step that '
            'takes the next action of the queue, chunk: one that computes the chunk\n',
            '| cameras | observation (float32) / frames (uint8) MB | pop: host | pop: device '
            '(ratio) | chunk: host | chunk: device (ratio) |', '|' + ' --- |' * 6]
    for r in results['sections'].get('rows', []):
        def cell(s):
            return f'{s["p50"]:.0f} / {s["p99"]:.0f}'
        h, d = r['host'], r['device']
        out.append(f'| {r["cameras"]} | {r["observation_mb"]:.2f} / {r["frames_mb"]:.2f} | '
                   f'{cell(h["pop"])} | {cell(d["pop"])} '
                   f'({h["pop"]["p50"] / d["pop"]["p50"]:.2f}x) | {cell(h["chunk"])} | '
                   f'{cell(d["chunk"])} ({h["chunk"]["p50"] / d["chunk"]["p50"]:.2f}x) |')
    return '\n'.join(out + checks_and_command(results)) + '\n'


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--smoke', action='store_true')
    ap.add_argument('--device', default='cuda')
    ap.add_argument('--out', default='')
    ap.add_argument('--commit', default='')
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    mode = 'smoke' if args.smoke else 'gpu'
    env = environment(device, f'vla-inputs-{mode}', args.commit)
    stem = f'{datetime.date.today().isoformat()}-{device_slug(env)}-vla-inputs'
    report = Report(results_stem(args.out, stem), env, CONFIGS[mode], render_md=render)
    report.results['command'] = 'python -m benchmarks.vla_inputs ' + ' '.join(
        sys.argv[1:] if argv is None else argv)
    report.results['sections'] = {'rows': []}
    for size in CONFIGS[mode]['sizes']:
        with tempfile.TemporaryDirectory(prefix='frt-inputs-') as tmp:
            report.results['sections']['rows'].append(
                run(device, size, CONFIGS[mode], tmp, report.results['checks']))
        report.write()
    log(render(report.results))
    return 1 if any(not c['passed'] for c in report.results['checks']) else 0


if __name__ == '__main__':
    sys.exit(main())
