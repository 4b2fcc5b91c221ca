"""Where a VLA chunk's time goes on CUDA: its graph's replay, then the kernels of one chunk run
eagerly (the same kernels; torch.profiler). SmolVLA with the VLM in float32 and in bfloat16
(benchmarks/vla.py's models); Pi0 / Pi0.5 in bfloat16 (benchmarks/vla_pi0.py's), their prefix
pass and their denoising steps each a graph of its own and profiled apart; 'call': SmolVLA's
whole engine.step outside its graph (the host work, the copies, the waits; cProfile and
torch.profiler), for a chunk and for a pop, with the observation on the host and on the device.

    python -m benchmarks.vla_profile [--policies smolvla,pi05,pi0,call] \
        > benchmarks/results/<date>-<device>-vla-profile.txt
    python -m benchmarks.vla_profile --policies pi05 --kernels compiled+prefix \
        --vision bfloat16 --rows 30     # Pi0 / Pi0.5 with the opt-in kernels
    python -m benchmarks.vla_profile --policies smolvla --sizes aloha \
        --kernels compiled+prefix --expert-dtype bfloat16     # SmolVLA alike
"""
import argparse
import tempfile
import time

import torch
from torch.profiler import profile, ProfilerActivity

from benchmarks import vla, vla_pi0


def _replay_ms(graph, times=10):
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(times):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / times * 1e3


def _kernels(fn, rows=14):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.no_grad():
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by='cuda_time_total', row_limit=rows,
                                    max_name_column_width=60))


def smolvla(device, size='published', kernels='lerobot', expert='float32', rows=14):
    """SmolVLA with the VLM in float32 and in bfloat16 (LeRobot's kernels at the published
    sizes), or in bfloat16 alone with other kernels, sizes or expert dtype: its chunk graph,
    the denoising steps' graph alone, and each part's kernels."""
    dtypes = (torch.float32, torch.bfloat16) if (size, kernels, expert) == (
        'published', 'lerobot', 'float32') else (torch.bfloat16,)
    for dtype in dtypes:
        with tempfile.TemporaryDirectory() as tmp:
            _, _, _, policy, _ = vla._models('smolvla', size, device, tmp, dtype, kernels,
                                             expert)
            policy.capture(True)
            policy._chunk_obs.uniform_()
            _report(f'smolvla {size}, VLM {dtype}, expert {expert}, {kernels} kernels',
                    policy, rows)


def pi0(device, kind, kernels='lerobot', vision='float32', rows=14):
    from flashrt_ros.runtime.policies import Pi05ChunkPolicy, Pi0ChunkPolicy
    _, lerobot, stats, _ = vla_pi0.build(device, kind, 'bfloat16')
    denoise_kernels, prefix_kernels = vla.KERNELS[kernels]
    policy = (Pi05ChunkPolicy if kind == 'pi05' else Pi0ChunkPolicy)(
        lerobot, stats=stats, vision_dtype=vision, denoise_kernels=denoise_kernels,
        prefix_kernels=prefix_kernels)
    policy.state_specs()        # the prefix layout
    policy.capture(True)
    policy._chunk_obs.uniform_()
    policy._chunk_obs[-2 * policy.tokens:] = 1       # valid token ids and mask
    _report(f'{kind} bfloat16, vision {vision}, {kernels} kernels', policy, rows)


def _report(name, policy, rows):
    whole, denoise = _replay_ms(policy._chunk_graph), _replay_ms(policy._denoise_graph)
    print(f'{name}: whole chunk graph {whole:.1f} ms, denoising steps alone {denoise:.1f} ms, '
          f'so the prefix pass about {whole - denoise:.1f} ms')
    batch = policy._inputs(policy._chunk_obs)
    # outside a graph, as the graphs' kernels (compiled code runs its own kernels either way)
    print(f'{name}: the prefix pass, eager')
    _kernels(lambda: policy._prefix(batch), rows)
    print(f'{name}: the denoising steps, eager')
    _kernels(lambda: policy._denoise(batch), rows)


def _p50_ms(fn, times=30):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(times):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[times // 2] * 1e3


def call(device):
    """SmolVLA (published sizes, VLM bfloat16, LeRobot's kernels) on the engine: the whole
    call against its parts."""
    import cProfile
    import pstats

    from flashrt_ros.runtime.engine import PolicyEngine
    with tempfile.TemporaryDirectory() as tmp:
        _, _, _, policy, _ = vla._models('smolvla', 'published', device, tmp, torch.bfloat16)
        engine = PolicyEngine(policy, device=device, capsule_dir=f'{tmp}/capsules')
        torch.manual_seed(0)
        host = torch.rand(policy.obs_dim)
        policy.valid_probe(host)
        on_device = host.to(device).view(1, -1)
        obs = host.numpy()
        engine.snapshot('start')
        engine.step(obs)
        engine.snapshot('mid')
        parts = {
            'chunk graph replay': policy._chunk_graph.replay,
            'restore start': lambda: engine.restore('start'),
            'restore mid': lambda: engine.restore('mid'),
            'restore start + step (chunk), host obs': lambda: (engine.restore('start'),
                                                               engine.step(obs)),
            'restore start + step_all (chunk), device obs': lambda: (
                engine.restore('start'), engine.step_all(on_device)),
            'restore mid + step (pop), host obs': lambda: (engine.restore('mid'),
                                                           engine.step(obs)),
            'restore mid + step_all (pop), device obs': lambda: (engine.restore('mid'),
                                                                 engine.step_all(on_device)),
            'as_observations (host)': lambda: engine._observations(obs),
            'as_device_observations': lambda: engine._observations(on_device, 1, True)}
        for name, fn in parts.items():
            print(f'{name}: p50 {_p50_ms(fn):.3f} ms', flush=True)
        for name in ('restore start + step (chunk), host obs',
                     'restore mid + step (pop), host obs',
                     'restore mid + step_all (pop), device obs'):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(20):
                parts[name]()
            torch.cuda.synchronize()
            pr.disable()
            print(f'--- cProfile, 20 x {name}')
            pstats.Stats(pr).sort_stats('tottime').print_stats(18)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                parts[name]()
                torch.cuda.synchronize()
            print(f'--- torch.profiler, one {name}')
            print(prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=25,
                                            max_name_column_width=50))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--policies', default='smolvla')
    ap.add_argument('--kernels', default='lerobot', help=', '.join(vla.KERNELS))
    ap.add_argument('--sizes', default='published', help='SmolVLA: benchmarks.vla\'s sizes')
    ap.add_argument('--expert-dtype', default='float32', help='SmolVLA: expert_dtype')
    ap.add_argument('--vision', default='float32', help='Pi0 / Pi0.5: vision_dtype')
    ap.add_argument('--rows', type=int, default=14, help='kernel rows in each table')
    args = ap.parse_args()
    device = torch.device('cuda')
    print(torch.cuda.get_device_name(device), 'torch', torch.__version__)
    for name in args.policies.split(','):
        if name in ('pi0', 'pi05'):
            pi0(device, name, args.kernels, args.vision, args.rows)
        elif name == 'smolvla':
            smolvla(device, args.sizes, args.kernels, args.expert_dtype, args.rows)
        elif name == 'call':
            call(device)
        else:
            raise SystemExit(f'unknown policy {name!r}')
        torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
