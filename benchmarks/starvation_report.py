'''The starvation benchmark's verdict and results: the targets (loaded loss, loaded p99
against unloaded p99), the environment record, the markdown table and the two files written
(<out>/<date>-<device>-starvation-<commit>.{json,md}).
'''

# Standard library only at import, as every starvation module: the client processes are
# spawned and import them again (starvation.py says why).
import importlib.metadata
import json
import math
import os
import pathlib
import re
import subprocess

from .environment import device_slug, environment as base_environment, ROOT
from .report import log
from .starvation_node import ACT_DIM, OBS_DIM
from .starvation_stream import DRAIN_S, QOS_DEPTH

LOSS_TARGET_PCT = 1.0
P99_TARGET_RATIO = 2.0


def targets(phases):
    loaded, unloaded = phases['loaded'], phases['unloaded']
    ratio = loaded['latency_us']['p99'] / unloaded['latency_us']['p99']
    loss_ok = loaded['lost_pct'] < LOSS_TARGET_PCT
    p99_ok = ratio < P99_TARGET_RATIO
    out = {'loaded_loss_pct': loaded['lost_pct'], 'loss_below_1pct': bool(loss_ok),
           'loaded_over_unloaded_p99': ratio, 'p99_below_2x_unloaded': bool(p99_ok),
           'passed': bool(loss_ok and p99_ok),
           # the verdict stands as measured; this says whether the reference it is judged
           # against was itself sound
           'unloaded_kept_up': bool(unloaded['lost_pct'] < LOSS_TARGET_PCT)}
    if not out['unloaded_kept_up']:
        out['note'] = (f'the unloaded phase already lost {unloaded["lost_pct"]:.1f} %: the node '
                       'did not keep up with the rate without clients on this machine (see '
                       'the CPU columns), so its latency is set by full queues (keep-last '
                       f'{QOS_DEPTH} at {unloaded["sent"] / unloaded["window_s"]:g} Hz: '
                       f'{QOS_DEPTH * unloaded["window_s"] / unloaded["sent"]:g} s per queue, '
                       'publisher and subscription) and the p99 ratio compares two saturated '
                       'phases')
    return out


def summary(phases, t):
    parts = [f'{n}: sent {p["sent"]}, lost {p["lost"]} ({p["lost_pct"]:.2f} %), p50/p99/max '
             f'{_ms(p["latency_us"]["p50"])}/{_ms(p["latency_us"]["p99"])}/'
             f'{_ms(p["latency_us"]["max"])} ms, {p["service_calls"]["per_s"]:.0f} calls/s'
             for n, p in phases.items()]
    return '; '.join(parts) + f' -> {"PASS" if t["passed"] else "FAIL"}'


def _ms(us):
    return f'{us / 1000:.2f}' if math.isfinite(us) else 'n/a'


def _pct(x):
    return 'n/a' if x is None else f'{x:.0f}'


# ------------------------------------------------------------------ the results files

def environment(device, commit):
    import torch

    env = base_environment(torch.device(device), 'starvation', commit)
    env.update(cpu_count=os.cpu_count(), ros_domain_id=os.environ.get('ROS_DOMAIN_ID', ''),
               discovery_range=os.environ.get('ROS_AUTOMATIC_DISCOVERY_RANGE', ''),
               # the nodes inherit it: torch's intra-op threads are a large part of a CPU
               # node's cost (README: "Control loop under a busy planner")
               omp_num_threads=os.environ.get('OMP_NUM_THREADS', ''))
    try:
        import rclpy
        env.update(rclpy=importlib.metadata.version('rclpy'),
                   rmw=rclpy.get_rmw_implementation_identifier())
    except ImportError:     # a skipped run still says where it was skipped
        env.update(rclpy='not importable', rmw='')
    if env['commit_source'] == 'git':
        # what the measured tree holds beyond that commit (the lead's work in progress)
        env['modified'] = subprocess.run(
            ['git', 'status', '--porcelain', '--', 'flashrt_ros'], cwd=ROOT,
            capture_output=True, text=True).stdout.splitlines()
    return env


