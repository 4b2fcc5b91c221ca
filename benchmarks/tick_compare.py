"""One fleet tick against another commit's: p50 of the whole step_all call and of the graph
replay alone for the 4,096-session G1-size LSTM (batch-invariant and default batched kernels),
in the tree it runs from. Run it alternately from two trees in one session, so that both see
the same machine (a host's speed moves between machines and minutes):

    git archive <base> flashrt_ros benchmarks | tar -x -C /tmp/base
    for r in 1 2 3; do (cd /tmp/base && python -m benchmarks.tick_compare --label <base>)
                       python -m benchmarks.tick_compare --label <this commit>; done
"""

import argparse
import json
import tempfile
import time

import numpy as np
import torch

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.policies import make_policy

N, TICKS = 4096, 300
LSTM = {'rnn_type': 'lstm', 'rnn_hidden_dim': 64, 'actor_hidden_dims': (32,)}


def p50_us(fn):
    times = []
    for _ in range(TICKS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[TICKS // 2] * 1e6, 1)


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
        for _ in range(20):
            e.step_all(obs)
        graph = e.program.graph

        def replay():
            graph.replay()
            torch.cuda.synchronize()
        row[kernels] = {'step_all_us': p50_us(lambda: e.step_all(obs)),
                        'replay_us': p50_us(replay)}
    print(json.dumps(row))


if __name__ == '__main__':
    main()
