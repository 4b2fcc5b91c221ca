"""Determinism: restore + K steps replayed many times, and again in a fresh process.

    python -m benchmarks.determinism                  # GPU sizes on CUDA (the H200 run)
    python -m benchmarks.determinism --smoke --device cpu --out /tmp/det   # the test's run

For every policy kind and dtype the package ships (mlp, recurrent LSTM and GRU, history
float32 / bfloat16 / float16, a TorchScript file, an ONNX file): run to a position (prefill
for history, steps otherwise), snapshot, step K observations (the original continuation),
then `replays` times restore and step the same K observations, each compared with the
original bit for bit. A child process (--child) builds the same policies from the same seeds
and steps the same observations; its original continuations must equal this process's bit for
bit. History also checks that two prefills of the same history leave the same bytes, and on
CUDA compares the default attention kernel with PyTorch's dispatcher (reproducibility and
step / prefill time, side by side). The header records the attention and GEMM backends.
"""

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import torch

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.policies import make_policy
from .run import device_slug, environment, log, Report, ROOT
from .timing import stats

OBS, ACT = 48, 12
CONFIGS = {
    'gpu': {'replays': 8, 'steps': 32, 'timing_steps': 300, 'positions': [64, 512],
            'history': {'d_model': 1024, 'n_layers': 16, 'heads': 16, 'capacity': 16416},
            'history_positions': [2048, 8192, 16384],
            'recurrent': {'rnn_hidden_dim': 256, 'actor_hidden_dims': (512, 256, 128)},
            'mlp': {'actor_hidden_dims': (512, 256, 128)}, 'file_hidden': 256},
    'smoke': {'replays': 8, 'steps': 8, 'timing_steps': 10, 'positions': [4, 20],
              'history': {'d_model': 32, 'n_layers': 2, 'heads': 2, 'capacity': 96, 'chunk': 4},
              'history_positions': [16, 64],
              'recurrent': {'rnn_hidden_dim': 32, 'actor_hidden_dims': (32,)},
              'mlp': {'actor_hidden_dims': (32,)}, 'file_hidden': 16},
}
KINDS = ('mlp', 'recurrent-lstm', 'recurrent-gru', 'history-float32', 'history-bfloat16',
         'history-float16', 'torchscript', 'onnx')


def backends(device):
    """The attention and GEMM settings a run used (the header)."""
    b = torch.backends
    out = {'cudnn': b.cudnn.version() if b.cudnn.is_available() else None,
           'cudnn_deterministic': b.cudnn.deterministic, 'cudnn_benchmark': b.cudnn.benchmark,
           'deterministic_algorithms': torch.are_deterministic_algorithms_enabled(),
           'cublas_workspace_config': os.environ.get('CUBLAS_WORKSPACE_CONFIG', ''),
           'cpu_threads': torch.get_num_threads(),
           'history_attention_cuda': 'step: cuBLAS baddbmm/softmax/bmm; prefill: '
                                     'aten._efficient_attention_forward (called directly)'}
    if device.type == 'cuda':
        out.update(sdp_flash=b.cuda.flash_sdp_enabled(),
                   sdp_mem_efficient=b.cuda.mem_efficient_sdp_enabled(),
                   sdp_cudnn=b.cuda.cudnn_sdp_enabled(), sdp_math=b.cuda.math_sdp_enabled(),
                   matmul_tf32=b.cuda.matmul.allow_tf32,
                   bf16_reduced_reduction=b.cuda.matmul.allow_bf16_reduced_precision_reduction,
                   fp16_reduced_reduction=b.cuda.matmul.allow_fp16_reduced_precision_reduction,
                   blas=str(torch.backends.cuda.preferred_blas_library()))
    return out


# ---------------------------------------------------------------- policy files

class _LstmActor(torch.nn.Module):
    """An exported recurrent actor as Isaac Lab writes it for ONNX: the memory goes in as
    inputs and comes back as outputs."""

    def __init__(self, hidden):
        super().__init__()
        self.rnn = torch.nn.LSTM(OBS, hidden)
        self.actor = torch.nn.Sequential(torch.nn.Linear(hidden, 128), torch.nn.ELU(),
                                         torch.nn.Linear(128, ACT))
        self.register_buffer('hidden_state', torch.zeros(1, 1, hidden))
        self.register_buffer('cell_state', torch.zeros(1, 1, hidden))

    def forward(self, x, h, c):
        y, (h2, c2) = self.rnn(x.unsqueeze(0), (h, c))
        return self.actor(y.squeeze(0)), h2, c2


