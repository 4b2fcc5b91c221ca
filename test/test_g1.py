"""A Unitree G1 walks in MuJoCo through the policy node: node and world in separate processes,
over ROS (Fast DDS), with the real upstream model and pretrained policy (../shared/robots)."""
import math
import os
import pathlib
import signal
import subprocess
import time

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy', reason='needs rclpy (ROS 2 Jazzy): run tools/test.sh')
import torch  # noqa: E402
from geometry_msgs.msg import PoseStamped  # noqa: E402
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402
from sensor_msgs.msg import Imu, JointState  # noqa: E402
from std_msgs.msg import Float32MultiArray  # noqa: E402
from std_srvs.srv import Trigger  # noqa: E402

from flashrt_ros.client import spin_in_thread  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROBOT = ROOT.parent / 'shared' / 'robots' / 'unitree_g1'
pytestmark = pytest.mark.skipif(not (ROBOT / 'motion.pt').exists(),
                                reason=f'needs the Unitree G1 assets in {ROBOT} (../shared, '
                                'absent in a fresh clone)')
DEFAULT = np.array([-0.1, 0.0, 0.0, 0.3, -0.2, 0.0, -0.1, 0.0, 0.0, 0.3, -0.2, 0.0])


def _executable(name):
    prefix = next(p for p in os.environ['AMENT_PREFIX_PATH'].split(os.pathsep)
                  if (pathlib.Path(p) / 'lib' / 'flashrt_ros' / name).exists())
    return str(pathlib.Path(prefix) / 'lib' / 'flashrt_ros' / name)


def _start(name, args, log):
    cmd = [_executable(name), '--ros-args', '--params-file', str(ROOT / 'config' / 'g1.yaml'),
           *args]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def reference_observation(k, joint_state, imu, last_action):
    """The G1 policy's observation, written out from unitree_rl_gym's deploy loop."""
    names, q, dq = joint_state
    (x, y, z, w), omega = imu
    gravity = [2 * (-z * x + w * y), -2 * (z * y + w * x), 1 - 2 * (w * w + z * z)]
    phase = ((k + 1) * 0.02) % 0.8 / 0.8
    obs = np.zeros(47, dtype=np.float32)
    obs[0:3] = np.asarray(omega) * 0.25
    obs[3:6] = gravity
    obs[6:9] = np.array([0.5, 0.0, 0.0]) * np.array([2.0, 2.0, 0.25])
    obs[9:21] = (np.asarray(q) - DEFAULT) * 1.0
    obs[21:33] = np.asarray(dq) * 0.05
    obs[33:45] = last_action
    obs[45:47] = [math.sin(2 * math.pi * phase), math.cos(2 * math.pi * phase)]
    return obs


def test_g1_walks_through_the_node_bit_for_bit(tmp_path):
    log = open(tmp_path / 'nodes.log', 'w')
    # no re-sends: the loop starts when this test calls ~/reset, once everyone is connected
    sim = _start('sim_node', ['-p', f'mjcf_path:={ROBOT / "scene.xml"}',
                              '-p', 'republish_period:=0.0', '-r', '__node:=flashrt_sim'], log)
    policy = _start('policy_node', [
        '-p', f'policy_file:={ROBOT / "motion.pt"}', '-p', 'device:=cpu',
        '-p', f'capsule_dir:={tmp_path / "capsules"}',
        '-r', '~/joint_states:=/flashrt_sim/joint_states', '-r', '~/imu:=/flashrt_sim/imu',
        '-r', '~/joint_commands:=/flashrt_sim/joint_commands'], log)
    rclpy.init()
    node = rclpy.create_node('g1_recorder')
    qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=5000,
                     reliability=ReliabilityPolicy.RELIABLE)
    joints, imus, poses, actions = {}, {}, {}, []

    def stamp(msg):
        return msg.header.stamp.sec * 10 ** 9 + msg.header.stamp.nanosec

    # republished readings carry the same stamp: keyed by stamp, the first copy kept
    node.create_subscription(JointState, '/flashrt_sim/joint_states', lambda m: joints.setdefault(
        stamp(m), (list(m.name), np.array(m.position), np.array(m.velocity))), qos)
    node.create_subscription(Imu, '/flashrt_sim/imu', lambda m: imus.setdefault(stamp(m), (
        (m.orientation.x, m.orientation.y, m.orientation.z, m.orientation.w),
        (m.angular_velocity.x, m.angular_velocity.y, m.angular_velocity.z))), qos)
    node.create_subscription(PoseStamped, '/flashrt_sim/base_pose', lambda m: poses.setdefault(
        stamp(m), (m.pose.position.x, m.pose.position.y, m.pose.position.z)), qos)
    node.create_subscription(Float32MultiArray, '/flashrt_policy/action',
                             lambda m: actions.append(np.array(m.data, dtype=np.float32)), qos)
    executor = spin_in_thread(node)
    reset = node.create_client(Trigger, '/flashrt_sim/reset')
    try:
        # every endpoint matched before the first reading, so no message is missed
        deadline = time.monotonic() + 120
        while not (node.count_subscribers('/flashrt_sim/joint_states') >= 2
                   and node.count_subscribers('/flashrt_sim/imu') >= 2
                   and node.count_publishers('/flashrt_sim/joint_commands') >= 1
                   and node.count_publishers('/flashrt_policy/action') >= 1
                   and reset.service_is_ready()):
            assert time.monotonic() < deadline, 'nodes did not come up; see nodes.log'
            assert sim.poll() is None and policy.poll() is None, 'a node exited; see nodes.log'
            time.sleep(0.1)
        time.sleep(1.0)     # the graph shows endpoints slightly before data flows to them
        assert reset.call_async(Trigger.Request()) is not None
        deadline = time.monotonic() + 240
        while (not poses or max(poses) < 20.0e9) and time.monotonic() < deadline:
            assert sim.poll() is None and policy.poll() is None, 'a node exited; see nodes.log'
            time.sleep(0.05)
        assert poses and max(poses) >= 20.0e9, f'the walk did not reach 20 s ({len(poses)})'
        policy.send_signal(signal.SIGINT)       # the lock-step loop stops with the policy
        policy.wait(timeout=30)
        time.sleep(0.5)
    finally:
        for proc in (sim, policy):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    stamps = sorted(joints)
    xyz = np.array([poses[s] for s in stamps if s in poses])
    distance, low = xyz[-1, 0] - xyz[0, 0], xyz[:, 2].min()
    print(f'G1 through the node: {len(actions)} policy steps, {stamps[-1] / 1e9:.2f} s, '
          f'{distance:.3f} m forward, pelvis min {low:.4f} m')
    if os.environ.get('FLASHRT_G1_LOG'):     # for scripts/plot_walk.py --log (README picture)
        with open(os.environ['FLASHRT_G1_LOG'], 'w') as f:
            f.write('time,x,y,z\n')
            f.writelines(f'{s / 1e9},{x},{y},{z}\n' for s, (x, y, z) in sorted(poses.items()))
    assert low > 0.5 and distance >= 8.0
    # every published action equals motion.pt run directly on the world's readings
    reference = torch.jit.load(str(ROBOT / 'motion.pt'))
    last = np.zeros(12, dtype=np.float32)
    assert len(actions) >= 1000
    for k, action in enumerate(actions):
        obs = reference_observation(k, joints[stamps[k]], imus[stamps[k]], last)
        with torch.no_grad():
            expected = reference(torch.from_numpy(obs).unsqueeze(0)).numpy().reshape(-1)
        assert np.array_equal(action, expected), \
            f'step {k}: max abs diff {np.abs(action - expected).max()}'
        last = expected
