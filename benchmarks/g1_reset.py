"""World + policy reset latency on the Unitree G1: how long a what-if branch or an episode reset
keeps the robot's next step waiting.

The policy node runs in its own process (the installed policy_node with config/g1.yaml and
motion.pt, on the CPU); this process holds the G1 world in-process (RobotWorld, as the episode
runner does) and talks to the node over ROS (Fast DDS): a PolicyClient for the services, a
RobotLink for the steps. After 10 s of walking, world and policy are snapshotted (the runner's
branch point), then each of these is timed `--reps` times (after 20 untimed calls):

  world restore      RobotWorld.restore: mj_setState + mj_forward + the cached readings
  policy restore     the node's ~/restore, call -> response (the client's wall clock), and
                     the node's own figure for the engine's restore (response.latency_us)
  world + policy     both back to back, as EpisodeRunner.branch does before a branch
  engine restore     PolicyEngine.restore in this process (the same G1 configuration, a
                     second node that is never spun; no ROS in the timed call)
  episode reset      RobotWorld.reset (the initial state + one period at the default angles)
                     + the node's ~/reset_episode, call -> response

Identity check: two 50-step branches from the restored snapshot give the same actions and
world states, bit for bit. Needs the sourced install (tools/env.sh) and the G1 assets:

    python -m benchmarks.g1_reset [--robot-dir ../shared/robots/unitree_g1] [--reps 200]

Writes <out>.json and <out>.md (default benchmarks/results/<date>-cpu-g1-reset).
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import mujoco
import numpy as np
import rclpy
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.parameter import Parameter
import torch

from flashrt_ros.client import PolicyClient, spin_in_thread
from flashrt_ros.harness.episode_runner import (declare_parameters, EpisodeRunner,
                                                make_world, POLICY_CAPSULE, WORLD_SNAPSHOT)
from flashrt_ros.harness.links import RobotLink
from flashrt_ros.node.policy_node import PolicyNode
from .environment import environment, ROOT
from .ros_e2e import _executable
from .timing import stats, wall

G1_YAML = ROOT / 'config' / 'g1.yaml'
WARMUP = 20
WALK = 500          # policy steps before the snapshot: 10 s at 50 Hz
ROWS = (('world_restore', 'world restore (RobotWorld.restore, in process)'),
        ('policy_restore_round_trip', 'policy restore: ~/restore round trip over ROS'),
        ('policy_restore_in_node', 'policy restore: engine restore inside the node'),
        ('world_and_policy_restore', 'world + policy restore (a branch point)'),
        ('engine_restore', 'engine restore in process (PolicyEngine.restore, no ROS)'),
        ('episode_reset', 'episode reset: RobotWorld.reset + ~/reset_episode round trip'))


def log(msg):
    print(msg, flush=True)


def _timed(fn, reps):
    return [wall(fn)[1] for _ in range(WARMUP + reps)][WARMUP:]


def measure(robot, reps, workdir):
    """The figures (microseconds), the identity checks and sizes, with a node process."""
    node_log = open(workdir / 'policy_node.log', 'w')
    proc = subprocess.Popen(
        [_executable(), '--ros-args', '--params-file', str(G1_YAML),
         '-p', f'policy_file:={robot / "motion.pt"}', '-p', 'device:=cpu',
         '-p', f'capsule_dir:={workdir / "node"}'], stdout=node_log, stderr=subprocess.STDOUT)
    rclpy.init(args=['--ros-args', '--params-file', str(G1_YAML),
                     '-p', f'mjcf_path:={robot / "scene.xml"}',
                     '-p', f'policy_file:={robot / "motion.pt"}', '-p', 'device:=cpu'])
    node = rclpy.create_node('flashrt_episode_runner')
    executor = spin_in_thread(node)
    local = None
    try:
        params = declare_parameters(node)
        world = make_world('mjcf', node, params)
        client = PolicyClient(node, '/flashrt_policy', timeout=60.0)
        link = RobotLink(node, '/flashrt_policy', timeout=60.0)
        link.wait_ready(client, timeout=120.0)
        runner = EpisodeRunner(world, client, log=log, link=link)
        log(f'walking {WALK} steps (10 s) through the node, then world + policy snapshot')
        runner.rollout(runner.reset(), WALK)
        runner.snapshot()
        out, checks = {}, []
        log(f'timing {reps} restores of each kind ({WARMUP} untimed first)')
        out['world_restore'] = _timed(lambda: world.restore(WORLD_SNAPSHOT), reps)
        served, both = [], []
        for i in range(WARMUP + reps):
            response, seconds = runner.policy_call('restore', name=POLICY_CAPSULE)
            served.append((seconds * 1e6, response.latency_us))
            t0 = time.perf_counter()
            world.restore(WORLD_SNAPSHOT)
            runner.policy_call('restore', name=POLICY_CAPSULE)
            both.append((time.perf_counter() - t0) * 1e6)
        out['policy_restore_round_trip'] = [s for s, _ in served[WARMUP:]]
        out['policy_restore_in_node'] = [n for _, n in served[WARMUP:]]
        out['world_and_policy_restore'] = both[WARMUP:]
        sizes = {'world_state_bytes': int(world.state_size * 8),
                 'policy_capsule_bytes': int(response.capsule.nbytes)}
        first = runner.branch(0, 50, push=0.0, noise_std=0.0)
        again = runner.branch(0, 50, push=0.0, noise_std=0.0)
        checks.append({'name': 'branch replay after the timed restores: actions and world '
                       'states identical (50 steps)', 'passed': first[:2] == again[:2]})
        # The engine in this process: the node's configuration, its own arena and capsule.
        local = PolicyNode('flashrt_policy', namespace='g1_reset_bench', parameter_overrides=[
            Parameter('capsule_dir', value=str(workdir / 'local'))])
        if local.trigger_configure() != TransitionCallbackReturn.SUCCESS or \
                local.trigger_activate() != TransitionCallbackReturn.SUCCESS:
            raise RuntimeError('the in-process policy node did not configure and activate')
        engine = local.engine
        for _ in range(WALK):       # the same number of steps; the state's bytes are its own
            engine.step(np.zeros(local.config['obs_dim'], dtype=np.float32))
        engine.snapshot('bench')
        out['engine_restore'] = _timed(lambda: engine.restore('bench'), reps)
        runner.reset_us = []
        for _ in range(WARMUP + reps):
            runner.reset()
        out['episode_reset'] = [w + p for w, p in runner.reset_us[WARMUP:]]
        sizes['engine_arena_bytes'] = int(engine.arena.storage.numel())
        return out, checks, sizes
    finally:
        if local is not None:
            local.destroy_node()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
        proc.kill()         # nothing of it is kept: its capsules are in a temporary directory
        proc.wait()
        node_log.close()


def render(results):
    env, sizes = results['environment'], results['sizes']
    modified = ' + uncommitted changes to ' + ', '.join(m[3:] for m in env['modified']) \
        if env['modified'] else ''
    lines = [f'# Unitree G1: world + policy reset latency ({env["device_name"]}, CPU)\n',
             f'{env["date"]}, {env["hostname"]}, torch {env["torch"]}, MuJoCo '
             f'{env["mujoco"]}, ROS 2 {env["ros_distro"]} (rclpy {env["rclpy"]}, '
             f'{env["rmw"]}), Python '
             f'{env["python"]}, {env["cpu_threads"]} torch threads, commit {env["git_head"]}'
             f'{modified}, load average '
             f'{env["load_average_1m"]:.1f} at start. Wall-clock microseconds over '
             f'{results["config"]["reps"]} repetitions after {WARMUP} untimed ones.\n',
             f'World: {sizes["world_state_bytes"]} bytes of MuJoCo state (the G1 12-dof '
             f'scene); policy: motion.pt (LSTM), a {sizes["policy_capsule_bytes"]}-byte capsule '
             f'(the arena of the in-process engine: {sizes["engine_arena_bytes"]} bytes); '
             'snapshot after 10 s of walking through the node.\n',
             '| what | p50 | p99 | max | mean |', '| --- | --- | --- | --- | --- |']
    for key, label in ROWS:
        s = results['figures'][key]
        lines.append(f'| {label} | {s["p50"]:.1f} | {s["p99"]:.1f} | {s["max"]:.1f} | '
                     f'{s["mean"]:.1f} |')
    lines.append('')
    lines += [f'- check: {c["name"]}: {"passed" if c["passed"] else "FAILED"}'
              for c in results['checks']]
    lines.append(f'\nCommand: `{results["config"]["command"]}`\n')
    return '\n'.join(lines)


def _git(*args):
    return subprocess.run(['git', *args], capture_output=True, text=True, cwd=ROOT).stdout


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--robot-dir', default=str(ROOT.parent / 'shared' / 'robots' / 'unitree_g1'),
                    help='folder with scene.xml and motion.pt')
    ap.add_argument('--reps', type=int, default=200)
    ap.add_argument('--out', default='', help='output path stem (.json and .md are written)')
    args = ap.parse_args(argv)
    robot = pathlib.Path(args.robot_dir).resolve()
    if not (robot / 'motion.pt').exists() or _executable() is None:
        log(f'needs {robot}/motion.pt and scene.xml, and the sourced install (tools/env.sh)')
        return 2
    env = environment(torch.device('cpu'), 'g1-reset')
    head = _git('rev-parse', 'HEAD').strip()
    # what the measured code holds beyond that commit (the install tree copies the checkout)
    env['modified'] = _git('status', '--porcelain', '--', 'flashrt_ros', 'config').splitlines()
    wheels = [d.metadata['Name'] for d in importlib.metadata.distributions()]
    distro = os.environ.get('ROS_DISTRO') or next(
        (n.split('-')[1] for n in wheels if re.fullmatch(r'ros-[a-z]+-rclpy', n or '')), '?')
    env.update(git_head=head, mujoco=mujoco.__version__, ros_distro=distro,
               rclpy=importlib.metadata.version('rclpy'),
               rmw=rclpy.get_rmw_implementation_identifier())
    out = pathlib.Path(args.out) if args.out else ROOT / 'benchmarks' / 'results' / (
        f'{datetime.date.today().isoformat()}-cpu-g1-reset')
    log(f'G1 reset latency: {robot}, {args.reps} repetitions, writing {out}.json/.md')
    with tempfile.TemporaryDirectory(prefix='frt-g1-reset-') as tmp:
        figures, checks, sizes = measure(robot, args.reps, pathlib.Path(tmp))
    command = 'python -m benchmarks.g1_reset' + (f' --reps {args.reps}' if args.reps != 200
                                                 else '')
    results = {'environment': env, 'config': {'reps': args.reps, 'warmup': WARMUP,
                                              'walk_steps': WALK, 'robot_dir': str(robot),
                                              'command': command},
               'sizes': sizes, 'figures': {k: stats(v) for k, v in figures.items()},
               'samples_us': figures, 'checks': checks}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix('.json').write_text(json.dumps(results, indent=1, default=str) + '\n')
    table = render(results)
    out.with_suffix('.md').write_text(table)
    log(table)
    return 0 if all(c['passed'] for c in checks) else 1


if __name__ == '__main__':
    sys.exit(main())