class _ScriptedActor(_LstmActor):
    """The same for TorchScript: the memory lives in buffers that forward overwrites."""

    def forward(self, x):
        y, (h2, c2) = self.rnn(x.unsqueeze(0), (self.hidden_state, self.cell_state))
        self.hidden_state[:] = h2
        self.cell_state[:] = c2
        return self.actor(y.squeeze(0))


def policy_file(kind, hidden, folder):
    torch.manual_seed(3)
    if kind == 'torchscript':
        path = os.path.join(folder, 'policy.pt')
        torch.jit.script(_ScriptedActor(hidden)).save(path)
        return path
    path = os.path.join(folder, 'policy.onnx')
    z = torch.zeros(1, 1, hidden)
    torch.onnx.export(_LstmActor(hidden), (torch.zeros(1, OBS), z, z), path,
                      input_names=['obs', 'h_in', 'c_in'],
                      output_names=['actions', 'h_out', 'c_out'], dynamo=False)
    return path


def build(kind, cfg, device, folder):
    if kind in ('torchscript', 'onnx'):
        path = policy_file(kind, cfg['file_hidden'], folder)
        return make_policy('recurrent', OBS, ACT, file=path, device=device)
    if kind.startswith('history'):
        return make_policy('history', OBS, ACT, seed=1, device=device,
                           dtype=kind.split('-')[1], **cfg['history'])
    if kind.startswith('recurrent'):
        return make_policy('recurrent', OBS, ACT, seed=1, device=device,
                           rnn_type=kind.split('-')[1], **cfg['recurrent'])
    return make_policy('mlp', OBS, ACT, seed=1, device=device, **cfg['mlp'])


def observations(n, seed):
    return np.random.default_rng(seed).normal(0, 1, (n, OBS)).astype(np.float32)


# ---------------------------------------------------------------- one kind

def _go_to(e, history, position, at):
    """From position `at` to `position`: prefill (history) or steps (others)."""
    obs = observations(position - at, seed=position)
    if history:
        e.prefill(obs)
    else:
        for o in obs:
            e.step(o)


def _continue(e, future):
    return np.stack([e.step(o).numpy() for o in future])


def replays_at(e, future, replays, name):
    """Snapshot, the original continuation, then `replays` restores each replayed."""
    e.snapshot(name, overwrite=True)
    original = _continue(e, future)
    differing, worst = 0, 0.0
    for _ in range(replays):
        e.restore(name)
        again = _continue(e, future)
        if not np.array_equal(again, original):
            differing += 1
            worst = max(worst, float(np.abs(again - original).max()))
    e.restore(name)
    return original, {'replays': replays, 'differing_replays': differing,
                      'max_abs_diff': worst}


def prefill_identical(e, n):
    """Two prefills of the same history from a fresh episode leave the same live bytes."""
    obs, live = observations(n, seed=n), []
    for _ in range(2):
        e.reset_episode()
        e.prefill(obs)
        # the policy's buffers (meta's episode counter differs by design)
        live.append([v.clone() for k, v in e.arena.session_views[0].items() if k != 'meta'])
    return all(torch.equal(a, b) for a, b in zip(*live))