def render(result):
    env, p = result['environment'], result['parameters']
    md = [f'# Control loop under a busy planner ({env["date"][:10]})', '',
          f'{env["device_name"]} ({env["device"]}), {env.get("cpu_count", "?")} CPUs, load '
          f'{env["load_average_1m"]:.2f} at start, torch {env["torch"]}, rclpy '
          f'{env.get("rclpy", "?")} ({env.get("rmw", "?")}), Python {env["python"]}, '
          f'flashrt_ros {env["git_commit"]}{" (dirty)" if env["git_dirty"] else ""}', '']
    if 'skipped' in result:
        return '\n'.join(md + [f'Skipped: {result["skipped"]}', ''])
    md += [f'Stream: {p["rate"]:g} Hz, Float32MultiArray[{OBS_DIM}] -> [{ACT_DIM}], reliable, '
           f'keep-last {QOS_DEPTH}; warm-up {p["warmup_s"]} s, unloaded {p["unloaded_s"]} s, '
           f'loaded {p["seconds"]} s with {p["clients"]} client processes calling '
           f'snapshot/restore/list_capsules back to back; lost = no action {DRAIN_S:g} s '
           f'after the last send. Policy: {result["policy"]["layers"]} TorchScript, '
           f'action[0] = observation[0]. Stream process: '
           + (f'SCHED_FIFO {p["stream_priority"]}' if p.get('stream_priority')
              else 'default scheduler') + '.', '',
           'CPU: machine = busy share of all cores over the phase; node = the node process, '
           '% of one core.', '',
           '| node | phase | sent | lost | lost % | p50 ms | p99 ms | max ms | '
           'sender late p99 ms | service calls/s | machine CPU % | node CPU % |',
           '|---|---|---|---|---|---|---|---|---|---|---|---|']
    for label, node in result['nodes'].items():
        for phase, r in node['phases'].items():
            lat = r['latency_us']
            md.append(f'| {label} | {phase} | {r["sent"]} | {r["lost"]} | '
                      f'{r["lost_pct"]:.2f} | {_ms(lat["p50"])} | {_ms(lat["p99"])} | '
                      f'{_ms(lat["max"])} | {_ms(r["send_lag_us"]["p99"])} | '
                      f'{r["service_calls"]["per_s"]:.0f} | '
                      f'{_pct(r["cpu"].get("machine_busy_pct"))} | '
                      f'{_pct(r["cpu"].get("node_pct_of_a_core"))} |')
        if 'failed' in node:
            md.append(f'| {label} | failed: {node["failed"]} | | | | | | | | | | |')
    md += ['', f'Targets: loaded loss < {LOSS_TARGET_PCT:g} %, loaded p99 < '
               f'{P99_TARGET_RATIO:g}x unloaded p99.', '',
           '| node | source | loaded loss % | loaded p99 / unloaded p99 | verdict |',
           '|---|---|---|---|---|']
    for label, node in result['nodes'].items():
        t = node.get('targets')
        if t is None:
            md.append(f'| {label} | {node["source"]} | | | FAIL (did not run) |')
            continue
        md.append(f'| {label} | {node["source"]} ({node["module"]}) | '
                  f'{t["loaded_loss_pct"]:.2f} | {t["loaded_over_unloaded_p99"]:.2f}x | '
                  f'{"PASS" if t["passed"] else "FAIL"} |')
    md += [f'\n{label}: {node["targets"]["note"]}.' for label, node in result['nodes'].items()
           if 'note' in node.get('targets', {})]
    for label, node in result['nodes'].items():
        differs = node.get('installed_vs_checkout', {}).get('differs')
        if differs:
            md.append(f'\n{label}: the installed tree is not the checkout measured: '
                      f'{len(differs)} file(s) differ ({", ".join(differs[:6])}'
                      f'{", ..." if len(differs) > 6 else ""}).')
    return '\n'.join(md) + '\n'


def write(result, out_dir):
    env = result['environment']
    commit = re.sub(r'[^A-Za-z0-9]+', '-', env['git_commit']).strip('-') or 'unknown'
    if not re.fullmatch(r'[0-9a-f]{4,40}', commit):
        commit = 'unknown'
    stem = pathlib.Path(out_dir) / (f'{env["date"][:10]}-{device_slug(env)}-starvation-'
                                    f'{commit}')
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix('.json').write_text(json.dumps(result, indent=1, default=str) + '\n')
    table = render(result)
    stem.with_suffix('.md').write_text(table)
    log('')
    log(table)
    log(f'written: {stem}.json, {stem}.md')
    return stem
