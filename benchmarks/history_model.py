"""Sections 2, 4 and 6 on one history (hybrid) policy, and the driver that runs them with
section 3 (first_action.py) on one engine, history length by history length: live-bytes
scaling (snapshot / restore follow the live bytes, not the capacity), the KV-only ablation,
and the baseline of the same state held as a dictionary of per-layer tensors.
"""

import torch

from flashrt_ros.runtime.policies import make_policy

from .first_action import first_action
from .sections import ACT_DIM, bench_engine, check, OBS_DIM, observations, ratio
from .timing import Clock, interleaved


def history_engine(cfg, device):
    m = cfg['model']
    dtype = torch.bfloat16 if (torch.device(device).type == 'cuda' and m['bf16']) \
        else torch.float32
    capacity = max(cfg['histories']) + cfg['continue_steps'] + 8
    policy = make_policy('history', OBS_DIM, ACT_DIM, seed=0, capacity=capacity,
                         d_model=m['d_model'], n_layers=m['n_layers'], heads=m['heads'],
                         dtype=dtype)
    params = sum(p.numel() for p in policy.parameters())
    e = bench_engine(policy, device, budget=(8 << 30) if torch.device(device).type == 'cuda'
                     else (2 << 30))
    info = {'d_model': m['d_model'], 'n_layers': m['n_layers'], 'heads': m['heads'],
            'dtype': str(dtype).replace('torch.', ''), 'parameters': params,
            'capacity': capacity, 'row_nbytes': e.arena.row_nbytes,
            'static_nbytes': e.arena.static_nbytes, 'arena_nbytes': e.arena.total_nbytes,
            'cuda_graph': e.graph_captured}
    return e, info


def live_bytes_scaling(e, H, cfg, device, checks):
    """Snapshot / restore / rollback at position H in a fixed-capacity arena."""
    clock = Clock(device)
    iters, warm = cfg['scaling_iters'], 3
    live = e.arena.live_nbytes(e.position)
    obs = observations(1, seed=7)[0]
    src = e.arena.storage
    dst = torch.empty_like(src)
    e.snapshot('live', overwrite=True)
    timed, done = interleaved(clock, {
        'copy_live': lambda: dst[:live].copy_(src[:live]),
        'copy_capacity': lambda: dst.copy_(src),
    }, {
        'snapshot': lambda: e.snapshot('live', overwrite=True),
        'restore': lambda: e.restore('live'),
        'rollback': lambda: e.rollback(1),
    }, iters, warm, before={'rollback': lambda: e.step(obs)})
    copy_live, copy_full = timed['copy_live'], timed['copy_capacity']
    snap, restore, rollback = done['snapshot'], done['restore'], done['rollback']
    check(checks, f'scaling H={H}: capsule holds live bytes only',
          e.store.get('live').manifest.nbytes == live)
    return {'position': H, 'live_nbytes': live, 'capacity_nbytes': e.arena.total_nbytes,
            'snapshot': snap[0], 'snapshot_wall': snap[1], 'restore': restore[0],
            'restore_wall': restore[1], 'rollback': rollback[0], 'copy_live': copy_live,
            'copy_capacity': copy_full,
            'ratios': {'snapshot_vs_live_copy': ratio(snap[0]['p50'], copy_live['p50']),
                       'capacity_copy_vs_snapshot': ratio(copy_full['p50'], snap[0]['p50'])}}


def kv_ablation(e, H, future, original, checks):
    """Restore only KV (+ meta, which holds the position: without it the next token would be
    written at the wrong position and the comparison would say nothing) into a fresh episode;
    recurrent, conv and chunk state stay at their initial values."""
    e.reset_episode()
    e.restore('h', kinds=['kv', 'meta'])
    ablated = [e.step(o) for o in future]
    diffs = [float((a - b).abs().max()) for a, b in zip(ablated, original)]
    diverge = next((i for i, d in enumerate(diffs) if d > 0), None)
    check(checks, f'kv_ablation H={H}: KV-only restore changes the actions', diverge is not None)
    return {'history': H, 'kinds': ['kv', 'meta'], 'steps_compared': len(diffs),
            'first_divergent_step': -1 if diverge is None else diverge,
            'diverged': diverge is not None, 'max_abs_diff': max(diffs),
            'steps_identical': sum(d == 0 for d in diffs)}


def _dynamic_cache_tensors(cache):
    # transformers >= 4.54 keeps per-layer objects; older releases keep two lists
    if hasattr(cache, 'layers'):
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return list(cache.key_cache) + list(cache.value_cache)