def step_time(e, n):
    """Wall p50 / p99 of PolicyEngine.step at the current position (state restored after)."""
    import time
    n = min(n, e.arena.capacity - e.session().position) if e.arena.capacity else n
    e.snapshot('timing', overwrite=True)
    obs, wall = observations(n, seed=7), []
    for o in obs:
        t = time.perf_counter()
        e.step(o)
        wall.append((time.perf_counter() - t) * 1e6)
    e.restore('timing')
    return stats(wall[n // 10:])


def run_kind(kind, cfg, device, folder, child):
    """Rows for one kind: per position the original continuation (and, unless child, the
    replays); the originals go to the caller for the fresh-process comparison."""
    policy = build(kind, cfg, device, folder)
    history = kind.startswith('history')
    e = PolicyEngine(policy, device=device, capsule_dir=os.path.join(folder, 'caps'),
                     device_budget=8 << 30)
    positions = cfg['history_positions'] if history else cfg['positions']
    rows, originals, at = [], {}, 0
    future = observations(cfg['steps'], seed=99)
    for position in positions:
        _go_to(e, history, position, at)
        at = position
        original, row = replays_at(e, future, 0 if child else cfg['replays'], 'det')
        originals[str(position)] = original
        rows.append({'position': position, **row})
    out = {'rows': rows, 'probe': e.determinism}
    if history and not child:
        out['prefill_identical'] = prefill_identical(e, positions[0])
        if device.type == 'cuda':
            out['dispatcher'] = compare_dispatcher(e, policy, cfg, positions, future, folder)
    del e
    return out, originals


def compare_dispatcher(e, policy, cfg, positions, future, folder):
    """The same history model with F.scaled_dot_product_attention's own kernel choice: its
    reproducibility and its step / prefill time next to the default kernel's."""
    import time
    rows, engines = [], {}
    for mode in ('efficient', 'dispatcher'):
        policy.attention = mode
        engines[mode] = e if mode == 'efficient' else PolicyEngine(
            policy, device=e.device, capsule_dir=os.path.join(folder, 'caps2'),
            device_budget=8 << 30)
    for position in positions:
        row = {'position': position}
        for mode, eng in engines.items():
            policy.attention = mode
            eng.reset_episode()
            hist = observations(position, seed=position)
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.prefill(hist)
            torch.cuda.synchronize()
            row[f'{mode}_prefill_ms'] = (time.perf_counter() - t) * 1e3
            row[mode] = replays_at(eng, future, cfg['replays'], 'cmp')[1]
            row[f'{mode}_step'] = step_time(eng, cfg['timing_steps'])
        rows.append(row)
    policy.attention = 'efficient'
    return {'rows': rows, 'probe': engines['dispatcher'].determinism}


# ---------------------------------------------------------------- the run

def run_all(cfg, device, kinds, child, publish=None):
    results, originals = {}, {}
    for kind in kinds:
        log(f'[{kind}]')
        with tempfile.TemporaryDirectory() as folder:
            try:
                results[kind], originals[kind] = run_kind(kind, cfg, device, folder, child)
            except ImportError as exc:          # onnx2pytorch / onnx not installed
                results[kind] = {'skipped': f'{type(exc).__name__}: {exc}'}
        if publish:
            publish(kind, results[kind])
        if device.type == 'cuda':
            torch.cuda.empty_cache()
    return results, originals


def kernel_names(cfg, device):
    """CUDA kernels of one eager step of the bf16 history model, per attention mode."""
    from torch.profiler import profile, ProfilerActivity
    policy = build('history-bfloat16', {**cfg, 'history': {**cfg['history'], 'capacity': 256}},
                   device, '')
    e = PolicyEngine(policy, device=device, cuda_graph=False, capsule_dir='/tmp/det_k',
                     determinism_probe=0)
    e.prefill(observations(128, seed=1))
    out = {}
    for mode in ('efficient', 'dispatcher'):
        policy.attention = mode
        e.step(observations(1, 2)[0])
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            e.step(observations(1, 3)[0])
        names = {ev.key for ev in prof.key_averages()}
        out[mode] = sorted(n for n in names if any(
            w in n.lower() for w in ('attention', 'fmha', 'flash', 'cudnn', 'sdpa', 'softmax')))
    return out


def render(results):
    env, s = results['environment'], results['sections']
    out = [f'# flashrt_ros determinism: {env["device_name"]} ({env["mode"]})\n',
           f'{env["date"]}, torch {env["torch"]}, CUDA {env["cuda"] or "-"}, driver '
           f'{env["driver"] or "-"}, Python {env["python"]}, commit {env["git_commit"]}'
           f'{" (tree modified)" if env["git_dirty"] else ""}.\n',
           f'Backends: {json.dumps(results["config"].get("backends", {}))}\n']
    if results['config'].get('kernels'):
        out.append(f'Attention kernels in one step: {json.dumps(results["config"]["kernels"])}\n')
    out += ['| kind | position | replays | differing replays | max abs diff | fresh process '
            'equal | probe at configure |', '|' + ' --- |' * 7]
    for kind in KINDS:
        r = s.get(kind)
        if not r:
            continue
        if 'skipped' in r:
            out.append(f'| {kind} | skipped: {r["skipped"]} |||||')
            continue
        p = r['probe']
        for row in r['rows']:
            fresh = row.get('fresh_process_equal', 'not run')
            out.append(f'| {kind} | {row["position"]} | {row["replays"]} | '
                       f'{row["differing_replays"]} | {row["max_abs_diff"]:.3g} | {fresh} | '
                       f'{p.get("deterministic")} ({p.get("probe_ms", 0):.0f} ms) |')
    for kind in KINDS:
        d = (s.get(kind) or {}).get('dispatcher')
        if not d:
            continue
        out += [f'\n## {kind}: reproducible kernel vs the dispatcher\'s choice\n',
                '| position | default: differing / replays | dispatcher: differing | '
                'step p50 default / dispatcher (us) | prefill default / dispatcher (ms) |',
                '|' + ' --- |' * 5]
        for w in d['rows']:
            out.append(f'| {w["position"]} | {w["efficient"]["differing_replays"]} / '
                       f'{w["efficient"]["replays"]} | {w["dispatcher"]["differing_replays"]} '
                       f'| {w["efficient_step"]["p50"]:.1f} / {w["dispatcher_step"]["p50"]:.1f}'
                       f' | {w["efficient_prefill_ms"]:.1f} / {w["dispatcher_prefill_ms"]:.1f} |')
        out.append(f'\nDispatcher probe at configure: {d["probe"]}')
    bad = [c for c in results['checks'] if not c['passed']]
    out.append(f'\n## Checks: {len(results["checks"]) - len(bad)} / {len(results["checks"])} '
               'passed\n')
    out += [f'- FAILED: {c["name"]} {c["detail"]}' for c in bad]
    return '\n'.join(out) + '\n'


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--smoke', action='store_true')
    ap.add_argument('--device', default='auto')
    ap.add_argument('--out', default='')
    ap.add_argument('--commit', default='')
    ap.add_argument('--kinds', default=','.join(KINDS))
    ap.add_argument('--child', default='', help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    device = torch.device('cuda' if args.device == 'auto' and torch.cuda.is_available() else
                          ('cpu' if args.device == 'auto' else args.device))
    mode = 'smoke' if args.smoke else 'gpu'
    cfg, kinds = CONFIGS[mode], [k for k in args.kinds.split(',') if k]
    if args.child:                      # the fresh process: original continuations only
        if device.type == 'cuda':
            # the parent's sequence, exactly: in a fresh process whose first CUDA work was the
            # gpu-sized MLP's capture, that capture failed on the H200 (reported in issue 19)
            kernel_names(cfg, device)
        _, originals = run_all(cfg, device, kinds, child=True)
        np.savez(args.child, **{f'{k}/{p}': a for k, v in originals.items()
                                for p, a in v.items()})
        return 0
    env = environment(device, f'determinism-{mode}', args.commit)
    stem = f'{datetime.date.today().isoformat()}-{device_slug(env)}-determinism'
    out = pathlib.Path(args.out) if args.out else ROOT / 'benchmarks' / 'results' / stem
    config = {**cfg, 'kinds': kinds, 'backends': backends(device)}
    if device.type == 'cuda':
        config['kernels'] = kernel_names(cfg, device)
    report = Report(out, env, config, render_md=render)
    log(f'determinism: {env["device_name"]}, mode {mode}, writing {out}.json/.md')
    results, originals = run_all(cfg, device, kinds, child=False, publish=report.publish)
    child_file = out.with_suffix('.child.npz')
    done = subprocess.run([sys.executable, '-m', 'benchmarks.determinism', '--child',
                           str(child_file), '--device', str(device.type), '--kinds',
                           ','.join(kinds)] + (['--smoke'] if args.smoke else []),
                          cwd=ROOT, capture_output=True, text=True)
    log(f'fresh process: rc {done.returncode}\n{done.stderr[-3000:]}')
    fresh = dict(np.load(child_file)) if done.returncode == 0 else {}
    if child_file.exists():
        child_file.unlink()
    checks = report.results['checks']
    for kind, r in results.items():
        for row in r.get('rows', []):
            theirs = fresh.get(f'{kind}/{row["position"]}')
            row['fresh_process_equal'] = bool(theirs is not None and np.array_equal(
                theirs, originals[kind][str(row['position'])]))
            checks.append({'name': f'{kind} at {row["position"]}: {row["replays"]} replays '
                           'and a fresh process bit for bit', 'passed': row['differing_replays']
                           == 0 and row['fresh_process_equal'], 'detail': str(row) + (
                               '' if done.returncode == 0 else done.stderr[-2000:])})
        if 'prefill_identical' in r:
            checks.append({'name': f'{kind}: two prefills leave the same bytes',
                           'passed': r['prefill_identical'], 'detail': ''})
        report.publish(kind, r)
    report.write()
    log(render(report.results))
    return 0 if all(c['passed'] for c in checks) else 1


if __name__ == '__main__':
    sys.exit(main())
