"""The tables of `python -m benchmarks.fleet`: render(results) -> the markdown written beside
the JSON (<out>.md) and printed at the end: the header (where, what, which policies), one table
per section, the identity checks.
"""

from .fleet_sections import ACT_DIM, OBS_DIM, OPS, POLICIES
from .report import MB, micros, p50_p99


def _rate(x):
    return f'{x / 1e6:.2f}M' if x >= 1e6 else f'{x / 1e3:.1f}k' if x >= 1e3 else f'{x:.0f}'


def render(results):
    env, cfg = results['environment'], results['config']
    r, out = results['sections'], []
    out.append(f'# Fleet benchmark: {env["device_name"]} ({env["mode"]})\n')
    dirty = ' (flashrt_ros modified)' if env['git_dirty'] else ''
    out += [f'- date: {env["date"]}, host {env["hostname"]}',
            f'- device: {env["device"]} ({env["device_name"]}), CUDA {env["cuda"] or "-"}, '
            f'driver {env["driver"] or "-"}',
            f'- versions: torch {env["torch"]}, Python {env["python"]}, '
            f'{env["cpu_threads"]} torch CPU threads, load average {env["load_average_1m"]:.1f}'
            ' at start',
            f'- commit: {env["git_commit"]}{dirty} ({env["commit_source"]})',
            f'- policies: mlp {OBS_DIM}-{"-".join(map(str, POLICIES["mlp"]["actor_hidden_dims"]))}'
            f'-{ACT_DIM} elu; recurrent LSTM {POLICIES["recurrent"]["rnn_hidden_dim"]}, head '
            f'{POLICIES["recurrent"]["actor_hidden_dims"][0]}, elu ({OBS_DIM} obs, {ACT_DIM} '
            f'actions; G1 motion.pt sizes: {_g1_note(results.get("g1_sizes", {}))})',
            '- every time is the host wall time of the whole public call, p50 / p99 in us '
            '(ms where marked); variants of one row are interleaved in one loop, shuffled '
            'every iteration; "x" columns are ratios within the row\n']
    for key, tables in (('fleet_tick', _fleet_tick), ('fleet_capsule_ops', _capsule_ops),
                        ('branches', _branches)):
        s = r.get(key)
        if s and 'rows' in s:
            out += tables(s['rows'], cfg) + ['']
    checks = results['checks']
    passed = sum(c['passed'] for c in checks)
    out.append(f'## Identity checks: {passed} / {len(checks)} passed\n')
    out += [f'- {"passed" if c["passed"] else "FAILED"}: {c["name"]} {c["detail"]}'.rstrip()
            for c in checks]
    out.append(f'\nTotal run time {results.get("elapsed_s", 0):.0f} s. Command: '
               f'`{results.get("command", "")}`')
    return '\n'.join(out) + '\n'


def _table(title, prose, columns):
    """A section's heading, its explanation and the head of its table."""
    return [f'## {title}\n', prose, '| ' + ' | '.join(columns) + ' |',
            '|' + ' --- |' * len(columns)]


def _fleet_tick(rows, cfg):
    out = _table(
        '1. Fleet tick: one engine with N sessions vs N single-session engines',
        'exact: PolicyEngine(sessions=N), session by session inside one graph; '
        'batched: batch_sessions=True, one batch per layer; engines: N separate '
        'single-session engines (each its own captured graph), a tick = .step() on '
        'each in turn. steps/s = N / tick p50. "= engines": exact actions equal the '
        'engines\' bit for bit; "batched diff": max abs difference of batched from '
        'exact actions over all ticks (batched rounds differently; |action| max in '
        'brackets).\n',
        ('policy', 'N', 'exact tick', 'exact steps/s', 'batched tick', 'batched steps/s',
         'engines tick', 'engines steps/s', 'exact x engines', 'batched x engines',
         '= engines', 'batched diff'))
    for w in rows:
        q, v = w['ratios'], w['steps_per_s']
        out.append(f'| {w["policy"]} | {w["n"]} | {p50_p99(w["exact"])} | '
                   f'{_rate(v["exact"])} | {p50_p99(w["batched"])} | {_rate(v["batched"])} | '
                   f'{p50_p99(w["engines"])} | {_rate(v["engines"])} | '
                   f'{q["exact_vs_engines"]:.2f} | '
                   f'{q["batched_vs_engines"]:.2f} | '
                   f'{"yes" if w["exact_equals_engines"] else "NO"} | '
                   f'{w["batched_vs_exact_max_abs_diff"]:.2g} '
                   f'({w["action_abs_max"]:.2g}) |')
    out.append('\nConstruction (graph capture included) and memory each build added, MB '
               'allocated / reserved (CUDA caching allocator; CPU: resident set, both '
               'columns). CUDA "allocated" includes cuBLAS workspaces made on first use '
               'of each capture stream, process-wide, so the first rows absorb them; '
               '"reserved" includes every captured graph\'s private memory pool.\n')
    out.append('| policy | N | exact engine s | exact MB | batched engine s | batched MB | '
               'N engines built | N engines s | ms each | N engines MB |')
    out.append('|' + ' --- |' * 10)
    for w in rows:
        out.append(f'| {w["policy"]} | {w["n"]} | {w["exact_create_s"]:.2f} | '
                   f'{_mem(w, "exact")} | {w["batched_create_s"]:.2f} | '
                   f'{_mem(w, "batched")} | {w["engines_built"]} | '
                   f'{w["engines_create_s"]:.2f} | {w["engines_create_ms_each"]:.1f} | '
                   f'{_mem(w, "engines")} |')
    return out + [f'\n{w["policy"]} N={w["n"]}: {w["note"]}' for w in rows if 'note' in w]


