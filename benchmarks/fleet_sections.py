"""The fleet benchmark's engines and its three sections (fleet.py runs them, fleet_report.py
renders them): one PolicyEngine with N sessions against N single-session engines for a fleet
tick, capsule operations on one session while the fleet steps, and K what-if branches from one
capsule, parallel in sessions against one engine in turn. Every figure is the host wall time of
the whole public call; the variants of a row are interleaved in one loop.
"""

import gc
import os
import random
import time

import numpy as np
import torch

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.policies import make_policy

from .sections import check, free_memory, ratio
from .timing import interleaved, stats, wall

OBS_DIM, ACT_DIM = 47, 12
POLICIES = {
    # Isaac Lab's rough-terrain locomotion actor
    'mlp': {'actor_hidden_dims': (512, 256, 128)},
    # the sizes of the Unitree G1 motion.pt (legged_gym PolicyExporterLSTM): LSTM 64, head 32
    'recurrent': {'rnn_type': 'lstm', 'rnn_hidden_dim': 64, 'actor_hidden_dims': (32,)},
}
FRAMES = 16         # distinct observation frames a fleet cycles through
OPS = ('snapshot', 'restore', 'fork', 'rollback')


class Run:
    """What every section needs: device, config, a capsule directory shared by all engines
    (a capsule saved by one engine loads into another), the checks list."""

    def __init__(self, device, cfg, capsule_dir, checks):
        self.device, self.cfg, self.dir, self.checks = device, cfg, capsule_dir, checks
        self.cuda = device.type == 'cuda'

    def engine(self, kind, sessions=1, batched=False):
        # a fresh policy of the same seed per engine: the same weights, owned by that engine
        # (an engine binds its policy to its own arena); capsules stay in the device tier
        policy = make_policy(kind, OBS_DIM, ACT_DIM, seed=0, **POLICIES[kind])
        return PolicyEngine(policy, device=self.device, cuda_graph=True, sessions=sessions,
                            batch_sessions=batched, rollback_depth=4, device_budget=1 << 30,
                            host_budget=1 << 20, capsule_dir=self.dir)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def memory(self):
        """Bytes in use now: the CUDA caching allocator's (allocated, reserved), or the
        process's resident set on the CPU (twice, to keep one shape)."""
        if self.cuda:
            self.sync()
            return torch.cuda.memory_allocated(self.device), \
                torch.cuda.memory_reserved(self.device)
        rss = _rss_bytes()
        return rss, rss


def _rss_bytes():
    try:
        with open('/proc/self/statm') as f:
            return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
    except (OSError, ValueError, IndexError):
        return 0


def _frames(n, count, seed):
    """[count, n, OBS_DIM] float32 observations (numpy, as a fleet's driver hands them over)."""
    return np.random.default_rng(seed).standard_normal((count, n, OBS_DIM)).astype(np.float32)


def _max_abs_diff(a, b):
    return float((a - b).abs().max()) if a.numel() else 0.0


def _steps_per_s(n, tick):
    return n / (tick['p50'] * 1e-6) if tick['p50'] > 0 else 0.0


# ---------------------------------------------------------------- 1. fleet tick

def _build(run, kind, n):
    """(engines, construction info): exact and batched N-session engines, and up to N
    single-session engines (fewer only if building them overruns baseline_budget_s)."""
    info, out = {}, {}
    for name, batched in (('exact', False), ('batched', True)):
        free_memory(run.device)
        before = run.memory()
        (e, us) = wall(lambda: run.engine(kind, n, batched))
        after = run.memory()
        out[name] = e
        info.update({f'{name}_create_s': us * 1e-6, f'{name}_graph_captured': e.graph_captured,
                     f'{name}_allocated_bytes': after[0] - before[0],
                     f'{name}_reserved_bytes': after[1] - before[1]})
    free_memory(run.device)
    before = run.memory()
    singles, t0 = [], time.perf_counter()
    for _ in range(n):
        singles.append(run.engine(kind))
        if time.perf_counter() - t0 > run.cfg['baseline_budget_s']:
            break
    run.sync()
    elapsed = time.perf_counter() - t0
    after = run.memory()
    out['engines'] = singles
    info.update({'engines_built': len(singles), 'engines_create_s': elapsed,
                 'engines_create_ms_each': 1e3 * elapsed / len(singles),
                 'engines_allocated_bytes': after[0] - before[0],
                 'engines_reserved_bytes': after[1] - before[1],
                 'engines_graph_captured': bool(singles[0].graph_captured)})
    if len(singles) < n:
        info['note'] = (f'only {len(singles)} of {n} single-session engines were built within '
                        f'{run.cfg["baseline_budget_s"]:.0f} s; their steps/s is per engine '
                        'stepped, the ratios compare steps/s')
    return out, info


