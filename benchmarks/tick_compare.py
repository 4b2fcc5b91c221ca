"""One fleet tick against another commit's: p50 of the whole step_all call and of the graph
replay alone for the 4,096-session G1-size LSTM (batch-invariant and default batched kernels),
in the tree it runs from. Run it alternately from two trees in one session, so that both see
the same machine (a host's speed moves between machines and minutes):

    git archive <base> flashrt_ros benchmarks | tar -x -C /tmp/base
    cp benchmarks/tick_compare.py /tmp/base/benchmarks/     # a base older than this file
    for r in 1 2 3; do (cd /tmp/base && python -m benchmarks.tick_compare --label <base>)
                       python -m benchmarks.tick_compare --label <this commit>; done
"""

import argparse
import json
import tempfile

import numpy as np
import torch

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.policies import make_policy

from .tick_profile import LSTM, N, p50_us     # p50_us: 10 calls to warm up, then k timed

TICKS = 300


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--label', default='')
    args = ap.parse_args()
    obs = np.random.default_rng(0).standard_normal((N, 47)).astype(np.float32)
    row = {'label': args.label}
    for kernels, batched in (('batch_invariant', False), ('default', True)):
        policy = make_policy('recurrent', 47, 12, seed=0, **LSTM).set_kernels(kernels)
        e = PolicyEngine(policy, device='cuda', sessions=N, batch_sessions=batched,
                         rollback_depth=4, capsule_dir=tempfile.mkdtemp(), determinism_probe=0)
        graph = e.program.graph

        def replay():
            graph.replay()
            torch.cuda.synchronize()
        row[kernels] = {'step_all_us': p50_us(lambda: e.step_all(obs), TICKS),
                        'replay_us': p50_us(replay, TICKS)}
    print(json.dumps(row))


if __name__ == '__main__':
    main()
