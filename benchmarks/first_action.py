"""Section 3, time to first action: restore(capsule) then step(), against the fastest cold
re-prefill of the same history (eager, and captured once as a CUDA graph), with the identity
check against the original run continued from the snapshot point.
"""

import torch

from flashrt_ros.runtime.graph import StepGraph

from .sections import check, ratio
from .timing import interleaved, stats, wall


def first_action(e, H, hist, future, cfg, checks):
    """Restore -> first action vs cold re-prefill -> first action, plus the identity check.

    The reference for bit-exactness is the original run continued from the snapshot point
    (design.md): a re-prefill runs other kernels and may round differently.
    """
    e.snapshot('h', overwrite=True)
    original = [e.step(o) for o in future]
    restored_first, first_ok = [], True
    for i in range(cfg['restore_reps'] + 2):
        (_, a), us = wall(lambda: (e.restore('h'), e.step(future[0])))
        first_ok &= torch.equal(a, original[0])
        if i >= 2:
            restored_first.append(us)
    e.restore('h')
    continued = [e.step(o) for o in future]
    exact = all(torch.equal(a, b) for a, b in zip(original, continued))
    check(checks, f'first_action H={H}: restored run equals continued original bit for bit '
          f'({len(future)} steps)', exact and first_ok)
    e.restore('h')
    _, done = interleaved(None, {}, {'restore': lambda: e.restore('h')}, cfg['restore_reps'], 2)
    op = done['restore'][0]

    p, diff = _cold_starts(e, lambda: (e.prefill(hist), e.step(future[0]))[1], original[0],
                           cfg['prefill_reps'], warmup=1)
    r = stats(restored_first)
    graphed = _graphed_prefill(e, hist, future[0], cfg, original[0])
    fastest = p if 'skipped' in graphed or graphed['then_step']['p50'] > p['p50'] \
        else graphed['then_step']
    row = {'history': H, 'restore_then_step': r, 'restore_op': op,
           'reprefill_then_step': p, 'graphed_prefill': graphed,
           'fastest_prefill': 'eager' if fastest is p else 'cuda graph',
           'speedup_p50': ratio(fastest['p50'], r['p50']),
           'speedup_vs_eager_p50': ratio(p['p50'], r['p50']),
           'bit_exact_vs_continued': bool(exact and first_ok),
           'reprefill_max_abs_diff': diff,
           'action_scale': float(torch.stack(original).abs().max())}
    return original, row


def _graphed_prefill(e, hist, first_obs, cfg, reference):
    """The fastest cold prefill torch offers this model: the same HistoryPolicy.prefill of H
    tokens at position 0, captured once as a CUDA graph (no per-kernel launch cost from the
    host), then replayed from a zeroed arena, followed by the first step. CUDA only."""
    if e.device.type != 'cuda' or not e.graph_captured:
        return {'skipped': 'needs CUDA graphs'}
    H = len(hist)
    tokens = hist.to(e.device)
    e.reset_episode()
    # the engine's own capture protocol (side-stream warm-up, state put back afterwards)
    graph = StepGraph(lambda: e.policy.prefill(tokens, position=0), e.device, True,
                      state=e.arena.storage)

    def cold_start():
        graph.replay()
        # what PolicyEngine.prefill does on the host after the policy's prefill
        session = e.session()
        session.position, session.rollback_available = H, 0
        return e.step(first_obs)

    times, diff = _cold_starts(e, cold_start, reference, cfg['prefill_reps'], warmup=2)
    return {'then_step': times, 'max_abs_diff': diff}


def _cold_starts(e, start, reference, reps, warmup):
    """start() -> first action from a zeroed arena, timed (host wall) `reps` times after
    `warmup` untimed ones: (stats, max abs difference of its actions from `reference`)."""
    times, diff = [], 0.0
    for i in range(warmup + reps):
        e.reset_episode()                    # untimed: zeroes the arena, as a cold start would
        a, us = wall(start)
        diff = max(diff, float((a - reference).abs().max()))
        if i >= warmup:
            times.append(us)
    return stats(times), diff
