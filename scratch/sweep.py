'''Tile sweep for invariant.py's Triton kernels on the device: per config, graph-replay time
of the G1 LSTM and the 512 MLP policy steps at N = 1, 512, 4096, and row invariance.'''
import time, torch, itertools
from flashrt_ros.runtime.policies import make_policy, invariant
from flashrt_ros.runtime.policies.invariant import verify
dev = 'cuda'
def timed_step(policy, n):
    views = {s.name: torch.zeros((n, *s.shape), dtype=s.dtype, device=dev) for s in policy.state_specs()}
    views['meta'] = torch.zeros(n, 4, dtype=torch.int64, device=dev)
    policy.bind(views, n)
    obs = torch.randn(n, 47, device=dev); act = torch.zeros(n, 12, device=dev)
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): policy.step(obs, act)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        policy.step(obs, act)
    for _ in range(10): g.replay()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(True), torch.cuda.Event(True)
    st.record()
    for _ in range(100): g.replay()
    en.record(); torch.cuda.synchronize()
    return st.elapsed_time(en) * 10  # us per replay
mlp = make_policy('mlp', 47, 12, seed=0, actor_hidden_dims=(512, 256, 128)).to(dev)
lstm = make_policy('recurrent', 47, 12, seed=0, rnn_type='lstm', rnn_hidden_dim=64, actor_hidden_dims=(32,)).to(dev)
for p in (mlp, lstm):
    q = make_policy(p.kind, 47, 12, seed=0, **({'actor_hidden_dims': (512, 256, 128)} if p is mlp else dict(rnn_type='lstm', rnn_hidden_dim=64, actor_hidden_dims=(32,)))).to(dev)
    print(p.kind, 'default', {n: round(timed_step(q, n), 1) for n in (1, 512, 4096)})
for p in (mlp, lstm): p.set_kernels('batch_invariant')
orig = invariant._tiles
for bm, bn, bk, in itertools.product((16, 32, 64), (16, 32, 64), (32, 64)):
    invariant._tiles = lambda cols, depth, c=(bm, bn, bk): c
    try:
        r = {n: round(timed_step(mlp, n), 1) for n in (1, 512, 4096)}
        verify(mlp, 4096, dev, rows=8); verify(mlp, 3, dev)
        print('mlp tiles', (bm, bn, bk), r, flush=True)
    except Exception as e:
        print('mlp tiles', (bm, bn, bk), 'ERR', str(e)[:200])
invariant._tiles = orig
print('mlp current tiles', {n: round(timed_step(mlp, n), 1) for n in (1, 512, 4096)})
for t in itertools.product((16, 32, 64), (16, 32, 64), (16, 32, 64)):
    invariant.LSTM_TILES = t
    try:
        r = {n: round(timed_step(lstm, n), 1) for n in (1, 512, 4096)}
        verify(lstm, 4096, dev, rows=8); verify(lstm, 3, dev)
        print('lstm tiles', t, r, flush=True)
    except Exception as e:
        print('lstm tiles', t, 'ERR', str(e)[:300])