def fleet_tick(run, kind, n):
    engines, info = _build(run, kind, n)
    singles, m = engines['engines'], len(engines['engines'])
    frames = _frames(n, FRAMES, seed=n)
    ticks, keep = run.cfg['ticks'][n], run.cfg['compare_ticks']
    got = {'exact': [], 'batched': [], 'engines': []}

    def fleet(name):
        e, seen = engines[name], got[name]

        def tick():         # the whole public call: validation, copies, replay, sync
            seen.append(e.step_all(frames[len(seen) % FRAMES]))
        return tick

    def baseline():
        obs = frames[baseline.i % FRAMES]
        actions = [e.step(obs[j]) for j, e in enumerate(singles)]
        baseline.i += 1
        # only the first ticks are kept for the identity check: holding m tensors of every
        # tick would grow the garbage collector's work as the loop goes on
        if len(got['engines']) < keep:
            got['engines'].append(actions)
    baseline.i = 0

    gc.collect()
    run.sync()
    walls, _ = interleaved(None, {}, {}, ticks, run.cfg['warmup'], walled={
        'exact': fleet('exact'), 'batched': fleet('batched'), 'engines': baseline})
    exact, batched = torch.stack(got['exact']), torch.stack(got['batched'])
    single = torch.stack([torch.stack(a) for a in got['engines']])        # [keep, m, act]
    same = torch.equal(exact[:len(single), :m], single)
    check(run.checks, f'fleet_tick {kind} N={n}: exact fleet actions equal {m} single-session '
          f'engines bit for bit ({len(single)} ticks)', same)
    check(run.checks, f'fleet_tick {kind} N={n}: actions finite',
          bool(torch.isfinite(exact).all() and torch.isfinite(batched).all()))
    rates = {k: _steps_per_s(m if k == 'engines' else n, walls[k]) for k in walls}
    row = {'policy': kind, 'n': n, 'ticks': ticks, **{k: walls[k] for k in walls},
           'steps_per_s': rates, **info,
           'ratios': {'exact_vs_engines': ratio(rates['exact'], rates['engines']),
                      'batched_vs_engines': ratio(rates['batched'], rates['engines']),
                      'batched_vs_exact': ratio(rates['batched'], rates['exact'])},
           'exact_equals_engines': bool(same), 'ticks_compared_with_engines': len(single),
           'batched_vs_exact_max_abs_diff': _max_abs_diff(batched, exact),
           'batched_bit_identical_ticks': int(sum(torch.equal(a, b)
                                                  for a, b in zip(batched, exact))),
           'action_abs_max': float(exact.abs().max())}
    return row


# ---------------------------------------------------------------- 2. capsule ops in a fleet

def _ops_on(engine, session):
    """The four capsule operations on one session of `engine` (None: its only session)."""
    return {'snapshot': lambda: engine.snapshot('c', overwrite=True, session=session),
            'restore': lambda: engine.restore('c', session=session),
            'fork': lambda: engine.fork('', 'f', overwrite=True, session=session),
            'rollback': lambda: engine.rollback(1, session=session)}


