"""The table of `python -m benchmarks.determinism`: render(results) -> the markdown written
beside the JSON (<out>.md) and printed at the end.
"""

import json

from .determinism_policies import KINDS


def render(results):
    env, s = results['environment'], results['sections']
    out = [f'# flashrt_ros determinism: {env["device_name"]} ({env["mode"]})\n',
           f'{env["date"]}, torch {env["torch"]}, CUDA {env["cuda"] or "-"}, driver '
           f'{env["driver"] or "-"}, Python {env["python"]}, commit {env["git_commit"]}'
           f'{" (tree modified)" if env["git_dirty"] else ""}.\n',
           f'Backends: {json.dumps(results["config"].get("backends", {}))}\n']
    if results['config'].get('kernels'):
        out.append(f'Attention kernels in one step: {json.dumps(results["config"]["kernels"])}\n')
    out += ['| kind | position | replays | differing replays | max abs diff | fresh process '
            'equal | probe at configure |', '|' + ' --- |' * 7]
    for kind in KINDS:
        r = s.get(kind)
        if not r:
            continue
        if 'skipped' in r:
            out.append(f'| {kind} | skipped: {r["skipped"]} |||||')
            continue
        p = r['probe']
        for row in r['rows']:
            fresh = row.get('fresh_process_equal', 'not run')
            out.append(f'| {kind} | {row["position"]} | {row["replays"]} | '
                       f'{row["differing_replays"]} | {row["max_abs_diff"]:.3g} | {fresh} | '
                       f'{p.get("deterministic")} ({p.get("probe_ms", 0):.0f} ms) |')
    for kind in KINDS:
        d = (s.get(kind) or {}).get('dispatcher')
        if not d:
            continue
        out += [f'\n## {kind}: reproducible kernel vs the dispatcher\'s choice\n',
                '| position | default: differing / replays | dispatcher: differing | '
                'step p50 default / dispatcher (us) | prefill default / dispatcher (ms) |',
                '|' + ' --- |' * 5]
        for w in d['rows']:
            out.append(f'| {w["position"]} | {w["efficient"]["differing_replays"]} / '
                       f'{w["efficient"]["replays"]} | {w["dispatcher"]["differing_replays"]} '
                       f'| {w["efficient_step"]["p50"]:.1f} / {w["dispatcher_step"]["p50"]:.1f}'
                       f' | {w["efficient_prefill_ms"]:.1f} / {w["dispatcher_prefill_ms"]:.1f} |')
        out.append(f'\nDispatcher probe at configure: {d["probe"]}')
    bad = [c for c in results['checks'] if not c['passed']]
    out.append(f'\n## Checks: {len(results["checks"]) - len(bad)} / {len(results["checks"])} '
               'passed\n')
    out += [f'- FAILED: {c["name"]} {c["detail"]}' for c in bad]
    return '\n'.join(out) + '\n'
