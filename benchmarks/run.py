"""flashrt_ros benchmark suite: one command, CUDA when present, else CPU.

    python -m benchmarks.run                 # full run (GPU sizes on CUDA, capped on CPU)
    python -m benchmarks.run --quick         # small CPU run, well under a minute
    python -m benchmarks.run --ros           # add section 7 (ROS end to end)

Writes <out>.json and <out>.md (default benchmarks/results/<date>-<device>[-mode]) after every
section, so a run cut short still leaves what it measured. See benchmarks/README.md.
"""

import argparse
import datetime
import pathlib
import sys

import torch

from .capsule_copies import capsule_ops
from .environment import device_slug, environment, resolve_device, ROOT
from .history_model import run_history_sections
from .report import log, Report
from .ros_e2e import ros_section
from .run_report import render
from .sections import SECTIONS
from .step_graphs import control_step

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
HISTORY = ('live_bytes_scaling', 'first_action', 'kv_ablation', 'baseline')

# Iteration counts sized so the full GPU run (H200) stays near two minutes: the lead runs it
# in one call of at most ~8 minutes, model construction included.
CONFIGS = {
    'gpu': {
        'sizes': [4 * KB, 64 * KB, MB, 16 * MB, 256 * MB, GB],
        'min_iters': 100, 'max_iters': 500, 'loop_bytes': 100 * GB,
        # ~200M parameters: 12 * d_model^2 per layer (qkv+o or in+out projections, MLP x4)
        'model': {'d_model': 1024, 'n_layers': 16, 'heads': 16, 'bf16': True},
        'histories': [2048, 8192, 16384], 'continue_steps': 24,
        'scaling_iters': 100, 'restore_reps': 50, 'prefill_reps': 5,
        'steps': 10000,
        'recurrent': {'rnn_type': 'lstm', 'rnn_hidden_dim': 256},
        'history': {'capacity': 2048, 'd_model': 256, 'n_layers': 4, 'heads': 4},
        'ros': {'calls': 1000, 'policy_type': 'recurrent'},
    },
    'cpu': {
        'sizes': [4 * KB, 64 * KB, MB, 16 * MB, 64 * MB],
        'sizes_note': 'CPU: states capped at 64 MB (the GPU run goes to 1 GB)',
        'min_iters': 20, 'max_iters': 300, 'loop_bytes': 2 * GB,
        'model': {'d_model': 256, 'n_layers': 4, 'heads': 4, 'bf16': False},
        'histories': [512, 2048, 4096], 'continue_steps': 24,
        'scaling_iters': 30, 'restore_reps': 20, 'prefill_reps': 3,
        'steps': 2000,
        'recurrent': {'rnn_type': 'lstm', 'rnn_hidden_dim': 256},
        'history': {'capacity': 2048, 'd_model': 256, 'n_layers': 4, 'heads': 4},
        'ros': {'calls': 300, 'policy_type': 'recurrent'},
    },
    'quick': {
        'sizes': [4 * KB, 64 * KB, MB, 16 * MB],
        'sizes_note': 'quick: states capped at 16 MB (the GPU run goes to 1 GB)',
        'min_iters': 10, 'max_iters': 100, 'loop_bytes': 512 * MB,
        'model': {'d_model': 128, 'n_layers': 4, 'heads': 4, 'bf16': False},
        'histories': [256, 1024, 2048], 'continue_steps': 24,
        'scaling_iters': 20, 'restore_reps': 10, 'prefill_reps': 3,
        'steps': 500,
        'recurrent': {'rnn_type': 'lstm', 'rnn_hidden_dim': 256},
        'history': {'capacity': 2048, 'd_model': 256, 'n_layers': 4, 'heads': 4},
        'ros': {'calls': 100, 'policy_type': 'recurrent'},
    },
    'smoke': {     # the test's configuration: every code path, a few seconds
        'sizes': [4 * KB, 64 * KB],
        'sizes_note': 'smoke: smallest configuration, for the test only',
        'min_iters': 3, 'max_iters': 5, 'loop_bytes': 1 * MB,
        'model': {'d_model': 32, 'n_layers': 2, 'heads': 2, 'bf16': False},
        'histories': [32, 128], 'continue_steps': 12,
        'scaling_iters': 3, 'restore_reps': 3, 'prefill_reps': 1,
        'steps': 20,
        'recurrent': {'rnn_type': 'gru', 'rnn_hidden_dim': 32, 'actor_hidden_dims': (32,)},
        'history': {'capacity': 16, 'd_model': 32, 'n_layers': 2, 'heads': 2, 'chunk': 4},
        'ros': {'calls': 20, 'policy_type': 'recurrent'},
    },
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--quick', action='store_true', help='small CPU-sized run (< 1 minute)')
    ap.add_argument('--smoke', action='store_true', help='smallest run, for the test')
    ap.add_argument('--device', default='auto', help="'auto' (cuda when present), 'cpu', 'cuda'")
    ap.add_argument('--out', default='', help='output path stem (.json and .md are written)')
    ap.add_argument('--ros', action='store_true',
                    help='also run section 7: PolicyNode in-process, services and topics')
    ap.add_argument('--commit', default='',
                    help='the flashrt_ros commit of this tree, when it is not a git checkout')
    ap.add_argument('--sections', default='',
                    help=f'comma list of sections to run (default all but ros): {SECTIONS}')
    args = ap.parse_args(argv)

    device = resolve_device(args.device)
    mode = 'smoke' if args.smoke else 'quick' if args.quick else \
        ('gpu' if device.type == 'cuda' else 'cpu')
    cfg = CONFIGS[mode]
    wanted = [s.strip() for s in args.sections.split(',') if s.strip()] or \
        [s for s in SECTIONS if s != 'ros']
    if args.ros and 'ros' not in wanted:
        wanted.append('ros')
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        ap.error(f'unknown sections {sorted(unknown)}; choose from {SECTIONS}')

    env = environment(device, mode, args.commit)
    stem = f'{datetime.date.today().isoformat()}-{device_slug(env)}' + \
        ('' if mode in ('gpu', 'cpu') else f'-{mode}')
    out = pathlib.Path(args.out) if args.out else ROOT / 'benchmarks' / 'results' / stem
    if out.suffix in ('.json', '.md'):
        out = out.with_suffix('')
    report = Report(out, env, {k: v for k, v in cfg.items()}, render_md=render)
    for s in SECTIONS:      # a section not run says so instead of vanishing from the JSON
        if s not in wanted:
            report.results['sections'][s] = {'skipped': 'not requested' + (
                ' (pass --ros)' if s == 'ros' else '')}
    log(f'flashrt_ros benchmarks: {env["device_name"]}, mode {mode}, torch {env["torch"]}, '
        f'writing {out}.json/.md')
    torch.manual_seed(0)
    checks = report.results['checks']

    if 'capsule_ops' in wanted:
        log('[1] capsule operations')
        report.publish('capsule_ops', capsule_ops(cfg, device, checks, log))
    if set(HISTORY) & set(wanted):
        log('[2,3,4,6] history policy: scaling, first action, KV ablation, baseline')
        run_history_sections(
            cfg, device, checks, log,
            lambda k, v: report.publish(k, v) if k in wanted else None)
    if 'control_step' in wanted:
        log('[5] control step')
        report.publish('control_step', control_step(cfg, device, checks, log))
    if 'ros' in wanted:
        log('[7] ROS end to end')
        report.publish('ros', ros_section(cfg['ros'], device, log))
    report.write()
    log('')
    log(render(report.results))
    bad = [c['name'] for c in checks if not c['passed']]
    if bad:
        log(f'identity checks FAILED: {bad}')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
