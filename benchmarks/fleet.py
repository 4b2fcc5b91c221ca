"""Fleet benchmark: one PolicyEngine with N sessions vs N single-session engines.

    python -m benchmarks.fleet --device cuda --commit <sha> --out benchmarks/results/<name>
    python -m benchmarks.fleet --smoke --device cpu --out /tmp/fleet_smoke     # the test's run
    (--sections fleet_tick,fleet_capsule_ops,branches picks sections, --ns 1,8 the fleet sizes
    of section 1, --threads the torch CPU threads; the full H200 run takes about 95 s)

Three sections, for an Isaac Lab sized locomotion MLP and a G1-like LSTM (47 observations,
12 actions), every figure the host wall time of the whole public call (PolicyEngine.step_all,
.step, .snapshot, ...), each comparison interleaved in one loop (shuffled every iteration):

  1. fleet tick   N sessions in one engine, exact (session by session inside one graph) and
                  batch_sessions=True (one batch per layer), against N separate single-session
                  engines stepped one after another (each its own captured graph);
  2. capsule ops  snapshot / restore / fork / rollback(1) on one session between fleet ticks,
                  and the same on a single-session engine;
  3. branches     K what-if branches of H steps from one capsule: K restores into a K-session
                  engine then H ticks, against one engine running the K branches in turn.

Identity checks (exact fleet == N single engines, parallel branches == sequential branches,
bit for bit) are recorded in the results; the run exits 1 when one fails. Writes <out>.json
and <out>.md after every section (default benchmarks/results/<date>-<device>-fleet[-smoke]).
"""

import argparse
import datetime
import gc
import os
import pathlib
import random
import sys
import tempfile
import time

import numpy as np
import torch

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.policies import make_policy

from .run import _pp, _us, device_slug, environment, log, MB, Report, ROOT
from .sections import _check, _free, _ratio, finite_numbers, interleaved
from .timing import stats, wall

OBS_DIM, ACT_DIM = 47, 12
POLICIES = {
    # Isaac Lab's rough-terrain locomotion actor
    'mlp': {'actor_hidden_dims': (512, 256, 128)},
    # the sizes of the Unitree G1 motion.pt (legged_gym PolicyExporterLSTM): LSTM 64, head 32
    'recurrent': {'rnn_type': 'lstm', 'rnn_hidden_dim': 64, 'actor_hidden_dims': (32,)},
}
SECTIONS = ('fleet_tick', 'fleet_capsule_ops', 'branches')
G1_POLICY = ROOT.parent / 'shared' / 'robots' / 'unitree_g1' / 'motion.pt'
FRAMES = 16         # distinct observation frames a fleet cycles through
OPS = ('snapshot', 'restore', 'fork', 'rollback')

