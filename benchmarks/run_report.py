"""The tables of `python -m benchmarks.run`: render(results) -> the markdown written beside the
JSON (<out>.md) and printed at the end, one table per section in the order of SECTIONS, then
the identity checks.
"""

from .report import MB, micros, p50_p99
from .sections import SECTIONS


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
                f'| {w["size"]} | {w["n_buffers"]} | {micros(w["copy"]["p50"])} | '
                f'{p50_p99(w["raw_memcpy"])} | {p50_p99(w["torch_copy_sync"])} | '
                f'{p50_p99(w["snapshot_wall"])} | {q["snapshot_vs_copy"]:.2f} | '
                f'{q["snapshot_vs_raw_memcpy"]:.2f} | {p50_p99(w["restore_wall"])} | '
                f'{q["restore_vs_copy"]:.2f} | {q["restore_vs_raw_memcpy"]:.2f} | '
                f'{p50_p99(w["fork_wall"])} | {p50_p99(w["rollback_wall"])} | '
                f'{micros(w["snapshot"]["p50"])}, {micros(w["restore"]["p50"])} | '
                f'{micros(w["naive_snapshot"]["p50"])}, {micros(w["naive_restore"]["p50"])} | '
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
                out.append(f'| {kind} | {mode} | {micros(w["p50"])} | {micros(w["p99"])} | '
                           f'{micros(w["max"])} | {p50_p99(d)} | {ratio[0]} | {ratio[1]} |')
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
                out.append(f'| {name} | {w["n"]} | {micros(w["p50"])} | {micros(w["p99"])} | '
                           f'{micros(w["max"])} |')
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
                       f'{_mb(w["capacity_nbytes"])} | {p50_p99(w["snapshot"])} | '
                       f'{micros(w["copy_live"]["p50"])} | {q["snapshot_vs_live_copy"]:.2f} | '
                       f'{micros(w["copy_capacity"]["p50"])} | '
                       f'{q["capacity_copy_vs_snapshot"]:.1f} | {p50_p99(w["restore"])} | '
                       f'{p50_p99(w["rollback"])} |')
    elif key == 'first_action':
        out.append('| history | restore -> action p50 / p99 | restore op p50 | eager '
                   're-prefill -> action p50 / p99 | graphed re-prefill -> action p50 / p99 | '
                   'speedup p50 vs the fastest prefill | vs eager | bit-exact vs continued '
                   'original | re-prefill max abs diff (action scale) |')
        out.append('|' + ' --- |' * 9)
        for w in rows:
            exact = 'yes' if w['bit_exact_vs_continued'] else 'NO'
            g = w.get('graphed_prefill', {'skipped': 'not measured'})
            graphed = g['skipped'] if 'skipped' in g else p50_p99(g['then_step'])
            out.append(f'| {w["history"]} | {p50_p99(w["restore_then_step"])} | '
                       f'{micros(w["restore_op"]["p50"])} | {p50_p99(w["reprefill_then_step"])} | '
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
                f'{micros(d["snapshot"]["p50"])}, {micros(d["restore"]["p50"])}'
            out.append(f'| {w["history"]} | {w["tensors"]} | {micros(w["dict_snapshot"]["p50"])} '
                       f'| {micros(w["capsule_snapshot"]["p50"])} | '
                       f'{q["dict_vs_capsule_snapshot"]:.1f} | {micros(w["dict_restore"]["p50"])} '
                       f'| {micros(w["capsule_restore"]["p50"])} | '
                       f'{q["dict_vs_capsule_restore"]:.1f} | {dyn} |')
    return out
