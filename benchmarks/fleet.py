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
import sys
import tempfile
import time

import torch

from .environment import device_slug, environment, resolve_device, results_stem, ROOT
from .fleet_report import render
from .fleet_sections import ACT_DIM, branches, capsule_ops, FRAMES, fleet_tick, OBS_DIM, OPS, \
    POLICIES, Run
from .report import log, Report
from .sections import check, finite_numbers, free_memory

SECTIONS = ('fleet_tick', 'fleet_capsule_ops', 'branches')
G1_POLICY = ROOT.parent / 'shared' / 'robots' / 'unitree_g1' / 'motion.pt'

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
    device = resolve_device(args.device)
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
    out = results_stem(args.out, stem)
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
        check(checks, 'recurrent sizes equal the G1 motion.pt', g1['match'], str(g1['found']))
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
                    free_memory(device)       # the section's engines went with its frame
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
