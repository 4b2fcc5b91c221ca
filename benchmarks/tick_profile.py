"""Where a 4,096-session tick's time goes (CUDA): the graph replay alone, issue (copies in,
replay, copies out, one sync), the whole step_all call (observations from the host, and
resident on the device), its host parts, the kernels of one
replay (torch.profiler), and a snapshot of one session right after a tick, after a bare replay
and after 1 ms idle; for the G1-size LSTM on batch-invariant and on default batched kernels.

    python -m benchmarks.tick_profile > benchmarks/results/<date>-<device>-tick-profile.txt
"""

import tempfile
import time

import numpy as np
import torch
from torch.profiler import profile, ProfilerActivity

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.policies import make_policy

N = 4096
LSTM = {'rnn_type': 'lstm', 'rnn_hidden_dim': 64, 'actor_hidden_dims': (32,)}


def p50_us(fn, k=200):
    for _ in range(10):
        fn()
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[k // 2] * 1e6, 1)


def stages(e, obs, k=200):
    """p50 per tick of each part of step_all (its callees wrapped with a timer) and of the
    whole call; 'rest' is the call less its timed parts (the lines of step_all itself)."""
    import flashrt_ros.runtime.engine as engine_module
    spent, wrapped = {}, []

    def timed(owner, attr, label):
        fn = getattr(owner, attr)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
        setattr(owner, attr, wrapper)
        wrapped.append((owner, attr, fn))
    timed(engine_module, 'tick_control', 'tick_control')
    timed(e, '_observations', 'validate')
    timed(e.program, 'stage_control', 'stage_control')
    timed(e.program, 'issue', 'issue')
    timed(e.program.transfer, 'sync', 'sync (in issue window)')
    timed(e._sessions, 'stepped', 'stepped')
    rows = {}
    for i in range(k + 10):
        spent.clear()
        t0 = time.perf_counter()
        e.step_all(obs)
        total = time.perf_counter() - t0
        if i >= 10:
            parts = dict(spent, total=total)
            parts['rest'] = total - sum(v for n, v in spent.items() if not n.startswith('sync'))
            for n, v in parts.items():
                rows.setdefault(n, []).append(v)
    for owner, attr, fn in wrapped:
        if owner is engine_module:
            setattr(owner, attr, fn)
        else:
            delattr(owner, attr)
    return {n: round(sorted(v)[len(v) // 2] * 1e6, 1) for n, v in rows.items()}


def engine(kernels, batched):
    policy = make_policy('recurrent', 47, 12, seed=0, **LSTM).set_kernels(kernels)
    return PolicyEngine(policy, device='cuda', sessions=N, batch_sessions=batched,
                        rollback_depth=4, capsule_dir=tempfile.mkdtemp())


def main():
    print(f'torch {torch.__version__}, {torch.cuda.get_device_name()}, N = {N}')
    obs = np.random.default_rng(0).standard_normal((N, 47)).astype(np.float32)
    resident = torch.from_numpy(obs).cuda()     # a GPU-resident farm's observations
    for name, e in (('invariant', engine('batch_invariant', False)),
                    ('batched', engine('default', True))):
        graph, program, sync = e.program.graph, e.program, torch.cuda.synchronize

        def replay():
            graph.replay()
            sync()

        def issue():
            program.issue(0, 0)
            sync()

        def write_issue():      # the observations freshly written into pinned memory
            program.obs_np[:] = obs
            issue()

        def issue_read():       # the actions read by the host right after their copy
            issue()
            program.act_np.copy()

        print(name, {'replay': p50_us(replay), 'issue': p50_us(issue),
                     'write + issue': p50_us(write_issue), 'issue + read': p50_us(issue_read),
                     'step_all': p50_us(lambda: e.step_all(obs)),
                     'step_all_resident': p50_us(lambda: e.step_all(resident)),
                     'as_observations': p50_us(lambda: e._observations(obs, rows=N))})
        print(name, 'step_all parts (p50 us)', stages(e, obs))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                replay()
        print(prof.key_averages().table(sort_by='cuda_time_total', row_limit=12))
        s = N // 2
        e.snapshot('c', session=s)
        for label, before in (('after a tick', lambda: e.step_all(obs)),
                              ('after a bare replay', replay),
                              ('after 1 ms idle', lambda: time.sleep(0.001))):
            times = []
            for _ in range(100):
                before()
                t0 = time.perf_counter()
                e.snapshot('c', True, session=s)
                times.append(time.perf_counter() - t0)
            print(name, 'snapshot', label, round(sorted(times)[50] * 1e6, 1), 'us')


if __name__ == '__main__':
    main()
