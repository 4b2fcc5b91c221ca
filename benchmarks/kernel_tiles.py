"""Tile sweep for the batch-invariant Triton kernels (flashrt_ros/runtime/policies/invariant.py):
per tile configuration, the captured policy step of the fleet benchmark's MLP (47-512-256-128-12)
and G1-size LSTM (64, head 32) replayed at N = 1, 512 and 4,096 rows (CUDA events, 100 replays,
us per replay), beside the default kernels (cuBLAS / cuDNN); each configuration is also checked
row-invariant (invariant.verify at N = 4,096 and 3).

    python -m benchmarks.kernel_tiles > benchmarks/results/<date>-<device>-kernel-tiles.txt

The tiles invariant.py uses were chosen from this output (a fixed configuration per layer
shape: the row count never picks the tiles).
"""

import itertools

import torch

from flashrt_ros.runtime.policies import invariant, make_policy

DEVICE = 'cuda'
SIZES = {'mlp': {'actor_hidden_dims': (512, 256, 128)},
         'recurrent': {'rnn_type': 'lstm', 'rnn_hidden_dim': 64, 'actor_hidden_dims': (32,)}}
NS = (1, 512, 4096)


def replay_us(policy, n):
    views = {s.name: torch.zeros((n, *s.shape), dtype=s.dtype, device=DEVICE)
             for s in policy.state_specs()}
    views['meta'] = torch.zeros(n, 4, dtype=torch.int64, device=DEVICE)
    policy.bind(views, n)
    obs, act = torch.randn(n, 47, device=DEVICE), torch.zeros(n, 12, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            policy.step(obs, act)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        policy.step(obs, act)
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 10, 1)


def sweep(policy, configs, apply):
    for config in configs:
        apply(config)
        try:
            times = {n: replay_us(policy, n) for n in NS}
            invariant.verify(policy, 4096, DEVICE, rows=8)
            invariant.verify(policy, 3, DEVICE)
            print(policy.kind, 'tiles', config, times, flush=True)
        except Exception as exc:     # a configuration Triton cannot build: say so, go on
            print(policy.kind, 'tiles', config, 'ERROR', str(exc)[:200], flush=True)


def main():
    print(f'torch {torch.__version__}, {torch.cuda.get_device_name()}')
    policies = {k: make_policy(k, 47, 12, seed=0, **v).to(DEVICE) for k, v in SIZES.items()}
    for kind, policy in policies.items():
        print(kind, 'default kernels', {n: replay_us(policy, n) for n in NS})
        policy.set_kernels('batch_invariant')
    chosen = invariant._tiles
    sweep(policies['mlp'], itertools.product((16, 32, 64), (16, 32, 64), (32, 64)),
          lambda c: setattr(invariant, '_tiles', lambda cols, depth: c))
    invariant._tiles = chosen
    print('mlp chosen tiles', {n: replay_us(policies['mlp'], n) for n in NS})
    lstm_chosen = invariant.LSTM_TILES
    sweep(policies['recurrent'], itertools.product((16, 32, 64), repeat=3),
          lambda c: setattr(invariant, 'LSTM_TILES', c))
    invariant.LSTM_TILES = lstm_chosen
    print('lstm chosen tiles', lstm_chosen, {n: replay_us(policies['recurrent'], n) for n in NS})


if __name__ == '__main__':
    main()
