"""flashrt_ros benchmark suite: one command, CUDA when present, else CPU.

    python -m benchmarks.run                 # full run (GPU sizes on CUDA, capped on CPU)
    python -m benchmarks.run --quick         # small CPU run, well under a minute
    python -m benchmarks.run --ros           # add section 7 (ROS end to end)

Writes <out>.json and <out>.md (default benchmarks/results/<date>-<device>[-mode]) after every
section, so a run cut short still leaves what it measured. See benchmarks/README.md.
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import socket
import subprocess
import sys
import time

import torch

from . import sections
from .ros_e2e import ros_section

ROOT = pathlib.Path(__file__).resolve().parents[1]
KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
SECTIONS = ('capsule_ops', 'live_bytes_scaling', 'first_action', 'kv_ablation', 'control_step',
            'baseline', 'ros')
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


def log(msg):
    print(msg, flush=True)


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10,
                              cwd=ROOT).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ''


def project_commit(given=''):
    """The flashrt_ros commit measured: `given` (--commit, for a copy of the tree that is not
    a git checkout, e.g. on a lent GPU machine), else this repository's HEAD, only when ROOT
    is itself the top of a git checkout (not some enclosing repository)."""
    if given:
        return {'git_commit': given, 'git_dirty': False, 'commit_source': '--commit'}
    top = _run(['git', 'rev-parse', '--show-toplevel'])
    if not top or pathlib.Path(top).resolve() != ROOT:
        return {'git_commit': 'unknown (not a git checkout; pass --commit)', 'git_dirty': False,
                'commit_source': 'none'}
    return {'git_commit': _run(['git', 'rev-parse', '--short', 'HEAD']),
            'git_dirty': bool(_run(['git', 'status', '--porcelain', '--', 'flashrt_ros'])),
            'commit_source': 'git'}


def environment(device, mode, commit=''):
    cuda = device.type == 'cuda'
    env = {'date': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
           'hostname': socket.gethostname(), 'mode': mode, 'device': str(device),
           'device_name': torch.cuda.get_device_name(device) if cuda else
           (platform.processor() or platform.machine()),
           'driver': _run(['nvidia-smi', '--query-gpu=driver_version',
                           '--format=csv,noheader']).splitlines()[0:1] if cuda else [],
           'torch': torch.__version__, 'cuda': torch.version.cuda or '',
           'python': platform.python_version(), 'cpu_threads': torch.get_num_threads(),
           # other work on the machine at the start: CPU figures move with it
           'load_average_1m': os.getloadavg()[0],
           **project_commit(commit)}
    env['driver'] = env['driver'][0] if env['driver'] else ''
    return env


def device_slug(env):
    return 'cpu' if env['device'] == 'cpu' else \
        re.sub(r'[^a-z0-9]+', '-', env['device_name'].lower()).strip('-')


# ---------------------------------------------------------------- report

def _us(x):
    return f'{x / 1000:.2f} ms' if x >= 10000 else f'{x:.1f}'


def _pp(s):
    return f'{_us(s["p50"])} / {_us(s["p99"])}'


def _mb(n):
    return f'{n / MB:.2f}' if n < 100 * MB else f'{n / MB:.0f}'


def render(results):
    env, head = results['environment'], []
    head.append(f'# flashrt_ros benchmarks: {env["device_name"]} ({env["mode"]})\n')
    head.append(f'{env["date"]}, {env["hostname"]}, torch {env["torch"]}, CUDA '
                f'{env["cuda"] or "-"}, driver {env["driver"] or "-"}, Python {env["python"]}, '
                f'commit {env["git_commit"]}{" (runtime modified)" if env["git_dirty"] else ""}, '
                f'load average {env["load_average_1m"]:.1f} at start.'
                ' Times in us unless marked; "x" columns are ratios measured in the same run.\n')
    r, parts = results['sections'], {}
    s = r.get('capsule_ops')
    if s and 'rows' in s:
        out = parts['capsule_ops'] = []
        out.append('## 1. Capsule operations: the whole call vs one contiguous copy\n')
        out.append('Each operation is timed around the public PolicyEngine call (host wall: '
                   'lock, bookkeeping, copy, synchronisation), p50 / p99. "copy" is one '
                   'contiguous device copy of the same bytes timed by CUDA events (the '
                   'roofline); "raw memcpy" is cudaMemcpyAsync through cuda-python plus one '
                   'stream synchronisation, host wall (what a caller could issue instead); '
                   '"torch copy" the same with torch\'s copy_. Budget: every whole call <= '
                   '1.2x copy + 15 us, and at 4 KB snapshot and restore <= 2x raw memcpy. '
                   '"copy window" is OpResult.latency_us (copies, the bookkeeping overlapped '
                   'with them, and the synchronisation). '
                   'Naive: the same named buffers as separate tensors, copied one by one. '
                   'Live bytes are random.\n')
        if s.get('note'):
            out.append(s['note'] + '\n')
        out.append('| live state | buffers | copy | raw memcpy | torch copy | snapshot | x copy '
                   '| x raw | restore | x copy | x raw | fork | rollback | copy window '
                   'snapshot, restore | naive snapshot, restore | budget |')
        out.append('|' + ' --- |' * 16)
        for w in s['rows']:
            q = w['ratios']
            over = [k for k, v in w['within_budget'].items() if not v]
            ok = 'ok' if not over else 'over: ' + ', '.join(over)
            out.append(
                f'| {w["size"]} | {w["n_buffers"]} | {_us(w["copy"]["p50"])} | '
                f'{_pp(w["raw_memcpy"])} | {_pp(w["torch_copy_sync"])} | '
                f'{_pp(w["snapshot_wall"])} | {q["snapshot_vs_copy"]:.2f} | '
                f'{q["snapshot_vs_raw_memcpy"]:.2f} | {_pp(w["restore_wall"])} | '
                f'{q["restore_vs_copy"]:.2f} | {q["restore_vs_raw_memcpy"]:.2f} | '
                f'{_pp(w["fork_wall"])} | {_pp(w["rollback_wall"])} | '
                f'{_us(w["snapshot"]["p50"])}, {_us(w["restore"]["p50"])} | '
                f'{_us(w["naive_snapshot"]["p50"])}, {_us(w["naive_restore"]["p50"])} | '
                f'{ok} |')
        if s['rows']:
            out.append(f'\nCopies issued through: {s["rows"][0].get("copy_backend", "?")}.')
        out.append('')
    for key, title in (('live_bytes_scaling', '2. Live-bytes scaling'),
                       ('first_action', '3. Time to first action: restore vs cold re-prefill'),
                       ('kv_ablation', '4. KV-only ablation'),
                       ('baseline', '6. Baseline: dict of per-layer tensors')):
        s = r.get(key)
        if not s or 'rows' not in s:
            continue
        out = parts[key] = []
        m = s['model']
        out.append(f'## {title}\n')
        out.append(f'History policy: {m["parameters"] / 1e6:.1f}M parameters (d_model '
                   f'{m["d_model"]}, {m["n_layers"]} layers, {m["heads"]} heads, {m["dtype"]}),'
                   f' capacity {m["capacity"]} positions ({_mb(m["arena_nbytes"])} MB arena, '
                   f'{m["row_nbytes"]} bytes per position), CUDA graph {m["cuda_graph"]}.\n')
        out += _history_table(key, s['rows'])
        out.append('')
    s = r.get('control_step')
    if s and 'policies' in s:
        out = parts['control_step'] = []
        out.append(f'## 5. Control step: CUDA graph vs eager ({s["steps"]} steps, wall per '
                   'PolicyEngine.step)\n')
        if s.get('note'):
            out.append(s['note'] + '\n')
        out.append('| policy | mode | p50 | p99 | max | device p50 / p99 (last 1024) | '
                   'eager / graph p50 | graph p99 / p50 |')
        out.append('|' + ' --- |' * 8)
        for kind, e in s['policies'].items():
            q = e.get('ratios', {})
            for mode in ('graph', 'eager'):
                if mode not in e:
                    continue
                w, d = e[mode]['wall'], e[mode]['device_recent']
                ratio = (f'{q["eager_vs_graph_p50"]:.1f}', f'{q["graph_p99_vs_p50"]:.2f}') \
                    if q and mode == 'graph' else ('', '')
                out.append(f'| {kind} | {mode} | {_us(w["p50"])} | {_us(w["p99"])} | '
                           f'{_us(w["max"])} | {_pp(d)} | {ratio[0]} | {ratio[1]} |')
        out.append('')
    s = r.get('ros')
    if s:
        out = parts['ros'] = []
        out.append('## 7. End to end through ROS\n')
        if 'skipped' in s:
            out.append(f'Skipped: {s["skipped"]}\n')
        else:
            out.append(f'policy_node ({s["policy_type"]}, {s.get("device")}, CUDA graph '
                       f'{s.get("graph")}) and a bare Trigger server (the floor: rclpy and '
                       'Fast DDS alone), each in its own process, both spun by '
                       f'{s.get("executor", "?")}; this process calls them (lock-step).\n')
            out.append('| measure | n | p50 | p99 | max |')
            out.append('|' + ' --- |' * 5)
            for name, key in (('bare Trigger call -> response (floor)', 'trigger'),
                              ('~/restore call -> response', 'restore'),
                              ('bare topic echo message -> message (floor)', 'echo'),
                              ('observation -> action (topics)', 'observation_to_action')):
                if key not in s:
                    continue
                w = s[key]['round_trip']
                out.append(f'| {name} | {w["n"]} | {_us(w["p50"])} | {_us(w["p99"])} | '
                           f'{_us(w["max"])} |')
            out.append('')
    out = head
    for key in SECTIONS:
        out += parts.get(key, [])
    checks = results['checks']
    failed = [c for c in checks if not c['passed']]
    out.append(f'## Identity checks: {len(checks) - len(failed)} / {len(checks)} passed\n')
    for c in failed:
        out.append(f'- FAILED: {c["name"]} {c["detail"]}')
    out.append(f'\nTotal run time {results.get("elapsed_s", 0):.0f} s.')
    return '\n'.join(out) + '\n'


def _history_table(key, rows):
    out = []
    if key == 'live_bytes_scaling':
        out.append('| position | live MB | capacity MB | snapshot p50 / p99 | copy of live p50 | '
                   'x live copy | copy of capacity p50 | capacity copy / snapshot | '
                   'restore p50 / p99 | rollback p50 / p99 |')
        out.append('|' + ' --- |' * 10)
        for w in rows:
            q = w['ratios']
            out.append(f'| {w["position"]} | {_mb(w["live_nbytes"])} | '
                       f'{_mb(w["capacity_nbytes"])} | {_pp(w["snapshot"])} | '
                       f'{_us(w["copy_live"]["p50"])} | {q["snapshot_vs_live_copy"]:.2f} | '
                       f'{_us(w["copy_capacity"]["p50"])} | {q["capacity_copy_vs_snapshot"]:.1f}'
                       f' | {_pp(w["restore"])} | {_pp(w["rollback"])} |')
    elif key == 'first_action':
        out.append('| history | restore -> action p50 / p99 | restore op p50 | eager '
                   're-prefill -> action p50 / p99 | graphed re-prefill -> action p50 / p99 | '
                   'speedup p50 vs the fastest prefill | vs eager | bit-exact vs continued '
                   'original | re-prefill max abs diff (action scale) |')
        out.append('|' + ' --- |' * 9)
        for w in rows:
            exact = 'yes' if w['bit_exact_vs_continued'] else 'NO'
            g = w.get('graphed_prefill', {'skipped': 'not measured'})
            graphed = g['skipped'] if 'skipped' in g else _pp(g['then_step'])
            out.append(f'| {w["history"]} | {_pp(w["restore_then_step"])} | '
                       f'{_us(w["restore_op"]["p50"])} | {_pp(w["reprefill_then_step"])} | '
                       f'{graphed} | {w["speedup_p50"]:.1f}x ({w["fastest_prefill"]}) | '
                       f'{w["speedup_vs_eager_p50"]:.1f}x | {exact}'
                       f' | {w["reprefill_max_abs_diff"]:.3g} ({w["action_scale"]:.3g}) |')
    elif key == 'kv_ablation':
        out.append('| history | restored kinds | steps compared | first divergent step | '
                   'identical steps | max abs diff |')
        out.append('|' + ' --- |' * 6)
        for w in rows:
            first = w['first_divergent_step'] if w['diverged'] else 'none'
            out.append(f'| {w["history"]} | {", ".join(w["kinds"])} | {w["steps_compared"]} | '
                       f'{first} | {w["steps_identical"]} | {w["max_abs_diff"]:.3g} |')
    else:
        out.append('| history | tensors | dict snapshot p50 | capsule snapshot p50 | x | '
                   'dict restore p50 | capsule restore p50 | x | DynamicCache snapshot, '
                   'restore p50 |')
        out.append('|' + ' --- |' * 9)
        for w in rows:
            q, d = w['ratios'], w['dynamic_cache']
            dyn = d['skipped'] if 'skipped' in d else \
                f'{_us(d["snapshot"]["p50"])}, {_us(d["restore"]["p50"])}'
            out.append(f'| {w["history"]} | {w["tensors"]} | {_us(w["dict_snapshot"]["p50"])} '
                       f'| {_us(w["capsule_snapshot"]["p50"])} | '
                       f'{q["dict_vs_capsule_snapshot"]:.1f} | {_us(w["dict_restore"]["p50"])} '
                       f'| {_us(w["capsule_restore"]["p50"])} | '
                       f'{q["dict_vs_capsule_restore"]:.1f} | {dyn} |')
    return out


class Report:
    """Results so far; written to <out>.json and <out>.md every time a section finishes.
    render_md(results) -> markdown: this module's tables unless another suite gives its own."""

    def __init__(self, out, env, config, render_md=render):
        self.out = out
        self.render_md = render_md
        self.results = {'environment': env, 'config': config, 'sections': {}, 'checks': []}
        self.t0 = time.perf_counter()
        out.parent.mkdir(parents=True, exist_ok=True)

    def publish(self, section, data):
        self.results['sections'][section] = data
        self.write()

    def write(self):
        self.results['elapsed_s'] = time.perf_counter() - self.t0
        tmp = self.out.with_suffix('.json.tmp')
        tmp.write_text(json.dumps(self.results, indent=1, default=str) + '\n')
        os.replace(tmp, self.out.with_suffix('.json'))
        self.out.with_suffix('.md').write_text(self.render_md(self.results))


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

    device = torch.device('cuda' if args.device == 'auto' and torch.cuda.is_available() else
                          ('cpu' if args.device == 'auto' else args.device))
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
    report = Report(out, env, {k: v for k, v in cfg.items()})
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
        report.publish('capsule_ops', sections.capsule_ops(cfg, device, checks, log))
    if set(HISTORY) & set(wanted):
        log('[2,3,4,6] history policy: scaling, first action, KV ablation, baseline')
        sections.run_history_sections(
            cfg, device, checks, log,
            lambda k, v: report.publish(k, v) if k in wanted else None)
    if 'control_step' in wanted:
        log('[5] control step')
        report.publish('control_step', sections.control_step(cfg, device, checks, log))
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
