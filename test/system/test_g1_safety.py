"""The safety supervisor on the Unitree G1 in MuJoCo (../shared): the policy node in its own
process (config/g1.yaml), the world in this process, stepped in lock-step through RobotLink.
A hard sideways push topples the walking robot; with `safety: [tilt:hold]` the command that
answers the first reading past the tilt limit is already the supervisor's (the last safe
targets), within one control period, and so is every one after it; the trip is counted in
~/status and its capsule kept."""
import math
import os
import subprocess

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy', reason='needs rclpy (ROS 2 Jazzy): run tools/test.sh')
from flashrt_ros.client import PolicyClient, spin_in_thread  # noqa: E402
from flashrt_ros.harness.links import RobotLink  # noqa: E402
from flashrt_ros.sim.robot_world import load_upstream_config, upstream_world  # noqa: E402
from support.common import wait_for  # noqa: E402
from support.robots import G1 as ROBOT, G1_YAML, NEEDS_G1  # noqa: E402
from support.ros_tools import installed_executable, stop_gently  # noqa: E402

pytestmark = NEEDS_G1
PUSH_AT, STEPS, MAX_TILT = 100, 250, 0.5


def _walk(tmp_path, tag, *policy_args):
    """The G1 walks STEPS policy steps, pushed sideways by 3 m/s at step PUSH_AT: per step the
    tilt of the readings sent and the targets that came back; and the node's last status."""
    log = open(tmp_path / f'{tag}.log', 'w')
    policy = subprocess.Popen([
        installed_executable('policy_node'), '--ros-args', '--params-file',
        str(G1_YAML), '-p', f'policy_file:={ROBOT / "motion.pt"}',
        '-p', 'device:=cpu', '-p', f'capsule_dir:={tmp_path / tag}', '-p', 'status_period:=0.2',
        *policy_args], stdout=log,
        stderr=subprocess.STDOUT)
    rclpy.init()
    node = rclpy.create_node(f'g1_safety_{tag}')
    spinner = spin_in_thread(node)
    name = '/flashrt_policy'
    try:
        client = PolicyClient(node, name, timeout=60.0)
        link = RobotLink(node, name, timeout=60.0)
        link.wait_ready(client, timeout=120.0)
        world = upstream_world(ROBOT / 'scene.xml', load_upstream_config(
            ROBOT / 'deploy_mujoco_g1.yaml'))
        obs, tilts, targets, heights = world.reset(0), [], [], []
        for k in range(STEPS):
            if k == PUSH_AT:
                world.perturb([0.0, 3.0, 0.0])
            w, x, y, z = world.imu()[0]
            tilts.append(math.acos(max(-1.0, min(1.0, 1.0 - 2.0 * (x * x + y * y)))))
            _, command = link(world, obs)
            targets.append(np.asarray(command))
            heights.append(float(world.base_position()[2]))
            obs, _ = world.step(command)
        for _ in range(2):      # a status made after the last step (one may be on its way)
            seen = client.last_status
            wait_for(lambda: client.last_status is not seen, timeout=30.0,
                     what='a status after the walk')
        return np.array(tilts), targets, heights, client.last_status
    finally:
        stop_gently(policy)     # a clean exit: no endpoints left for the next walk's node
        spinner.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()


def test_g1_tilt_trip_acts_within_one_control_period(tmp_path):
    tilts, _, heights, status = _walk(tmp_path, 'plain')
    assert tilts[:PUSH_AT].max() < MAX_TILT, 'tilted before the push'
    assert tilts.max() > MAX_TILT and min(heights) < 0.5, 'the push did not topple it'
    assert status.safety_trips == 0
    tilts, targets, _, status = _walk(tmp_path, 'safe', '-p', "safety:=['tilt:hold']",
                                      '-p', f'safety_max_tilt:={MAX_TILT}')
    first = int(np.argmax(tilts > MAX_TILT))
    assert first > PUSH_AT, 'no reading past the limit'
    assert not np.array_equal(targets[first - 1], targets[first - 2]), 'not walking before'
    # the answer to the first reading past the limit holds the last safe targets, and so
    # does every answer after it
    for k in range(first, STEPS):
        assert np.array_equal(targets[k], targets[first - 1]), f'step {k} not held'
    assert status.safety_trips == 1 and len(status.safety_holding) == 1
    print(f'G1 push: first reading past {MAX_TILT} rad at step {first} '
          f'(tilt {tilts[first]:.3f}); held from that step on; trips {status.safety_trips}')


