"""The benchmark suite's sections (SECTIONS, in the order of the report) and what the modules
measuring them share: the engine built for timing, identity-check records, ratios, the history
model's observations, and the scan of the results for non-finite numbers.

Each section returns plain Python (dicts of numbers and strings) and appends identity checks to
`checks`; nothing in a section prints tables or writes files (run.py and run_report.py do).
Every timed operation goes through the real runtime: PolicyEngine.snapshot / restore / fork /
rollback / step / prefill over a StateArena. Baselines (one contiguous copy, per-buffer
copies, a dictionary of per-layer tensors) sit next to them in the same process.

    1. capsule_ops                    capsule_copies.py
    2. live_bytes_scaling             history_model.py (with 4 and 6, on one history engine)
    3. first_action                   first_action.py
    4. kv_ablation, 6. baseline       history_model.py
    5. control_step                   step_graphs.py
    7. ros                            ros_e2e.py
"""

import gc
import math
import tempfile

import torch

from flashrt_ros.runtime.engine import PolicyEngine

SECTIONS = ('capsule_ops', 'live_bytes_scaling', 'first_action', 'kv_ablation', 'control_step',
            'baseline', 'ros')
OBS_DIM, ACT_DIM = 48, 12


def ratio(a, b):
    return float(a / b) if b > 0 else 0.0


def check(checks, name, passed, detail=''):
    checks.append({'name': name, 'passed': bool(passed), 'detail': detail})


def free_memory(device):
    gc.collect()
    if torch.device(device).type == 'cuda':
        torch.cuda.empty_cache()


def bench_engine(policy, device, cuda_graph=True, rollback_depth=32, budget=1 << 30):
    # capsules never leave the device tier here: demotion would time a different path
    return PolicyEngine(policy, device=device, cuda_graph=cuda_graph,
                        rollback_depth=rollback_depth, device_budget=budget,
                        host_budget=1 << 20, capsule_dir=tempfile.mkdtemp(prefix='frt-bench-'))


def observations(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, OBS_DIM, generator=g)


def finite_numbers(obj, path=''):
    """Paths of every non-finite number in a nested dict/list (empty when all are finite)."""
    bad = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            bad += finite_numbers(v, f'{path}.{k}')
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            bad += finite_numbers(v, f'{path}[{i}]')
    elif isinstance(obj, float) and not math.isfinite(obj):
        bad.append(path)
    return bad
