"""Section 5, control step: PolicyEngine.step per call on a recurrent and a history policy,
on a captured CUDA graph and eager (eager only on the CPU), with the actions compared.
"""

import torch

from flashrt_ros.runtime.policies import make_policy

from .sections import ACT_DIM, bench_engine, check, free_memory, OBS_DIM, observations, ratio
from .timing import stats, wall


def control_step(cfg, device, checks, log):
    cuda = torch.device(device).type == 'cuda'
    modes = (True, False) if cuda else (False,)
    n = cfg['steps']
    obs = observations(n + 64, seed=3)
    out = {'steps': n, 'policies': {}}
    if not cuda:
        out['note'] = 'CPU: no CUDA graphs, eager only (the graph flag has no effect)'
    for kind, sizes in (('recurrent', cfg['recurrent']), ('history', cfg['history'])):
        res, actions = {}, {}
        for graph in modes:
            policy = make_policy(kind, OBS_DIM, ACT_DIM, seed=0, **sizes)
            e = bench_engine(policy, device, cuda_graph=graph)
            cap = e.arena.capacity
            walls, acts = [], []
            for i in range(n + 50):
                if cap and e.position >= cap:
                    e.reset_episode()        # untimed: the history is full
                a, us = wall(lambda: e.step(obs[i % len(obs)]))
                if i >= 50:
                    walls.append(us)
                if i < 200:
                    acts.append(a)
            dev = e.step_latency_us()
            name = 'graph' if e.graph_captured else 'eager'
            res[name] = {'wall': stats(walls),
                         'device_recent': {'p50': float(dev[0]), 'p99': float(dev[1])}}
            actions[name] = torch.stack(acts)
            log(f'  {kind} {name}: p50 {res[name]["wall"]["p50"]:.1f} us '
                f'p99 {res[name]["wall"]["p99"]:.1f} us')
            free_memory(device)
        entry = {'sizes': {k: (list(v) if isinstance(v, tuple) else v)
                           for k, v in sizes.items()}, **res}
        if 'graph' in res:
            g, x = res['graph']['wall'], res['eager']['wall']
            entry['ratios'] = {'eager_vs_graph_p50': ratio(x['p50'], g['p50']),
                               'graph_p99_vs_p50': ratio(g['p99'], g['p50'])}
            entry['graph_vs_eager_max_abs_diff'] = float(
                (actions['graph'] - actions['eager']).abs().max())
            check(checks, f'control_step {kind}: graph actions finite',
                  bool(torch.isfinite(actions['graph']).all()))
        else:
            check(checks, f'control_step {kind}: eager actions finite',
                  bool(torch.isfinite(actions['eager']).all()))
        out['policies'][kind] = entry
    return out
