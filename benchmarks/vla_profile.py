"""Where a VLA chunk's time goes on CUDA: its graph's replay, then the kernels of one chunk run
eagerly (the same kernels; torch.profiler). SmolVLA with the VLM in float32 and in bfloat16
(benchmarks/vla.py's models); Pi0 / Pi0.5 in bfloat16 (benchmarks/vla_pi0.py's), their prefix
pass and their denoising steps each a graph of its own and profiled apart.

    python -m benchmarks.vla_profile [--policies smolvla,pi05,pi0] \
        > benchmarks/results/<date>-<device>-vla-profile.txt
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


def smolvla(device):
    for dtype in (torch.float32, torch.bfloat16):
        with tempfile.TemporaryDirectory() as tmp:
            _, _, _, policy, _ = vla._models('smolvla', 'published', device, tmp, dtype)
            policy.capture(True)
            policy._chunk_obs.uniform_()
            print('smolvla', dtype, 'graph replay ms', _replay_ms(policy._chunk_graph))
            _kernels(policy._chunk_fn)


def pi0(device, kind):
    from flashrt_ros.runtime.policies import Pi05ChunkPolicy, Pi0ChunkPolicy
    _, lerobot, stats, _ = vla_pi0.build(device, kind, 'bfloat16')
    policy = (Pi05ChunkPolicy if kind == 'pi05' else Pi0ChunkPolicy)(lerobot, stats=stats)
    policy.state_specs()        # the prefix layout
    policy.capture(True)
    policy._chunk_obs.uniform_()
    policy._chunk_obs[-2 * policy.tokens:] = 1       # valid token ids and mask
    whole, denoise = _replay_ms(policy._chunk_graph), _replay_ms(policy._denoise_graph)
    print(f'{kind} bfloat16: whole chunk graph {whole:.1f} ms, denoising steps alone '
          f'{denoise:.1f} ms, so the prefix pass about {whole - denoise:.1f} ms')
    batch = policy._inputs(policy._chunk_obs)
    print(f'{kind}: the prefix pass, eager')
    _kernels(lambda: policy._prefix(batch))
    print(f'{kind}: the denoising steps, eager')
    _kernels(lambda: policy._denoise(batch))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--policies', default='smolvla')
    args = ap.parse_args()
    device = torch.device('cuda')
    print(torch.cuda.get_device_name(device), 'torch', torch.__version__)
    for name in args.policies.split(','):
        smolvla(device) if name == 'smolvla' else pi0(device, name)
        torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