def _capsule_ops(rows, cfg):
    out = _table(
        '2. Capsule operations on one session while the fleet steps',
        'N-session engines (exact, and batched); between ticks of the whole fleet, '
        'one op on one session (every op follows a tick, so rollback(1) has a step '
        'to undo); "single": the same op on a single-session engine between its '
        'steps. Op cells: whole call p50 / p99 [OpResult.latency_us p50, the copy '
        'window]. Tick rows: the exact fleet\'s tick with no ops between ticks, and '
        'each engine\'s tick (step) when an op sits between ticks, with the exact '
        'tick\'s with / without ratio.\n',
        ('policy', 'N', 'what', 'exact fleet', 'batched fleet', 'single-session',
         'exact x single', 'batched x single'))
    for w in rows:
        t, head = w['ticks'], f'| {w["policy"]} | {w["n"]} |'
        out.append(f'{head} tick, no ops between | {p50_p99(t["without_ops"])} | | | | |')
        out.append(f'{head} tick, an op between (exact: x '
                   f'{w["ratios"]["tick_with_vs_without_ops_p50"]:.2f} of no ops) | '
                   f'{p50_p99(t["with_ops"])} | {p50_p99(t["batched"])} | '
                   f'{p50_p99(t["single"])} | | |')
        for op in OPS:
            o = w['ops'][op]
            cells = [f'{p50_p99(o[e])} [{micros(o[e + "_copy_window"]["p50"])}]'
                     for e in ('exact', 'batched', 'single')]
            out.append(f'{head} {op}{"(1)" if op == "rollback" else ""} | '
                       f'{" | ".join(cells)} | {o["exact_vs_single_p50"]:.2f} | '
                       f'{o["batched_vs_single_p50"]:.2f} |')
    return out


def _branches(rows, cfg):
    out = _table(
        f'3. K branches from one capsule: parallel sessions vs one engine in turn (H = '
        f'{cfg["horizon"]} steps each)',
        'sequential: one single-session engine, per branch restore + H steps; '
        'parallel: K restores into a K-session engine, then H step_all ticks. Wall '
        'time of all K branches, p50 / p99 in ms. "bit for bit": parallel (exact) '
        'branch k equals sequential branch k; batched diff: max abs difference of '
        'the batched engine\'s branches from the sequential ones.\n',
        ('policy', 'K', 'sequential ms', 'parallel exact ms', 'x', 'parallel batched ms', 'x',
         'bit for bit', 'batched diff'))
    for w in rows:
        q = w['ratios']
        out.append(f'| {w["policy"]} | {w["k"]} | {_ms(w["sequential"])} | '
                   f'{_ms(w["parallel_exact"])} | {q["speedup_exact"]:.2f} | '
                   f'{_ms(w["parallel_batched"])} | {q["speedup_batched"]:.2f} | '
                   f'{"yes" if w["exact_bit_identical"] else "NO"} | '
                   f'{w["batched_max_abs_diff"]:.2g} |')
    return out


def _mem(row, name):
    return f'{row[name + "_allocated_bytes"] / MB:.1f} / {row[name + "_reserved_bytes"] / MB:.1f}'


def _ms(s):
    return f'{s["p50"] / 1e3:.2f} / {s["p99"] / 1e3:.2f}'


def _g1_note(g):
    if not g.get('checked'):
        return 'not checked (file absent)'
    return 'match' if g['match'] else f'DIFFER: {g["found"]}'