def dict_baseline(e, H, device, cfg, checks):
    """The same hybrid state as a dictionary of per-layer tensors (each its own allocation),
    snapshotted by cloning each live tensor and restored by copying each back; capsules timed
    by the same clock around the whole engine call."""
    clock = Clock(device)
    iters = cfg['scaling_iters']
    e.restore('h')
    v = e.arena.views
    per, append = {}, set()
    for i in range(v['kv'].shape[1]):
        for j, kv in enumerate('kv'):
            name = f'layer{2 * i}.{kv}'
            per[name] = v['kv'][:, i, j].clone()          # [capacity, heads, head_dim]
            append.add(name)
    for i in range(v['conv'].shape[0]):
        per[f'layer{2 * i + 1}.conv'] = v['conv'][i].clone()
        per[f'layer{2 * i + 1}.recurrent'] = v['recurrent'][i].clone()
    for name in ('chunk', 'cursor', 'rng', 'meta'):
        per[name] = v[name].clone()

    def snapshot():
        return {n: (t[:H].clone() if n in append else t.clone()) for n, t in per.items()}

    def restore(saved):
        for n, t in per.items():
            (t[:H] if n in append else t).copy_(saved[n])

    saved = snapshot()
    e.snapshot('b', overwrite=True)
    timed, _ = interleaved(clock, {
        'dict_snapshot': snapshot, 'dict_restore': lambda: restore(saved),
        'capsule_snapshot': lambda: e.snapshot('b', overwrite=True),
        'capsule_restore': lambda: e.restore('b')}, {}, iters)
    dict_snap, dict_restore = timed['dict_snapshot'], timed['dict_restore']
    cap_snap, cap_restore = timed['capsule_snapshot'], timed['capsule_restore']
    unpacked = e.arena.unpack(e.store.get('b').data, H)
    same = torch.equal(saved['layer0.k'], unpacked['kv'][:, 0, 0]) and \
        torch.equal(saved['chunk'], unpacked['chunk'])
    check(checks, f'baseline H={H}: dict snapshot holds the capsule bytes', same)
    out = {'history': H, 'tensors': len(per), 'dict_snapshot': dict_snap,
           'dict_restore': dict_restore, 'capsule_snapshot': cap_snap,
           'capsule_restore': cap_restore,
           'ratios': {'dict_vs_capsule_snapshot': ratio(dict_snap['p50'], cap_snap['p50']),
                      'dict_vs_capsule_restore': ratio(dict_restore['p50'],
                                                       cap_restore['p50'])}}
    try:
        from transformers import DynamicCache
    except ImportError:
        out['dynamic_cache'] = {'skipped': 'transformers is not installed'}
        return out
    try:
        cache = DynamicCache()
        for i in range(v['kv'].shape[1]):
            k = per[f'layer{2 * i}.k'][:H].transpose(0, 1).unsqueeze(0)   # [1, heads, H, D]
            val = per[f'layer{2 * i}.v'][:H].transpose(0, 1).unsqueeze(0)
            cache.update(k.contiguous(), val.contiguous(), i)
        kv = _dynamic_cache_tensors(cache)
        rest = [t for n, t in per.items() if n not in append]    # DynamicCache holds KV only

        def dyn_snapshot():
            return [t.clone() for t in kv + rest]

        dsaved = dyn_snapshot()

        def dyn_restore():
            for t, s in zip(kv + rest, dsaved):
                t.copy_(s)

        timed, _ = interleaved(clock, {'snapshot': dyn_snapshot, 'restore': dyn_restore}, {},
                               iters)
        ds, dr = timed['snapshot'], timed['restore']
        import transformers
        out['dynamic_cache'] = {
            'transformers': transformers.__version__, 'tensors': len(kv) + len(rest),
            'snapshot': ds, 'restore': dr,
            'ratios': {'vs_capsule_snapshot': ratio(ds['p50'], cap_snap['p50']),
                       'vs_capsule_restore': ratio(dr['p50'], cap_restore['p50'])}}
    except Exception as exc:   # an API change in transformers must not sink the run
        out['dynamic_cache'] = {'skipped': f'DynamicCache failed: {exc!r}'}
    return out


def run_history_sections(cfg, device, checks, log, publish):
    """Sections 2, 3, 4 and 6 on one history engine; publish(section, data) after each H."""
    e, info = history_engine(cfg, device)
    log(f'  history model: {info["parameters"] / 1e6:.1f}M parameters, d_model '
        f'{info["d_model"]}, {info["n_layers"]} layers, {info["heads"]} heads, '
        f'{info["dtype"]}, capacity {info["capacity"]}, graph {info["cuda_graph"]}')
    obs = observations(max(cfg['histories']) + cfg['continue_steps'])
    out = {k: {'model': info, 'rows': []} for k in
           ('live_bytes_scaling', 'first_action', 'kv_ablation', 'baseline')}
    for H in cfg['histories']:
        hist, future = obs[:H], obs[H:H + cfg['continue_steps']]
        e.reset_episode()
        e.prefill(hist)                       # the original run (also warms the prefill)
        out['live_bytes_scaling']['rows'].append(live_bytes_scaling(e, H, cfg, device, checks))
        e.snapshot('h', overwrite=True)
        out['baseline']['rows'].append(dict_baseline(e, H, device, cfg, checks))
        e.restore('h')
        original, row = first_action(e, H, hist, future, cfg, checks)
        out['kv_ablation']['rows'].append(kv_ablation(e, H, future, original, checks))
        out['first_action']['rows'].append(row)
        log(f'  H={H}: restore->action {row["restore_then_step"]["p50"]:.0f} us, '
            f're-prefill->action {row["reprefill_then_step"]["p50"]:.0f} us '
            f'({row["speedup_p50"]:.1f}x), bit-exact {row["bit_exact_vs_continued"]}')
        for k, v in out.items():
            publish(k, v)
    return out
