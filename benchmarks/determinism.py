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
import os
import pathlib
import subprocess
import sys

import numpy as np
import torch

from flashrt_ros.runtime.engine import PolicyEngine

from .determinism_policies import build, KINDS, observations
from .determinism_replays import run_all
from .determinism_report import render
from .environment import device_slug, environment, resolve_device, ROOT
from .report import log, Report

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--smoke', action='store_true')
    ap.add_argument('--device', default='auto')
    ap.add_argument('--out', default='')
    ap.add_argument('--commit', default='')
    ap.add_argument('--kinds', default=','.join(KINDS))
    ap.add_argument('--child', default='', help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
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
