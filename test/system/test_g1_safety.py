"""The safety supervisor on the Unitree G1 in MuJoCo (../shared): the policy node in its own
process (config/g1.yaml), the world in this process, stepped in lock-step through RobotLink.
A hard sideways push topples the walking robot; with `safety: [tilt:hold]` the command that
answers the first reading past the tilt limit is already the supervisor's (the last safe
targets), within one control period, and so is every one after it; the trip is counted in
~/status and its capsule kept."""
import math
import pathlib
import signal
import subprocess

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy', reason='needs rclpy (ROS 2 Jazzy): run tools/test.sh')
from flashrt_ros.client import PolicyClient, spin_in_thread  # noqa: E402
from flashrt_ros.harness.links import RobotLink  # noqa: E402
from flashrt_ros.sim.robot_world import load_upstream_config, upstream_world  # noqa: E402
from support.common import wait_for  # noqa: E402
from support.ros_tools import installed_executable  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROBOT = ROOT.parent / 'shared' / 'robots' / 'unitree_g1'
pytestmark = pytest.mark.skipif(not (ROBOT / 'motion.pt').exists(),
                                reason=f'needs the Unitree G1 assets in {ROBOT} (../shared, '
                                'absent in a fresh clone)')
PUSH_AT, STEPS, MAX_TILT = 100, 250, 0.5


def _walk(tmp_path, tag, *policy_args):
    """The G1 walks STEPS policy steps, pushed sideways by 3 m/s at step PUSH_AT: per step the
    tilt of the readings sent and the targets that came back; and the node's last status."""
    log = open(tmp_path / f'{tag}.log', 'w')
    policy = subprocess.Popen([
        installed_executable('policy_node'), '--ros-args', '--params-file',
        str(ROOT / 'config' / 'g1.yaml'), '-p', f'policy_file:={ROBOT / "motion.pt"}',
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
        policy.send_signal(signal.SIGINT)     # a clean exit: no endpoints left for the next
        try:
            policy.wait(timeout=30)
        except subprocess.TimeoutExpired:
            policy.kill()
            policy.wait()
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
