"""Fleet at scale: exact fleets on batch-invariant kernels against batched and N engines, up
to 4,096 sessions, with the replay floor and capsule operations inside large fleets.

    python -m benchmarks.fleet_scale --device cuda --commit <sha> --out benchmarks/results/<n>
    python -m benchmarks.fleet_scale --smoke --device cpu --out /tmp/scale_smoke   # the test

For an Isaac Lab sized MLP (47-512-256-128-12) and a G1-sized LSTM (64, head 32), per fleet
size N, in one interleaved loop (every figure the host wall time of the whole step_all call):
  invariant  kernels='batch_invariant': the fleet as one batch, exact (each session bit for bit
             a single-session engine on the same kernels);
  batched    default kernels, batch_sessions=True: one batch, rounding depends on the batch;
  exact      default kernels, session by session inside one graph (N <= exact_max_n);
  engines    min(N, engines_max) single-session engines on default kernels, one after another;
  replay     the invariant and batched engines' graph replay and sync alone: the floor under
             the whole call (tick / replay says how much the host adds);
  resident   the invariant and batched fleets given observations already on the device (a
             GPU-resident farm: validated and staged there, actions returned there).
Capsule ops: snapshot / restore / fork / rollback(1) on one session of an N-session invariant
fleet between ticks, against the same op on a single-session invariant engine.
Identity checks (recorded, exit 1 on failure): the invariant fleet equals single-session
invariant engines at sampled sessions, every compared tick; the exact fleet equals default
engines; an op inside the fleet leaves the same actions as the single engine's.
"""

import argparse
import datetime
import gc
import random
import sys
import tempfile

import numpy as np
import torch

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.policies import make_policy

from .environment import device_slug, environment, resolve_device, results_stem
from .report import checks_and_command, environment_line, log, Report
from .sections import check, free_memory, ratio
from .timing import interleaved, stats, wall

OBS_DIM, ACT_DIM = 47, 12
POLICIES = {'mlp': {'actor_hidden_dims': (512, 256, 128)},
            'lstm': {'rnn_type': 'lstm', 'rnn_hidden_dim': 64, 'actor_hidden_dims': (32,)}}
KIND = {'mlp': 'mlp', 'lstm': 'recurrent'}
OPS = ('snapshot', 'restore', 'fork', 'rollback')
CONFIGS = {
    'gpu': {'ns': [1, 8, 64, 512, 4096], 'ticks': {1: 1000, 8: 1000, 64: 500, 512: 300,
                                                   4096: 200},
            'warmup': 10, 'exact_max_n': 512, 'engines_max': 512, 'singles': 8,
            'compare_ticks': 16, 'capsule_ns': [512, 4096], 'capsule_rounds': 100},
    'cpu': {'ns': [1, 8, 64, 512], 'ticks': {1: 300, 8: 200, 64: 60, 512: 20}, 'warmup': 3,
            'exact_max_n': 512, 'engines_max': 64, 'singles': 4, 'compare_ticks': 8,
            'capsule_ns': [512], 'capsule_rounds': 20},
    'smoke': {'ns': [1, 4], 'ticks': {1: 10, 4: 10}, 'warmup': 2, 'exact_max_n': 4,
              'engines_max': 4, 'singles': 2, 'compare_ticks': 4, 'capsule_ns': [4],
              'capsule_rounds': 3},
}


class Bench:
    def __init__(self, device, cfg, tmp, checks):
        self.device, self.cfg, self.tmp, self.checks = device, cfg, tmp, checks

    def engine(self, name, sessions=1, kernels='default', batched=False):
        policy = make_policy(KIND[name], OBS_DIM, ACT_DIM, seed=0, **POLICIES[name])
        policy.set_kernels(kernels)
        return PolicyEngine(policy, device=self.device, sessions=sessions,
                            batch_sessions=batched, rollback_depth=4, device_budget=1 << 30,
                            host_budget=1 << 20, capsule_dir=self.tmp)

    def sync(self):
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)


def _frames(n, count, seed):
    return np.random.default_rng(seed).standard_normal((count, n, OBS_DIM)).astype(np.float32)


