"""The determinism benchmark's runs: per kind and position, a snapshot, the original
continuation, then `replays` restores each replayed and compared bit for bit; for history
models also two prefills compared, and on CUDA the same model with the attention dispatcher's
own kernel choice (reproducibility and step / prefill time, side by side).
"""

import os
import tempfile

import numpy as np
import torch

from flashrt_ros.runtime.engine import PolicyEngine

from .determinism_policies import build, observations
from .report import log
from .timing import stats


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
