"""A fleet's real-time chunking when two robots' chunks overlap (runtime/policies/lerobot_rtc.py):
RealTimeChunkPolicy's own step, launch, landing and _keep_for_owner, over a stand-in for its
chunk graphs that is ~50 ms of GPU work (torch.cuda._sleep) and adds 1 to the chunk, so that
what the host waits for is the streams' ordering alone, not a model. Two sessions, A and B:
A launches, B launches while A's chunk is in flight, then each lands. The whole step is timed,
the current stream synchronised before and after (what a tick's action read-back waits for).
A first round warms CUDA up (its first launch pays the context's start); the second is the
measurement.

    python -m benchmarks.rtc_fleet_overlap --commit <sha> [--out <path without suffix>]

One set of chunk graphs and one side stream serve every session: on CUDA, a launch while
another session's chunk flies waits for it, and a landing waits for whatever the side stream
holds, another session's chunk too.
"""
import argparse
import datetime
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


def run(device):
    policy = StandInPolicy(device)
    obs, action = torch.zeros(OBS, device=device), torch.zeros(ACT, device=device)

    def sync():
        if device.type == 'cuda':
            torch.cuda.current_stream(device).synchronize()

    def step(views):
        policy.views = views
        sync()
        start = time.perf_counter()
        policy.step(obs, action)
        sync()
        return 1e3 * (time.perf_counter() - start)
    rounds = {}
    for name in ('warm-up', 'measured'):
        a, b = session_views(device), session_views(device)
        rounds[name] = [(what, step(views)) for what, views in (
            ('A launches (alone)', a), ('A plays its queue (A in flight)', a),
            ('B launches while A is in flight', b), ('B plays its queue', b),
            ('A lands', a), ('B lands', b))]
    return rounds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--commit', default='unknown')
    parser.add_argument('--out', default='')
    args = parser.parse_args()
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    rounds = run(device)
    name = torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'
    lines = [f'# A fleet\'s real-time chunking, two chunks overlapping: {name}', '',
             f'- date: {datetime.datetime.now(datetime.timezone.utc).isoformat()}, torch '
             f'{torch.__version__}, CUDA {torch.version.cuda}, commit {args.commit}',
             '- the whole step, ms (the current stream synchronised before and after); the '
             'stand-in chunk is ~50 ms of GPU work', '']
    for round_name, steps in rounds.items():
        lines += [f'## {round_name}', '', '| step | ms |', '| --- | --- |']
        lines += [f'| {what} | {ms:.1f} |' for what, ms in steps] + ['']
    lines.append(f'Command: `python -m benchmarks.rtc_fleet_overlap --commit {args.commit}`')
    text = '\n'.join(lines) + '\n'
    print(text)
    if args.out:
        with open(args.out + '.md', 'w') as out:
            out.write(text)


if __name__ == '__main__':
    main()
