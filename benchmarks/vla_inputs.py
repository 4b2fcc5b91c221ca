"""Camera frames into a LeRobot policy's step: the observation packed on the host as float32
(what a ~/observation Float32MultiArray carries) vs assembled on the engine's device from
the uint8 frames (observation_type cameras, runtime/camera_inputs.py).

    python -m benchmarks.vla_inputs --device cuda --commit <sha>

A control step with new frames from every camera (a camera at the control rate), the whole
call as the node makes it: host: each frame to float32 / 255, the vector concatenated,
engine.step (validated, copied to the device, stepped, the action back); device: each frame
through CameraObservation.put_image (uint8 to the device, converted there), the state, then
engine.step_all on the device vector (validated there, stepped, the action back). The node
takes a frame when it arrives, between steps; here it is inside the timed step, the
conservative figure. Policies: the demo SmolVLA checkpoint (tiny, random weights: its chunk
costs little, so the inputs' cost shows) with its two cameras at the sizes given, and ACT at
its published size (LeRobot's defaults, one 480 x 480 camera, chunk 100: issue 24's goal is 3
ms a chunk). pop: a step that takes the next action of the queue (an episode's steps after
its first chunk); chunk: a step that computes the chunk (the episode's start capsule
restored before each, untimed). Without ROS: the host path's Float32MultiArray over DDS (four
bytes a pixel, serialised and copied) comes on top of its figures.
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

# (policy, camera size or None: the checkpoint's own)
CONFIGS = {'smoke': {'steps': 20, 'chunks': 3, 'rows': [('smolvla', (48, 64)), ('act', None)]},
           'gpu': {'steps': 200, 'chunks': 20,
                   'rows': [('smolvla', (224, 224)), ('smolvla', (480, 640)),
                            ('smolvla', (720, 1280)), ('act', None)]}}


def _policies(kind, size, tmp, device):
    """Two engines of one checkpoint (host path, device path), its cameras and its
    instruction's tokens (ids, mask; empty for ACT), and the state's size."""
    from flashrt_ros.runtime.engine import PolicyEngine
    from flashrt_ros.runtime.policies import ACTChunkPolicy, SmolVLAChunkPolicy
    from flashrt_ros.runtime.policies import lerobot_demo as demo
    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_inputs
    if kind == 'act':
        folder, ours = demo.act_checkpoint(f'{tmp}/checkpoint', size='published'), \
            ACTChunkPolicy
        state_dim = demo.ACT_SIZES['published']['dims'][0]
    else:
        folder, ours = demo.checkpoint(demo.vlm_folder(f'{tmp}/vlm'), f'{tmp}/checkpoint'), \
            SmolVLAChunkPolicy
        state_dim = demo.STATE_DIM
    cameras, _, tokenize = checkpoint_inputs(folder)
    if size is not None:
        cameras = {k: (3, *size) for k in cameras}
    ids, mask = tokenize('pick up the red cube') if tokenize else (np.zeros(0, np.float32),) * 2
    engines = {p: PolicyEngine(ours.from_pretrained(folder, cameras=cameras, seed=3),
                               device=device, capsule_dir=f'{tmp}/{p}')
               for p in ('host', 'device')}
    return engines, cameras, (ids, mask), state_dim


def run(device, kind, size, cfg, tmp, checks):
    from flashrt_ros.runtime.camera_inputs import as_floats, CameraObservation
    engines, cameras, (ids, mask), state_dim = _policies(kind, size, tmp, device)
    steps = engines['host'].policy.steps
    rng = np.random.default_rng(0)

    def reading():
        return (rng.standard_normal(state_dim).astype(np.float32),
                [rng.integers(0, 256, (s[1], s[2], 3), dtype=np.uint8)
                 for s in cameras.values()])
    readings = [reading() for _ in range(cfg['steps'])]
    assembled = CameraObservation(state_dim, cameras, len(ids), device)
    if len(ids):
        assembled.put_tokens(ids, mask)

    def host(state, frames):
        vector = np.concatenate([state, *[as_floats(f).ravel() for f in frames], ids, mask])
        return engines['host'].step(vector)

    def on_device(state, frames):
        for key, frame in zip(cameras, frames):
            assembled.put_image(key, frame)
        assembled.put_state(state)
        return engines['device'].step_all(assembled.vector.view(1, -1))[0].cpu()
    paths = (('host', host), ('device', on_device))
    times = {p: {'pop': [], 'chunk': []} for p, _ in paths}
    actions = {p: [] for p, _ in paths}
    for e in engines.values():
        e.snapshot('start')
    for t, (state, frames) in enumerate(readings):   # interleaved: noise moves both
        for path, fn in paths:
            t0 = time.perf_counter()
            actions[path].append(fn(state, frames))
            if t % steps:
                times[path]['pop'].append((time.perf_counter() - t0) * 1e6)
    for _ in range(cfg['chunks']):
        state, frames = reading()
        for path, fn in paths:
            engines[path].restore('start')
            t0 = time.perf_counter()
            fn(state, frames)
            times[path]['chunk'].append((time.perf_counter() - t0) * 1e6)
    shapes = ', '.join(f'{h} x {w}' for _, h, w in cameras.values())
    name = f'{kind} ({len(cameras)} camera{"s" * (len(cameras) > 1)} {shapes})'
    same = all(torch.equal(a, b) for a, b in zip(actions['host'], actions['device']))
    for _ in range(8):
        engines['device'].restore('start')
        same &= all(torch.equal(on_device(s, f), a)
                    for (s, f), a in zip(readings, actions['host']))
    check(checks, f'{name}: the device-assembled observation acts as the host-packed one, bit '
          f'for bit over {len(readings)} steps, 8 replays', same)
    return {'cameras': name, 'observation_mb': 4 * assembled.vector.numel() / 2 ** 20,
            'frames_mb': sum(h * w * 3 for _, h, w in cameras.values()) / 2 ** 20,
            **{path: {k: stats(v) for k, v in ts.items()} for path, ts in times.items()}}


def render(results):
    env, out = results['environment'], []
    out += [f'# Camera frames into the policy step: host float32 vector vs device assembly: '
            f'{env["device_name"]} ({env["mode"]})\n', environment_line(env),
            '- the demo SmolVLA checkpoint (tiny, random weights) and ACT at its published '
            'size (random weights), new frames from every camera every step; whole call, '
            'host wall in us (p50 / p99); pop: a step that takes the next action of the '
            'queue, chunk: one that computes the chunk\n',
            '| policy, cameras | observation (float32) / frames (uint8) MB | pop: host | pop: '
            'device (ratio) | chunk: host | chunk: device (ratio) |', '|' + ' --- |' * 6]
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
    for kind, size in CONFIGS[mode]['rows']:
        with tempfile.TemporaryDirectory(prefix='frt-inputs-') as tmp:
            report.results['sections']['rows'].append(
                run(device, kind, size, CONFIGS[mode], tmp, report.results['checks']))
        report.write()
    log(render(report.results))
    return 1 if any(not c['passed'] for c in report.results['checks']) else 0


if __name__ == '__main__':
    sys.exit(main())