def tick_row(b, name, n):
    cfg = b.cfg
    fleets = {'invariant': b.engine(name, n, 'batch_invariant'),
              'batched': b.engine(name, n, batched=True)}
    if n <= cfg['exact_max_n']:
        fleets['exact'] = b.engine(name, n)
    m = min(n, cfg['engines_max'])
    engines = [b.engine(name) for _ in range(m)]
    picks = sorted(random.Random(n).sample(range(n), min(n, cfg['singles'])))  # random rows
    singles = [b.engine(name, 1, 'batch_invariant') for _ in picks]
    frames = _frames(n, 16, seed=n)
    # identity first, from fresh states (the timed loop below replays graphs on their own,
    # which moves recurrent states): every variant steps the same frames
    keep = cfg['compare_ticks']
    got = {k: torch.stack([e.step_all(frames[t % 16]) for t in range(keep)])
           for k, e in fleets.items()}
    engines_out = torch.stack([torch.stack([e.step(frames[t % 16][j])
                                            for j, e in enumerate(engines)])
                               for t in range(keep)])
    singles_out = torch.stack([torch.stack([e.step(frames[t % 16][i])
                                            for e, i in zip(singles, picks)])
                               for t in range(keep)])
    inv = got['invariant']
    # observations resident on the device: a fresh invariant fleet equals the host path
    dframes = torch.from_numpy(frames).to(b.device)
    resident = b.engine(name, n, 'batch_invariant')
    check(b.checks, f'{name} N={n}: invariant fleet fed on the device equals it fed from the '
          f'host bit for bit ({keep} ticks)',
          torch.equal(torch.stack([resident.step_all(dframes[t % 16]).cpu()
                                   for t in range(keep)]), inv))
    del resident
    same = torch.equal(inv[:, picks], singles_out)
    check(b.checks, f'{name} N={n}: invariant fleet equals single-session invariant engines '
          f'at sessions {picks} bit for bit ({keep} ticks)', same)
    if 'exact' in fleets:
        check(b.checks, f'{name} N={n}: exact fleet equals {m} default engines bit for bit',
              torch.equal(got['exact'][:, :m], engines_out))

    def fleet(k, feed=frames):
        e = fleets[k]

        def tick():
            e.step_all(feed[tick.i % 16])
            tick.i += 1
        tick.i = 0
        return tick

    def step_engines():
        obs = frames[step_engines.i % 16]
        for j, e in enumerate(engines):
            e.step(obs[j])
        step_engines.i += 1
    step_engines.i = 0

    def replay(k):
        graph = fleets[k].program.graph

        def once():
            graph.replay()
            b.sync()
        return once

    walled = {k: fleet(k) for k in fleets}
    walled.update({'engines': step_engines, 'replay_invariant': replay('invariant'),
                   'replay_batched': replay('batched'),
                   'resident_invariant': fleet('invariant', dframes),
                   'resident_batched': fleet('batched', dframes)})
    gc.collect()
    b.sync()
    walls, _ = interleaved(None, {}, {}, cfg['ticks'][n], cfg['warmup'], walled=walled)
    rate = {k: (m if k == 'engines' else n) / (walls[k]['p50'] * 1e-6) for k in walls
            if not k.startswith(('replay', 'resident'))}
    return {'policy': name, 'n': n, 'engines_built': m, **walls, 'steps_per_s': rate,
            'ratios': {'invariant_vs_batched': ratio(rate['invariant'], rate['batched']),
                       'invariant_vs_engines': ratio(rate['invariant'], rate['engines']),
                       'exact_vs_engines': ratio(rate.get('exact', 0), rate['engines']),
                       'batched_vs_engines': ratio(rate['batched'], rate['engines']),
                       'invariant_tick_vs_replay': ratio(walls['invariant']['p50'],
                                                         walls['replay_invariant']['p50']),
                       'batched_tick_vs_replay': ratio(walls['batched']['p50'],
                                                       walls['replay_batched']['p50']),
                       'resident_invariant_vs_replay': ratio(
                           walls['resident_invariant']['p50'], walls['replay_invariant']['p50']),
                       'resident_batched_vs_replay': ratio(
                           walls['resident_batched']['p50'], walls['replay_batched']['p50'])},
            'invariant_vs_batched_max_abs_diff': float((inv - got['batched']).abs().max()),
            'invariant_equals_singles': bool(same)}


def capsule_row(b, name, n):
    s = n // 2
    fleet, single = b.engine(name, n, 'batch_invariant'), b.engine(name, 1, 'batch_invariant')
    frames = _frames(n, 16, seed=300 + n)
    count = [0]

    def tick(e):
        count[0] += 1
        obs = frames[count[0] % 16]
        return e.step(obs[s]) if e is single else e.step_all(obs)

    calls = {}
    for label, e, key in (('fleet', fleet, s), ('single', single, None)):
        for _ in range(4):
            tick(e)
        e.snapshot('c', session=key)
        calls[label] = {'snapshot': lambda e=e, k=key: e.snapshot('c', True, session=k),
                        'restore': lambda e=e, k=key: e.restore('c', session=k),
                        'fork': lambda e=e, k=key: e.fork('', 'f', overwrite=True, session=k),
                        'rollback': lambda e=e, k=key: e.rollback(1, session=k)}
    walls = {w: {op: [] for op in OPS} for w in calls}
    order = random.Random(0)
    for cycle in range(2 + b.cfg['capsule_rounds']):
        for w in order.sample(list(calls), 2):
            for op in order.sample(OPS, len(OPS)):
                tick(fleet if w == 'fleet' else single)
                _, us = wall(calls[w][op])
                if cycle >= 2:
                    walls[w][op].append(us)
    ops = {op: {w: stats(walls[w][op]) for w in calls} for op in OPS}
    for op in OPS:
        ops[op]['fleet_vs_single_p50'] = ratio(ops[op]['fleet']['p50'],
                                               ops[op]['single']['p50'])
    # a capsule of the fleet's session, through its file, replays in a single engine
    fleet.snapshot('x', overwrite=True, session=s)
    path = fleet.save('x', f'scale-{name}-{n}.capsule').path
    single.load(path, name='x', overwrite=True)
    single.restore('x')
    obs = _frames(1, 8, seed=9)[:, 0]
    a = torch.stack([single.step(o) for o in obs])
    rows = []
    for o in obs:
        full = np.repeat(o[None], n, axis=0)
        rows.append(fleet.step_all(full)[s])
    same = torch.equal(a, torch.stack(rows))
    check(b.checks, f'{name} N={n}: session {s} of the invariant fleet and a single engine '
          'restored from its capsule file give the same 8 actions bit for bit', same)
    return {'policy': name, 'n': n, 'session': s, 'ops': ops, 'replay_identical': same}


