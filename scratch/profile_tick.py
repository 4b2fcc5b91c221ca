import time, tempfile, cProfile, pstats, numpy as np, torch
from torch.profiler import profile, ProfilerActivity
from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.policies import make_policy
tmp = tempfile.mkdtemp()
N = 4096
def eng(kernels, batched):
    p = make_policy('recurrent', 47, 12, seed=0, rnn_type='lstm', rnn_hidden_dim=64, actor_hidden_dims=(32,))
    p.set_kernels(kernels)
    return PolicyEngine(p, device='cuda', sessions=N, batch_sessions=batched, rollback_depth=4, capsule_dir=tmp)
obs = np.random.randn(N, 47).astype(np.float32)
def t(f, k=200):
    for _ in range(10): f()
    xs = []
    for _ in range(k):
        a = time.perf_counter(); f(); xs.append(time.perf_counter() - a)
    xs.sort(); return xs[len(xs)//2] * 1e6
for name, e in (('invariant', eng('batch_invariant', False)), ('batched', eng('default', True))):
    g, prog = e.program.graph, e.program
    def replay(): g.replay(); torch.cuda.synchronize()
    def issue(): prog.issue(0, 0); torch.cuda.synchronize()
    def full(): e.step_all(obs)
    def asobs(): e._observations(obs, rows=N)
    def stage(): prog.obs_np[:] = obs
    print(name, {k: round(t(f)) for k, f in [('replay', replay), ('issue', issue), ('step_all', full), ('as_observations', asobs), ('obs copy', stage)]})
    with profile(activities=[ProfilerActivity.CUDA]) as pr:
        for _ in range(20): replay()
    print(pr.key_averages().table(sort_by='cuda_time_total', row_limit=25))
    # capsule op after a tick vs after idle
    s = N // 2
    e.snapshot('c', session=s)
    def after_tick(): e.step_all(obs); a = time.perf_counter(); e.snapshot('c', True, session=s); return time.perf_counter() - a
    def after_replay(): replay(); a = time.perf_counter(); e.snapshot('c', True, session=s); return time.perf_counter() - a
    def idle(): time.sleep(0.001); a = time.perf_counter(); e.snapshot('c', True, session=s); return time.perf_counter() - a
    for lab, f in (('after tick', after_tick), ('after replay', after_replay), ('after 1ms idle', idle)):
        xs = sorted(f() for _ in range(100)); print(name, 'snapshot', lab, round(xs[50] * 1e6, 1))
    pr = cProfile.Profile(); pr.enable()
    for _ in range(100): e.step_all(obs)
    pr.disable(); pstats.Stats(pr).sort_stats('tottime').print_stats(15)