def capsule_ops(run, kind, n):
    """Ops on one session between ticks of the whole fleet, in rounds of four kinds shuffled
    every cycle: four exact-fleet ticks in a row (the tick without ops); four (tick, op) pairs
    on the exact fleet; the same on a batched fleet (its graph is a few kernels where the
    exact one holds N sessions' worth: tells the size of the preceding replay from the number
    of sessions); four (step, op) pairs on a single-session engine (the reference). Every op
    follows a step of its session, so rollback(1) always has one to undo."""
    s = n // 2
    engines = {'exact': run.engine(kind, n), 'batched': run.engine(kind, n, batched=True),
               'single': run.engine(kind)}
    frames = _frames(n, FRAMES, seed=100 + n)
    counter = [0]

    def tick(name):
        def one():
            counter[0] += 1
            obs = frames[counter[0] % FRAMES]
            e = engines[name]
            return e.step(obs[s]) if name == 'single' else e.step_all(obs)
        return one

    steps = {name: tick(name) for name in engines}
    calls = {name: _ops_on(e, None if name == 'single' else s) for name, e in engines.items()}
    for name, e in engines.items():
        for _ in range(4):
            steps[name]()
        e.snapshot('c', session=None if name == 'single' else s)
    ticks = {'without_ops': [], **{name: [] for name in engines}}
    walls = {w: {op: [] for op in OPS} for w in engines}
    windows = {w: {op: [] for op in OPS} for w in engines}
    order = random.Random(0)
    rounds, warmup = run.cfg['capsule_rounds'][n], 2
    gc.collect()
    run.sync()
    for cycle in range(warmup + rounds):
        keep = cycle >= warmup
        kinds = ['without', *engines]
        order.shuffle(kinds)
        for what in kinds:
            ops = list(OPS)
            order.shuffle(ops)
            for op in ops:
                if what == 'without':
                    _, us = wall(steps['exact'])
                    if keep:
                        ticks['without_ops'].append(us)
                    continue
                _, us = wall(steps[what])
                result, op_us = wall(calls[what][op])
                if keep:
                    ticks[what].append(us)
                    walls[what][op].append(op_us)
                    windows[what][op].append(result.latency_us)
    ops = {}
    for op in OPS:
        ops[op] = {**{w: stats(walls[w][op]) for w in engines},
                   **{f'{w}_copy_window': stats(windows[w][op]) for w in engines}}
        ops[op].update({f'{w}_vs_single_p50': ratio(ops[op][w]['p50'],
                                                    ops[op]['single']['p50'])
                        for w in ('exact', 'batched')})
    t = {k: stats(v) for k, v in ticks.items()}
    t['with_ops'] = t.pop('exact')
    return {'policy': kind, 'n': n, 'session': s, 'rounds': rounds,
            'live_nbytes_per_session': engines['exact'].arena.live_nbytes(0), 'ticks': t,
            'ops': ops,
            'ratios': {'tick_with_vs_without_ops_p50': ratio(t['with_ops']['p50'],
                                                             t['without_ops']['p50']),
                       'tick_with_vs_without_ops_p99': ratio(t['with_ops']['p99'],
                                                             t['without_ops']['p99'])}}


# ---------------------------------------------------------------- 3. parallel branches

def branches(run, kind, k):
    """K branches of H steps from one capsule: sequential on one single-session engine vs
    parallel in a K-session engine (exact, and batched). The capsule is taken by the single
    engine and loaded by the others from its file: a capsule moves between engines of one
    model whatever their number of sessions."""
    H = run.cfg['horizon']
    seq, par, bat = run.engine(kind), run.engine(kind, k), run.engine(kind, k, batched=True)
    warm = _frames(1, run.cfg['root_steps'], seed=7)
    for o in warm:
        seq.step(o[0])
    seq.snapshot('root', overwrite=True)
    path = seq.save('root', f'root-{kind}-{k}.capsule').path
    for e in (par, bat):
        e.load(path, name='root', overwrite=True)
    obs = _frames(k, H, seed=200 + k)           # [H, K, obs]: branch k sees obs[:, k]
    last = {}

    def sequential():
        out = []
        for b in range(k):
            seq.restore('root')
            out.append([seq.step(obs[t, b]) for t in range(H)])
        last['sequential'] = out

    def parallel(e, name):
        def run_branches():
            for b in range(k):
                e.restore('root', session=b)
            last[name] = [e.step_all(obs[t]) for t in range(H)]
        return run_branches

    gc.collect()
    run.sync()
    walls, _ = interleaved(None, {}, {}, run.cfg['branch_reps'], 1, walled={
        'sequential': sequential, 'parallel_exact': parallel(par, 'parallel_exact'),
        'parallel_batched': parallel(bat, 'parallel_batched')})
    reference = torch.stack([torch.stack(b) for b in last['sequential']])   # [K, H, act]
    exact = torch.stack(last['parallel_exact']).transpose(0, 1)            # [K, H, act]
    batched = torch.stack(last['parallel_batched']).transpose(0, 1)
    same = torch.equal(exact, reference)
    check(run.checks, f'branches {kind} K={k}: parallel branch k (exact) equals sequential '
          f'branch k bit for bit ({k} x {H} actions)', same)
    p50 = {name: w['p50'] for name, w in walls.items()}
    row = {'policy': kind, 'k': k, 'horizon': H, 'reps': run.cfg['branch_reps'], **walls,
           'ratios': {'speedup_exact': ratio(p50['sequential'], p50['parallel_exact']),
                      'speedup_batched': ratio(p50['sequential'], p50['parallel_batched'])},
           'exact_bit_identical': bool(same),
           'exact_max_abs_diff': _max_abs_diff(exact, reference),
           'batched_max_abs_diff': _max_abs_diff(batched, reference),
           'capsule_nbytes': seq.store.get('root').manifest.nbytes}
    return row