# Sized so the full H200 run stays under ~4 minutes, engine construction included (512
# single-session engines capture 512 graphs per policy); ticks per N shrink as ticks grow.
CONFIGS = {
    'gpu': {'ns': [1, 8, 64, 512], 'ticks': {1: 2000, 8: 1000, 64: 500, 512: 250},
            'warmup': 10, 'compare_ticks': 32, 'baseline_budget_s': 90.0,
            'capsule_ns': [64, 512], 'capsule_rounds': {64: 200, 512: 60},
            'ks': [8, 64], 'horizon': 50, 'branch_reps': 20, 'root_steps': 20},
    'cpu': {'ns': [1, 8, 64, 512], 'ticks': {1: 400, 8: 200, 64: 60, 512: 20},
            'warmup': 3, 'compare_ticks': 16, 'baseline_budget_s': 120.0,
            'capsule_ns': [64, 512], 'capsule_rounds': {64: 40, 512: 10},
            'ks': [8, 64], 'horizon': 50, 'branch_reps': 4, 'root_steps': 20},
    'smoke': {'ns': [1, 4], 'ticks': {1: 12, 4: 12}, 'warmup': 2, 'compare_ticks': 8,
              'baseline_budget_s': 30.0, 'capsule_ns': [4], 'capsule_rounds': {4: 4},
              'ks': [2, 4], 'horizon': 6, 'branch_reps': 2, 'root_steps': 4},
}


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
        _free(run.device)
        before = run.memory()
        (e, us) = wall(lambda: run.engine(kind, n, batched))
        after = run.memory()
        out[name] = e
        info.update({f'{name}_create_s': us * 1e-6, f'{name}_graph_captured': e.graph_captured,
                     f'{name}_allocated_bytes': after[0] - before[0],
                     f'{name}_reserved_bytes': after[1] - before[1]})
    _free(run.device)
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
    _check(run.checks, f'fleet_tick {kind} N={n}: exact fleet actions equal {m} single-session '
           f'engines bit for bit ({len(single)} ticks)', same)
    _check(run.checks, f'fleet_tick {kind} N={n}: actions finite',
           bool(torch.isfinite(exact).all() and torch.isfinite(batched).all()))
    rates = {k: _steps_per_s(m if k == 'engines' else n, walls[k]) for k in walls}
    row = {'policy': kind, 'n': n, 'ticks': ticks, **{k: walls[k] for k in walls},
           'steps_per_s': rates, **info,
           'ratios': {'exact_vs_engines': _ratio(rates['exact'], rates['engines']),
                      'batched_vs_engines': _ratio(rates['batched'], rates['engines']),
                      'batched_vs_exact': _ratio(rates['batched'], rates['exact'])},
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
        ops[op].update({f'{w}_vs_single_p50': _ratio(ops[op][w]['p50'],
                                                     ops[op]['single']['p50'])
                        for w in ('exact', 'batched')})
    t = {k: stats(v) for k, v in ticks.items()}
    t['with_ops'] = t.pop('exact')
    return {'policy': kind, 'n': n, 'session': s, 'rounds': rounds,
            'live_nbytes_per_session': engines['exact'].arena.live_nbytes(0), 'ticks': t,
            'ops': ops,
            'ratios': {'tick_with_vs_without_ops_p50': _ratio(t['with_ops']['p50'],
                                                              t['without_ops']['p50']),
                       'tick_with_vs_without_ops_p99': _ratio(t['with_ops']['p99'],
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
    _check(run.checks, f'branches {kind} K={k}: parallel branch k (exact) equals sequential '
           f'branch k bit for bit ({k} x {H} actions)', same)
    p50 = {name: w['p50'] for name, w in walls.items()}
    row = {'policy': kind, 'k': k, 'horizon': H, 'reps': run.cfg['branch_reps'], **walls,
           'ratios': {'speedup_exact': _ratio(p50['sequential'], p50['parallel_exact']),
                      'speedup_batched': _ratio(p50['sequential'], p50['parallel_batched'])},
           'exact_bit_identical': bool(same),
           'exact_max_abs_diff': _max_abs_diff(exact, reference),
           'batched_max_abs_diff': _max_abs_diff(batched, reference),
           'capsule_nbytes': seq.store.get('root').manifest.nbytes}
    return row


def g1_sizes():
    """The LSTM sizes of the real G1 motion.pt when it is present, against POLICIES."""
    if not G1_POLICY.exists():
        return {'checked': False, 'note': f'{G1_POLICY} absent: sizes as configured'}
    shapes = {n: tuple(p.shape) for n, p in torch.jit.load(str(G1_POLICY)).named_parameters()}
    heads = sorted(n for n in shapes if n.startswith('actor.') and n.endswith('.weight'))
    found = {'obs_dim': shapes['memory.weight_ih_l0'][1],
             'rnn_hidden_dim': shapes['memory.weight_hh_l0'][1],
             'actor_hidden_dims': [shapes[n][0] for n in heads[:-1]],
             'act_dim': shapes[heads[-1]][0]}
    want = POLICIES['recurrent']
    match = found == {'obs_dim': OBS_DIM, 'rnn_hidden_dim': want['rnn_hidden_dim'],
                      'actor_hidden_dims': list(want['actor_hidden_dims']), 'act_dim': ACT_DIM}
    return {'checked': True, 'file': str(G1_POLICY), 'found': found, 'match': match}


# ---------------------------------------------------------------- report

def _rate(x):
    return f'{x / 1e6:.2f}M' if x >= 1e6 else f'{x / 1e3:.1f}k' if x >= 1e3 else f'{x:.0f}'


def render(results):
    env, cfg = results['environment'], results['config']
    r, out = results['sections'], []
    out.append(f'# Fleet benchmark: {env["device_name"]} ({env["mode"]})\n')
    dirty = ' (flashrt_ros modified)' if env['git_dirty'] else ''
    out += [f'- date: {env["date"]}, host {env["hostname"]}',
            f'- device: {env["device"]} ({env["device_name"]}), CUDA {env["cuda"] or "-"}, '
            f'driver {env["driver"] or "-"}',
            f'- versions: torch {env["torch"]}, Python {env["python"]}, '
            f'{env["cpu_threads"]} torch CPU threads, load average {env["load_average_1m"]:.1f}'
            ' at start',
            f'- commit: {env["git_commit"]}{dirty} ({env["commit_source"]})',
            f'- policies: mlp {OBS_DIM}-{"-".join(map(str, POLICIES["mlp"]["actor_hidden_dims"]))}'
            f'-{ACT_DIM} elu; recurrent LSTM {POLICIES["recurrent"]["rnn_hidden_dim"]}, head '
            f'{POLICIES["recurrent"]["actor_hidden_dims"][0]}, elu ({OBS_DIM} obs, {ACT_DIM} '
            f'actions; G1 motion.pt sizes: {_g1_note(results.get("g1_sizes", {}))})',
            '- every time is the host wall time of the whole public call, p50 / p99 in us '
            '(ms where marked); variants of one row are interleaved in one loop, shuffled '
            'every iteration; "x" columns are ratios within the row\n']
    s = r.get('fleet_tick')
    if s and 'rows' in s:
        out.append('## 1. Fleet tick: one engine with N sessions vs N single-session engines\n')
        out.append('exact: PolicyEngine(sessions=N), session by session inside one graph; '
                   'batched: batch_sessions=True, one batch per layer; engines: N separate '
                   'single-session engines (each its own captured graph), a tick = .step() on '
                   'each in turn. steps/s = N / tick p50. "= engines": exact actions equal the '
                   'engines\' bit for bit; "batched diff": max abs difference of batched from '
                   'exact actions over all ticks (batched rounds differently; |action| max in '
                   'brackets).\n')
        out.append('| policy | N | exact tick | exact steps/s | batched tick | batched steps/s '
                   '| engines tick | engines steps/s | exact x engines | batched x engines | '
                   '= engines | batched diff |')
        out.append('|' + ' --- |' * 12)
        for w in s['rows']:
            q, v = w['ratios'], w['steps_per_s']
            out.append(f'| {w["policy"]} | {w["n"]} | {_pp(w["exact"])} | {_rate(v["exact"])} '
                       f'| {_pp(w["batched"])} | {_rate(v["batched"])} | {_pp(w["engines"])} | '
                       f'{_rate(v["engines"])} | {q["exact_vs_engines"]:.2f} | '
                       f'{q["batched_vs_engines"]:.2f} | '
                       f'{"yes" if w["exact_equals_engines"] else "NO"} | '
                       f'{w["batched_vs_exact_max_abs_diff"]:.2g} '
                       f'({w["action_abs_max"]:.2g}) |')
        out.append('\nConstruction (graph capture included) and memory each build added, MB '
                   'allocated / reserved (CUDA caching allocator; CPU: resident set, both '
                   'columns). CUDA "allocated" includes cuBLAS workspaces made on first use '
                   'of each capture stream, process-wide, so the first rows absorb them; '
                   '"reserved" includes every captured graph\'s private memory pool.\n')
        out.append('| policy | N | exact engine s | exact MB | batched engine s | batched MB | '
                   'N engines built | N engines s | ms each | N engines MB |')
        out.append('|' + ' --- |' * 10)
        for w in s['rows']:
            out.append(f'| {w["policy"]} | {w["n"]} | {w["exact_create_s"]:.2f} | '
                       f'{_mem(w, "exact")} | {w["batched_create_s"]:.2f} | '
                       f'{_mem(w, "batched")} | {w["engines_built"]} | '
                       f'{w["engines_create_s"]:.2f} | {w["engines_create_ms_each"]:.1f} | '
                       f'{_mem(w, "engines")} |')
        out += [f'\n{w["policy"]} N={w["n"]}: {w["note"]}' for w in s['rows'] if 'note' in w]
        out.append('')
    s = r.get('fleet_capsule_ops')
    if s and 'rows' in s:
        out.append('## 2. Capsule operations on one session while the fleet steps\n')
        out.append('N-session engines (exact, and batched); between ticks of the whole fleet, '
                   'one op on one session (every op follows a tick, so rollback(1) has a step '
                   'to undo); "single": the same op on a single-session engine between its '
                   'steps. Op cells: whole call p50 / p99 [OpResult.latency_us p50, the copy '
                   'window]. Tick rows: the exact fleet\'s tick with no ops between ticks, and '
                   'each engine\'s tick (step) when an op sits between ticks, with the exact '
                   'tick\'s with / without ratio.\n')
        out.append('| policy | N | what | exact fleet | batched fleet | single-session | '
                   'exact x single | batched x single |')
        out.append('|' + ' --- |' * 8)
        for w in s['rows']:
            t, head = w['ticks'], f'| {w["policy"]} | {w["n"]} |'
            out.append(f'{head} tick, no ops between | {_pp(t["without_ops"])} | | | | |')
            out.append(f'{head} tick, an op between (exact: x '
                       f'{w["ratios"]["tick_with_vs_without_ops_p50"]:.2f} of no ops) | '
                       f'{_pp(t["with_ops"])} | {_pp(t["batched"])} | {_pp(t["single"])} | | |')
            for op in OPS:
                o = w['ops'][op]
                cells = [f'{_pp(o[e])} [{_us(o[e + "_copy_window"]["p50"])}]'
                         for e in ('exact', 'batched', 'single')]
                out.append(f'{head} {op}{"(1)" if op == "rollback" else ""} | '
                           f'{" | ".join(cells)} | {o["exact_vs_single_p50"]:.2f} | '
                           f'{o["batched_vs_single_p50"]:.2f} |')
        out.append('')
    s = r.get('branches')
    if s and 'rows' in s:
        out.append(f'## 3. K branches from one capsule: parallel sessions vs one engine in '
                   f'turn (H = {cfg["horizon"]} steps each)\n')
        out.append('sequential: one single-session engine, per branch restore + H steps; '
                   'parallel: K restores into a K-session engine, then H step_all ticks. Wall '
                   'time of all K branches, p50 / p99 in ms. "bit for bit": parallel (exact) '
                   'branch k equals sequential branch k; batched diff: max abs difference of '
                   'the batched engine\'s branches from the sequential ones.\n')
        out.append('| policy | K | sequential ms | parallel exact ms | x | parallel batched ms '
                   '| x | bit for bit | batched diff |')
        out.append('|' + ' --- |' * 9)
        for w in s['rows']:
            q = w['ratios']
            out.append(f'| {w["policy"]} | {w["k"]} | {_ms(w["sequential"])} | '
                       f'{_ms(w["parallel_exact"])} | {q["speedup_exact"]:.2f} | '
                       f'{_ms(w["parallel_batched"])} | {q["speedup_batched"]:.2f} | '
                       f'{"yes" if w["exact_bit_identical"] else "NO"} | '
                       f'{w["batched_max_abs_diff"]:.2g} |')
        out.append('')
    checks = results['checks']
    passed = sum(c['passed'] for c in checks)
    out.append(f'## Identity checks: {passed} / {len(checks)} passed\n')
    out += [f'- {"passed" if c["passed"] else "FAILED"}: {c["name"]} {c["detail"]}'.rstrip()
            for c in checks]
    out.append(f'\nTotal run time {results.get("elapsed_s", 0):.0f} s. Command: '
               f'`{results.get("command", "")}`')
    return '\n'.join(out) + '\n'


def _mem(row, name):
    return f'{row[name + "_allocated_bytes"] / MB:.1f} / {row[name + "_reserved_bytes"] / MB:.1f}'


def _ms(s):
    return f'{s["p50"] / 1e3:.2f} / {s["p99"] / 1e3:.2f}'


def _g1_note(g):
    if not g.get('checked'):
        return 'not checked (file absent)'
    return 'match' if g['match'] else f'DIFFER: {g["found"]}'


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--smoke', action='store_true', help='small N, few iterations (the test)')
    ap.add_argument('--device', default='auto', help="'auto' (cuda when present), 'cpu', 'cuda'")
    ap.add_argument('--out', default='', help='output path stem (.json and .md are written)')
    ap.add_argument('--commit', default='',
                    help='the flashrt_ros commit of this tree, when it is not a git checkout')
    ap.add_argument('--sections', default='', help=f'comma list (default all): {SECTIONS}')
    ap.add_argument('--ns', default='', help='comma list of fleet sizes for section 1')
    ap.add_argument('--threads', type=int, default=0,
                    help="torch CPU threads (default: torch's own; 1 with --smoke)")
    args = ap.parse_args(argv)
    # The smoke run shares small CPU VMs with other work: two OpenMP threads on a busy
    # 2-core VM stalled a 4-row matmul at a barrier for ~30 ms per call (measured), which
    # makes the test slow and says nothing about the engine. The header records the count.
    threads = args.threads or (1 if args.smoke else 0)
    if threads:
        torch.set_num_threads(threads)
    device = torch.device('cuda' if args.device == 'auto' and torch.cuda.is_available() else
                          ('cpu' if args.device == 'auto' else args.device))
    mode = 'smoke' if args.smoke else ('gpu' if device.type == 'cuda' else 'cpu')
    cfg = dict(CONFIGS[mode])
    if args.ns:
        cfg['ns'] = [int(x) for x in args.ns.split(',')]
        cfg['ticks'] = {n: cfg['ticks'].get(n, min(cfg['ticks'].values())) for n in cfg['ns']}
    wanted = [s.strip() for s in args.sections.split(',') if s.strip()] or list(SECTIONS)
    if set(wanted) - set(SECTIONS):
        ap.error(f'unknown sections {sorted(set(wanted) - set(SECTIONS))}; from {SECTIONS}')

    env = environment(device, f'fleet-{mode}', args.commit)
    stem = f'{datetime.date.today().isoformat()}-{device_slug(env)}-fleet' + \
        ('-smoke' if mode == 'smoke' else '')
    out = pathlib.Path(args.out or ROOT / 'benchmarks' / 'results' / stem)
    out = out.with_suffix('') if out.suffix in ('.json', '.md') else out
    report = Report(out, env, {**cfg, 'policies': POLICIES, 'obs_dim': OBS_DIM,
                               'act_dim': ACT_DIM, 'frames': FRAMES}, render_md=render)
    report.results['command'] = 'python -m benchmarks.fleet ' + ' '.join(
        sys.argv[1:] if argv is None else argv)
    report.results['g1_sizes'] = g1_sizes()
    for s in SECTIONS:
        report.results['sections'][s] = {'skipped': 'not requested'} if s not in wanted \
            else {'rows': []}
    checks = report.results['checks']
    g1 = report.results['g1_sizes']
    if g1['checked']:
        _check(checks, 'recurrent sizes equal the G1 motion.pt', g1['match'], str(g1['found']))
    log(f'fleet benchmark: {env["device_name"]}, mode {mode}, torch {env["torch"]}, '
        f'writing {out}.json/.md')
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix='frt-fleet-') as tmp:
        run = Run(device, cfg, tmp, checks)
        for kind in POLICIES:
            for section, sizes, fn in (('fleet_tick', cfg['ns'], fleet_tick),
                                       ('fleet_capsule_ops', cfg['capsule_ns'], capsule_ops),
                                       ('branches', cfg['ks'], branches)):
                if section not in wanted:
                    continue
                for n in sizes:
                    t0 = time.perf_counter()
                    row = fn(run, kind, n)
                    _free(device)       # the section's engines went with its frame
                    report.results['sections'][section]['rows'].append(row)
                    report.write()
                    log(f'  [{section}] {kind} {n}: {_summary(section, row)} '
                        f'({time.perf_counter() - t0:.1f} s)')
    report.write()
    log('')
    log(render(report.results))
    bad = [c['name'] for c in checks if not c['passed']]
    nonfinite = finite_numbers(report.results['sections'])
    if nonfinite:
        log(f'non-finite numbers: {nonfinite}')
    if bad:
        log(f'identity checks FAILED: {bad}')
    return 1 if bad else 0


def _summary(section, w):
    if section == 'fleet_tick':
        return (f'exact {w["exact"]["p50"]:.0f} us, batched {w["batched"]["p50"]:.0f} us, '
                f'{w["engines_built"]} engines {w["engines"]["p50"]:.0f} us per tick; '
                f'x {w["ratios"]["exact_vs_engines"]:.2f} / '
                f'{w["ratios"]["batched_vs_engines"]:.2f}; engines built in '
                f'{w["engines_create_s"]:.1f} s')
    if section == 'fleet_capsule_ops':
        return ', '.join(f'{op} {w["ops"][op]["exact"]["p50"]:.0f} us' for op in OPS) + \
            f'; tick x {w["ratios"]["tick_with_vs_without_ops_p50"]:.2f} with ops'
    return (f'sequential {w["sequential"]["p50"] / 1e3:.1f} ms, parallel exact '
            f'{w["parallel_exact"]["p50"] / 1e3:.1f} ms (x {w["ratios"]["speedup_exact"]:.2f}), '
            f'bit for bit {w["exact_bit_identical"]}')


if __name__ == '__main__':
    sys.exit(main())
