"""A fleet's real-time chunking when two robots' chunks overlap (runtime/policies/lerobot_rtc.py):
RealTimeChunkPolicy's own step, launch and landing, over a stand-in for its
chunk graphs that is ~50 ms of GPU work (torch.cuda._sleep) and adds 1 to the chunk, so that
what the host waits for is the streams' ordering alone, not a model. Two sessions, A and B:
A launches, B launches while A's chunk is in flight, then each lands. The whole step is timed,
the current stream synchronised before and after (what a tick's action read-back waits for).
A first round warms CUDA up (its first launch pays the context's start); the second is the
measurement.

    python -m benchmarks.rtc_fleet_overlap --commit <sha> [--baseline <tree>] [--out <path>]

--baseline: a checkout of an earlier commit (git worktree add /tmp/old ec625c7), whose
RealTimeChunkPolicy is measured beside this tree's, each in a fresh process.

One set of chunk graphs and one side stream serve every session: the flights queue there one
behind another. Before 2026-12-08 a launch while another session's chunk flew waited for it
(~50 ms here), and a landing waited for whatever the side stream held; now a launch returns at
once, and a landing waits for its own flight (and those queued before it) only.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch
from torch import nn

from flashrt_ros.runtime.policies.lerobot_rtc import RealTimeChunkPolicy

CHUNK, ACT, OBS = 8, 4, 16
SLEEP_CYCLES = int(1e8)     # ~50 ms of one SM's clock on an H100


class StandInGraph:
    """A chunk graph's replay: ~50 ms on the current stream, then outputs that change."""

    def __init__(self, out, device):
        self.out, self.device = out, device

    def replay(self):
        if self.device.type == 'cuda':
            torch.cuda._sleep(SLEEP_CYCLES)
        self.out['queue'].add_(1)
        self.out['original'].add_(1)


class StandInPolicy(RealTimeChunkPolicy):
    """RealTimeChunkPolicy's step, launch and landing over StandInGraph (no model)."""

    device = None       # a plain attribute here, not the policy's property over its weights

    def __init__(self, device):
        nn.Module.__init__(self)
        self.device = device
        self.rtc, self.prefix_reused = object(), 0
        self.chunk, self.delay, self.threshold, self.act_dim, self.obs_dim = \
            CHUNK, 2, 3, ACT, OBS
        out = {'queue': torch.zeros(CHUNK, ACT, device=device),
               'original': torch.zeros(CHUNK, ACT, device=device)}
        graph = StandInGraph(out, device)
        self._guided, self._guided_out = {False: graph, True: graph}, {False: out, True: out}
        self._side = torch.cuda.Stream(device) if device.type == 'cuda' else None
        self._chunk_obs = torch.zeros(OBS, device=device)
        self._chunk_rng = torch.zeros(2, dtype=torch.int64, device=device)
        self._leftover = torch.zeros(3, ACT, device=device)
        self._flights = {}
        # what RealTimeChunkPolicy kept before 2026-12-08 (a --baseline tree of then)
        self._flight = self._owner = None
        self._landed = {}


def session_views(device):
    """One session's state: a launch at its next step, no prefix kept."""
    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=device)
    views = {'left': zeros(3, dtype=torch.int64), 'queue': zeros(CHUNK, ACT),
             'original': zeros(CHUNK, ACT), 'flight_obs': zeros(OBS),
             'flight_rng': zeros(2, dtype=torch.int64), 'rng': zeros(2, dtype=torch.int64),
             'prefix_obs': zeros(OBS), 'prefix_ready': zeros(1, dtype=torch.int64)}
    views['left'][0], views['left'][1] = 3, -1
    views['prefix_obs'] += 1
    return views


def run(device, pause_ms):
    """Per round, (step, ms) as the host waited for each; pause_ms of host time after each
    step (a control loop's period spent elsewhere), none in the back-to-back rounds."""
    policy = StandInPolicy(device)
    obs, action = torch.zeros(OBS, device=device), torch.zeros(ACT, device=device)

    def sync():
        if device.type == 'cuda':
            torch.cuda.current_stream(device).synchronize()

    def step(views, pause):
        policy.views = views
        sync()
        start = time.perf_counter()
        policy.step(obs, action)
        sync()
        took = 1e3 * (time.perf_counter() - start)
        time.sleep(pause / 1e3)
        return took
    rounds = {}
    for name, pause in (('warm-up', 0), ('back to back', 0),
                        (f'paced: {pause_ms} ms of host time after each step', pause_ms)):
        a, b = session_views(device), session_views(device)
        rounds[name] = [(what, step(views, pause)) for what, views in (
            ('A launches (alone)', a), ('A plays its queue (A in flight)', a),
            ('B launches while A is in flight', b), ('B plays its queue', b),
            ('A lands', a), ('B lands', b))]
    return rounds


def measured(tree, pause_ms):
    """run() in a fresh process with flashrt_ros imported from tree."""
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join(
        [os.path.abspath(tree), os.environ.get('PYTHONPATH', '')])}
    done = subprocess.run([sys.executable, __file__, '--rounds', '--pause-ms', str(pause_ms)],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--commit', default='unknown')
    parser.add_argument('--out', default='')
    parser.add_argument('--pause-ms', type=float, default=20.0)
    parser.add_argument('--baseline', default='',
                        help='another tree of this repository (an earlier commit\'s '
                        'checkout): its RealTimeChunkPolicy measured beside this one')
    parser.add_argument('--rounds', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    if args.rounds:         # measured()'s child: this tree's rounds as JSON
        print(json.dumps(run(device, args.pause_ms)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {f'commit {args.commit}': here}
    if args.baseline:
        trees['baseline'] = args.baseline
    results = {label: measured(tree, args.pause_ms) for label, tree in trees.items()}
    name = torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'
    lines = [f'# A fleet\'s real-time chunking, two chunks overlapping: {name}', '',
             f'- date: {datetime.datetime.now(datetime.timezone.utc).isoformat()}, torch '
             f'{torch.__version__}, CUDA {torch.version.cuda}, commit {args.commit}',
             '- the whole step, ms (the current stream synchronised before and after); the '
             'stand-in chunk is ~50 ms of GPU work; each tree in a fresh process',
             f'- baseline: {args.baseline or "none"}', '']
    for round_name in results[f'commit {args.commit}']:
        lines += [f'## {round_name}', '', '| step | ' + ' | '.join(trees) + ' |',
                  '| --- |' + ' --- |' * len(trees)]
        rows = zip(*(results[label][round_name] for label in trees))
        lines += [f'| {row[0][0]} | ' + ' | '.join(f'{ms:.1f}' for _, ms in row) + ' |'
                  for row in rows] + ['']
    lines.append(f'Command: `python -m benchmarks.rtc_fleet_overlap --commit {args.commit}'
                 f'{" --baseline " + args.baseline if args.baseline else ""}`')
    text = '\n'.join(lines) + '\n'
    print(text)
    if args.out:
        with open(args.out + '.md', 'w') as out:
            out.write(text)


if __name__ == '__main__':
    main()