def _pushed_walk(tmp_path, tag, *policy_args):
    """The flashrt_sim G1 (paused lock-step, following the policy node's rollbacks) and the
    policy node, each in its own process: 100 steps of walking, a 3 m/s sideways push through
    SetEntityState, 200 more steps. Returns (pelvis heights after the push, every 10 steps,
    the safety events). With FLASHRT_PUSH_LOG=<prefix>, every step's time, pelvis height, tilt
    and trips so far go to <prefix>.<tag>.csv."""
    from flashrt_ros.msg import SafetyEvent
    from support.sim_driver import SimDriver
    log = open(tmp_path / f'{tag}.log', 'w')
    g1 = ['--params-file', str(G1_YAML)]
    sim = subprocess.Popen([
        installed_executable('sim_node'), '--ros-args', *g1,
        '-p', f'mjcf_path:={ROBOT / "scene.xml"}', '-p', 'lockstep:=steps',
        '-p', 'follow_rollbacks:=/flashrt_policy', '-r', '__node:=flashrt_sim'],
        stdout=log, stderr=subprocess.STDOUT)
    policy = subprocess.Popen([
        installed_executable('policy_node'), '--ros-args', *g1,
        '-p', f'policy_file:={ROBOT / "motion.pt"}', '-p', 'device:=cpu',
        '-p', f'capsule_dir:={tmp_path / tag}', '-r', 'joint_states:=/flashrt_sim/joint_states',
        '-r', 'imu:=/flashrt_sim/imu', '-r', '~/joint_commands:=/flashrt_sim/joint_commands',
        *policy_args], stdout=log, stderr=subprocess.STDOUT)
    rclpy.init()
    driver = SimDriver()
    events = []
    watch = driver.node.create_subscription(SafetyEvent, '/flashrt_policy/safety_event',
                                            events.append, 10)
    heights, rows = [], []
    chunk = 1 if os.environ.get('FLASHRT_PUSH_LOG') else 10     # per step for the plot
    try:
        if any('safety:=' in a for a in policy_args):
            # an event published before this subscription matched would reach nobody (the
            # walk can trip within a second of its start): matched first
            wait_for(lambda: watch.get_publisher_count() > 0, 120.0,
                     what="the policy node's ~/safety_event")
        for k in range(0, 300, chunk):
            if k == 100:
                driver.push('pelvis', dy=3.0)
            driver.simulate(chunk)
            pelvis = driver.entity('pelvis')
            o, stamp = pelvis.pose.orientation, pelvis.header.stamp
            rows.append((stamp.sec + stamp.nanosec * 1e-9, pelvis.pose.position.z,
                         math.acos(max(-1.0, min(1.0, 1.0 - 2.0 * (o.x * o.x + o.y * o.y)))),
                         len(events)))
            if k >= 100:
                heights.append(pelvis.pose.position.z)
        if os.environ.get('FLASHRT_PUSH_LOG'):      # scripts/plot_push.py (README picture)
            with open(f'{os.environ["FLASHRT_PUSH_LOG"]}.{tag}.csv', 'w') as f:
                f.write('time,z,tilt,trips\n')
                f.writelines(f'{t},{z},{a},{n}\n' for t, z, a, n in rows)
        return heights, events
    finally:
        for proc in (policy, sim):
            stop_gently(proc)
        driver.close()
        rclpy.try_shutdown()


def test_g1_world_and_policy_rollback_recovers_from_a_push(tmp_path):
    """In simulation the rollback takes world and policy back together: the push that topples
    the G1 without the supervisor is undone by `tilt:rollback` (the world follows the policy
    node's ~/safety_event), and the robot walks on."""
    plain, events = _pushed_walk(tmp_path, 'plain')
    assert min(plain) < 0.5 and not events, f'without the supervisor it falls: {plain}'
    safe, events = _pushed_walk(tmp_path, 'safe', '-p', "safety:=['tilt:rollback']",
                                '-p', f'safety_max_tilt:={MAX_TILT}',
                                '-p', 'safety_safe_every:=10')
    assert events and all(e.response == 'rollback' for e in events), events
    assert min(safe) > 0.6, f'with world + policy rollback it walks on: {safe}'
    print(f'G1 push with rollback: {len(events)} rollbacks ('
          f'{", ".join(e.restored_capsule for e in events)}); pelvis min {min(safe):.3f} m; '
          f'without: min {min(plain):.3f} m')