def render(results):
    env, out = results['environment'], []
    out += [f'# Fleet at scale: {env["device_name"]} ({env["mode"]})\n',
            environment_line(env),
            '- whole step_all call, host wall p50 / p99 in us; replay = graph replay + sync '
            'alone; variants interleaved in one loop\n',
            '| policy | N | invariant (exact) | batched | exact (per session) | N engines | '
            'replay inv / bat | inv / batched | inv / engines | tick / replay (inv, bat) | '
            'resident p50 inv / bat (/ replay) |',
            '|' + ' --- |' * 11]
    for r in results['sections'].get('ticks', []):
        def p(k):
            return f'{r[k]["p50"]:.0f} / {r[k]["p99"]:.0f}' if k in r else '-'
        q = r['ratios']
        out.append(f'| {r["policy"]} | {r["n"]} | {p("invariant")} | {p("batched")} | '
                   f'{p("exact")} | {p("engines")} ({r["engines_built"]}) | '
                   f'{r["replay_invariant"]["p50"]:.0f} / {r["replay_batched"]["p50"]:.0f} | '
                   f'{q["invariant_vs_batched"]:.2f}x | {q["invariant_vs_engines"]:.1f}x | '
                   f'{q["invariant_tick_vs_replay"]:.2f} / {q["batched_tick_vs_replay"]:.2f} | '
                   f'{r["resident_invariant"]["p50"]:.0f} / {r["resident_batched"]["p50"]:.0f} '
                   f'({q["resident_invariant_vs_replay"]:.2f} / '
                   f'{q["resident_batched_vs_replay"]:.2f}) |')
    out += ['', '## Capsule ops on one session of an invariant fleet vs a single engine (p50 '
            'us, ratio)\n', '| policy | N | ' + ' | '.join(OPS) + ' |', '|' + ' --- |' * 6]
    for r in results['sections'].get('capsules', []):
        cells = [f'{r["ops"][op]["fleet"]["p50"]:.1f} vs {r["ops"][op]["single"]["p50"]:.1f} '
                 f'({r["ops"][op]["fleet_vs_single_p50"]:.2f}x)' for op in OPS]
        out.append(f'| {r["policy"]} | {r["n"]} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(out + checks_and_command(results)) + '\n'


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--smoke', action='store_true')
    ap.add_argument('--device', default='auto')
    ap.add_argument('--out', default='')
    ap.add_argument('--commit', default='')
    ap.add_argument('--ns', default='', help='comma list of fleet sizes (none: no tick rows)')
    ap.add_argument('--capsule-ns', default='', help='the same for the capsule rows')
    args = ap.parse_args(argv)
    if args.smoke:
        torch.set_num_threads(1)
    device = resolve_device(args.device)
    mode = 'smoke' if args.smoke else ('gpu' if device.type == 'cuda' else 'cpu')
    cfg = dict(CONFIGS[mode])
    for key, given in (('ns', args.ns), ('capsule_ns', args.capsule_ns)):
        if given:
            cfg[key] = [] if given == 'none' else [int(x) for x in given.split(',')]
    env = environment(device, f'fleet-scale-{mode}', args.commit)
    stem = f'{datetime.date.today().isoformat()}-{device_slug(env)}-fleet-scale'
    report = Report(results_stem(args.out, stem), env, {**cfg, 'policies': POLICIES},
                    render_md=render)
    report.results['command'] = 'python -m benchmarks.fleet_scale ' + ' '.join(
        sys.argv[1:] if argv is None else argv)
    report.results['sections'] = {'ticks': [], 'capsules': []}
    with tempfile.TemporaryDirectory(prefix='frt-scale-') as tmp:
        b = Bench(device, cfg, tmp, report.results['checks'])
        for name in POLICIES:
            for section, sizes, fn in (('ticks', cfg['ns'], tick_row),
                                       ('capsules', cfg['capsule_ns'], capsule_row)):
                for n in sizes:
                    report.results['sections'][section].append(fn(b, name, n))
                    free_memory(device)
                    report.write()
                    log(f'  [{section}] {name} N={n} done')
    report.write()
    log(render(report.results))
    bad = [c['name'] for c in report.results['checks'] if not c['passed']]
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
