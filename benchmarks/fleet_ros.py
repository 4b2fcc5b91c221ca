'''Branches spread over fleet nodes through ROS: K what-ifs of a MuJoCo cart-pole episode run
one after another on one session, then all at once on K sessions of one node (one GPU), and
on two nodes with K/2 sessions each (one per GPU, when two GPUs are there). Each node is the
installed `policy_node` in its own process; this process is the episode runner.

Reports wall time of the K sequential branches vs the parallel ones, and the runner's checks
(every parallel branch equals its sequential run bit for bit, actions and world states).

  python -m benchmarks.fleet_ros --branches 8 --commit <sha> --out benchmarks/results/<name>
'''

import argparse
import json
import os
import pathlib
import tempfile
import time

import torch

from .environment import environment
from .ros_e2e import _executable, _start, _stop


def _node(name, device, sessions, capsule_dir, log_dir):
    cmd = [_executable(), '--ros-args', '-r', f'__node:={name}',
           '-p', 'policy_type:=recurrent', '-p', 'obs_dim:=4', '-p', 'act_dim:=1',
           '-p', 'rnn_hidden_dim:=64', '-p', f'device:={device}',
           '-p', f'sessions:={sessions}', '-p', f'capsule_dir:={capsule_dir}',
           '-p', 'status_period:=0.1']
    return _start(cmd, pathlib.Path(log_dir) / f'{name}.log')


def _episodes(layout, branches, steps, branch_at, log_dir):
    '''layout: [(node name, device, sessions)]; branches run on every session in order.'''
    import rclpy

    from flashrt_ros.client import PolicyClient, spin_in_thread
    from flashrt_ros.harness.episode_runner import EpisodeRunner
    from flashrt_ros.harness.fleet import Fleet
    from flashrt_ros.sim.cartpole import MujocoWorld

    capsules = tempfile.mkdtemp(prefix='fleet_ros_')
    procs = [_node(n, d, s, capsules, log_dir) for n, d, s in layout]
    rclpy.init()
    node = rclpy.create_node(f'fleet_ros_runner_{os.getpid()}')
    spinner = spin_in_thread(node)
    try:
        main = f'/{layout[0][0]}'
        client = PolicyClient(node, main, timeout=60.0, session='s0')
        client.wait_ready(timeout=120.0)
        addresses = [(f'/{n}', f's{i}') for n, _, s in layout for i in range(s)]
        fleet = Fleet(node, addresses, main, MujocoWorld, robot=False, timeout=60.0)
        lines = []
        runner = EpisodeRunner(MujocoWorld(), client, seed=7, log=lines.append)
        ok = runner.run(steps=steps, branch_at=branch_at, branches=branches, push=0.5,
                        noise_std=0.01, resets=2, fleet=fleet)
        return {'nodes': [{'name': n, 'device': d, 'sessions': s} for n, d, s in layout],
                'branches': branches, 'steps_per_branch': steps - branch_at,
                'sequential_s': runner.sequential_s, 'parallel_s': runner.parallel_s,
                'speedup': runner.sequential_s / runner.parallel_s,
                'checks_passed': sum(ok for _, ok, _ in runner.checks),
                'checks': len(runner.checks), 'all_passed': bool(ok),
                'failed': [c[0] for c in runner.checks if not c[1]], 'log': lines}
    finally:
        spinner.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
        for proc, log in procs:
            _stop(proc, log)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--branches', type=int, default=8)
    ap.add_argument('--steps', type=int, default=250)
    ap.add_argument('--branch-at', type=int, default=50)
    ap.add_argument('--commit', default='')
    ap.add_argument('--out', required=True, help='results path without extension')
    args = ap.parse_args(argv)
    if _executable() is None:
        raise SystemExit('policy_node is not installed: source the install first '
                         '(tools/env.sh, or benchmarks/ros_from_wheels.sh on the GPU machine)')
    gpus = torch.cuda.device_count()
    dev = 'cuda:0' if gpus else 'cpu'
    k = args.branches
    log_dir = tempfile.mkdtemp(prefix='fleet_ros_logs_')
    runs = {'one node': _episodes([('fleet_one', dev, k)], k, args.steps, args.branch_at,
                                  log_dir)}
    if gpus >= 2:
        runs['two nodes, two GPUs'] = _episodes(
            [('fleet_gpu0', 'cuda:0', k // 2), ('fleet_gpu1', 'cuda:1', k - k // 2)], k,
            args.steps, args.branch_at, log_dir)
    else:
        runs['two nodes, two GPUs'] = {'skipped': f'{gpus} GPU(s) here; needs 2'}
    result = {'environment': environment(torch.device(dev), 'fleet_ros', args.commit),
              'runs': runs}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix('.json').write_text(json.dumps(result, indent=1, default=str))
    md = [f'# Parallel branches over fleet nodes ({time.strftime("%Y-%m-%d")})', '',
          *(f'- {k_}: {v}' for k_, v in result['environment'].items()), '',
          '| layout | branches x steps | sequential s | parallel s | speedup | checks |',
          '|---|---|---|---|---|---|']
    for name, r in runs.items():
        if 'skipped' in r:
            md.append(f'| {name} | skipped: {r["skipped"]} | | | | |')
            continue
        nodes = ', '.join(f'{n["device"]} x{n["sessions"]}' for n in r['nodes'])
        md.append(f'| {name} ({nodes}) | {r["branches"]} x {r["steps_per_branch"]} | '
                  f'{r["sequential_s"]:.3f} | {r["parallel_s"]:.3f} | {r["speedup"]:.2f}x | '
                  f'{r["checks_passed"]}/{r["checks"]} |')
    out.with_suffix('.md').write_text('\n'.join(md) + '\n')
    print('\n'.join(md))
    failed = [n for n, r in runs.items() if 'skipped' not in r and not r['all_passed']]
    if failed:
        raise SystemExit(f'checks failed in {failed}: see {out.with_suffix(".json")}')


if __name__ == '__main__':
    main()
