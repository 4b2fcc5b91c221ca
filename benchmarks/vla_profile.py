"""Where a SmolVLA chunk's time goes on CUDA: its graph's replay, then the kernels of one
chunk run eagerly (the same kernels; torch.profiler), with the VLM in float32 and in bfloat16,
at the published sizes (benchmarks/vla.py's models).

    python -m benchmarks.vla_profile > benchmarks/results/<date>-<device>-vla-profile.txt
"""
import tempfile
import time

import torch
from torch.profiler import profile, ProfilerActivity

from benchmarks import vla


def main():
    device = torch.device('cuda')
    for dtype in (torch.float32, torch.bfloat16):
        with tempfile.TemporaryDirectory() as tmp:
            _, _, _, policy = vla._models('smolvla', 'published', device, tmp, dtype)
            policy.capture(True)
            policy._chunk_obs.uniform_()
            for _ in range(3):
                policy._chunk_graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                policy._chunk_graph.replay()
            torch.cuda.synchronize()
            print(dtype, 'graph replay ms', (time.perf_counter() - t0) / 10 * 1e3)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                with torch.no_grad():
                    policy._chunk_fn()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by='cuda_time_total', row_limit=14,
                                            max_name_column_width=60))


if __name__ == '__main__':
    main()
