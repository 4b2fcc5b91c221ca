"""The `flashrt_sim` node in 'mjcf' mode (flashrt_ros/sim/sim_node.py) with the Unitree G1,
in-process over rclpy: the policy loop closed over ROS topics walks as RobotWorld does in
process (test/unit/test_robot_world.py), bit for bit. Needs the G1 assets (the `g1` fixture,
test/conftest.py) and rclpy; skips with the reason without them.
"""
import threading

import numpy as np
import pytest

mujoco = pytest.importorskip('mujoco', reason='mujoco missing: '
                             'pip install -r requirements/runtime.txt')

from flashrt_ros.sim.robot_world import upstream_world, UpstreamController  # noqa: E402
from support.common import wait_for  # noqa: E402


class _Latest:
    """Messages of one topic, with a wait for the n-th."""

    def __init__(self, node, msg_type, topic):
        self.msgs, self.cond = [], threading.Condition()
        node.create_subscription(msg_type, topic, self._on, 10)

    def _on(self, msg):
        with self.cond:
            self.msgs.append(msg)
            self.cond.notify_all()

    def wait(self, n, timeout=10.0):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.msgs) >= n, timeout), \
                f'{n} messages expected, {len(self.msgs)} came'
            return self.msgs[n - 1]


class _FromMessages:
    """What UpstreamController reads from a world, rebuilt from the published messages."""

    def __init__(self, js, imu, sim_dt):
        stamp = js.header.stamp
        self.steps = round((stamp.sec + stamp.nanosec * 1e-9) / sim_dt)
        self._js = (list(js.name), np.array(js.position), np.array(js.velocity),
                    np.array(js.effort))
        o, w, a = imu.orientation, imu.angular_velocity, imu.linear_acceleration
        self._imu = (np.array([o.w, o.x, o.y, o.z]), np.array([w.x, w.y, w.z]),
                     np.array([a.x, a.y, a.z]))

    def joint_state(self):
        return self._js

    def imu(self):
        return self._imu


@pytest.mark.ros
def test_sim_node_mjcf_mode_walks_over_topics(g1):
    """The policy loop closed over ROS topics: same walk as in process, bit for bit."""
    rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
    from geometry_msgs.msg import PoseStamped
    from rclpy.executors import SingleThreadedExecutor
    from rosgraph_msgs.msg import Clock
    from rclpy.parameter import Parameter
    from sensor_msgs.msg import Imu, JointState
    from std_msgs.msg import Float64MultiArray
    from std_srvs.srv import Trigger

    from flashrt_ros import srv as fsrv
    from flashrt_ros.sim.sim_node import make_sim_node

    cfg, periods = g1['cfg'], 60
    params = dict(world='mjcf', mjcf_path=str(g1['scene']),
                  kps=[int(k) for k in cfg['kps']],          # YAML integers are accepted
                  kds=cfg['kds'].astype(float).tolist(),
                  default_angles=cfg['default_angles'].astype(float).tolist(),
                  sim_dt=cfg['simulation_dt'], decimation=cfg['control_decimation'],
                  # the test counts readings: the self-heal republish (the same readings again
                  # after 0.5 s without a command) would add one when a period runs late under
                  # load (CI at 4bc69a4: every later reading compared one period off)
                  republish_period=0.0)
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    sim = make_sim_node('flashrt_sim_mjcf', context=ctx, parameter_overrides=[
        Parameter(k, value=v) for k, v in params.items()])
    node = rclpy.create_node('mjcf_test_client', context=ctx)
    executor = SingleThreadedExecutor(context=ctx)
    executor.add_node(sim)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        base = '/flashrt_sim_mjcf'
        js = _Latest(node, JointState, base + '/joint_states')
        imu = _Latest(node, Imu, base + '/imu')
        pose = _Latest(node, PoseStamped, base + '/base_pose')
        cmd = node.create_publisher(Float64MultiArray, base + '/joint_commands', 10)
        snapshot = node.create_client(fsrv.Snapshot, base + '/snapshot')
        restore = node.create_client(fsrv.Restore, base + '/restore')
        clock = _Latest(node, Clock, '/clock')
        pubs = (sim.robot.joint_pub, sim.robot.imu_pub, sim.robot.pose_pub, sim.clock_pub)
        wait_for(lambda: cmd.get_subscription_count() > 0 and all(
            pub.get_subscription_count() > 0 for pub in pubs), timeout=10.0,
            what='the sim node and the client to match')

        def call(client, name):
            assert client.wait_for_service(timeout_sec=10.0)
            request = client.srv_type.Request()
            request.name = name
            future = client.call_async(request)
            wait_for(future.done, timeout=10.0, what=f'{client.srv_name} to answer')
            return future.result()

        # Lock-step: the node's reset published nothing yet (no subscriber then); a restore of
        # a snapshot taken now publishes the start readings.
        assert call(snapshot, 'start').success
        assert call(restore, 'start').success
        n = 1
        world = upstream_world(g1['scene'], cfg)
        ours = UpstreamController(g1['policy'](), cfg)
        theirs = UpstreamController(g1['policy'](), cfg)
        for _ in range(periods):
            j, i, p = js.wait(n), imu.wait(n), pose.wait(n)
            assert j.header.stamp == i.header.stamp == p.header.stamp
            assert i.header.frame_id == 'pelvis' and p.header.frame_id == 'world'
            got = np.array([p.pose.position.x, p.pose.position.y, p.pose.position.z])
            assert got.tobytes() == world.base_position().tobytes()
            assert np.array(j.position).tobytes() == world.joint_state()[1].tobytes()
            targets = theirs(_FromMessages(j, i, cfg['simulation_dt']))
            world.step(ours(world))
            cmd.publish(Float64MultiArray(data=targets.astype(float).tolist()))
            n += 1
        pose.wait(n)
        assert pose.msgs[-1].pose.position.x > 0.2, 'the G1 did not walk forward over ROS'
        # A wrong-length command is refused (logged); the node carries on.
        cmd.publish(Float64MultiArray(data=[0.0] * 3))
        assert call(restore, 'start').success
        assert pose.wait(n + 1).pose.position.x == pose.msgs[0].pose.position.x
        assert sim.world.steps == cfg['control_decimation']
        # ~/step: one period holding the last targets, published like a command.
        step = node.create_client(Trigger, base + '/step')
        assert step.wait_for_service(timeout_sec=10.0)
        future = step.call_async(Trigger.Request())
        wait_for(future.done, timeout=10.0, what='~/step to answer')
        assert future.result().success
        stamp = js.wait(n + 2).header.stamp
        assert stamp.sec + stamp.nanosec * 1e-9 == pytest.approx(
            2 * cfg['control_decimation'] * cfg['simulation_dt'])
        # /clock carries the stamps of the readings, one per publication, in order
        clock.wait(n + 2)
        assert [c.clock for c in clock.msgs[:n + 2]] == [m.header.stamp for m in js.msgs[:n + 2]]
        with pytest.raises(ValueError, match="'mjcf' needs the parameters kps, kds"):
            make_sim_node('flashrt_sim_bad', context=ctx, parameter_overrides=[
                Parameter('world', value='mjcf'), Parameter('mjcf_path', value='x.xml'),
                Parameter('default_angles', value=[0.0])])
    finally:
        executor.shutdown()
        spinner.join(timeout=5.0)
        sim.destroy_node()
        node.destroy_node()
        rclpy.try_shutdown(context=ctx)


@pytest.mark.ros
def test_sim_node_world_from_a_policy_bundle(g1):
    """world 'mjcf' with policy_bundle (the unitree_rl_gym G1 folder) and mjcf_path only: joint
    order, PD gains, default angles, sim_dt and decimation come from the deploy file, as the
    hand-written config/g1.yaml has them; a parameter set by the user wins."""
    rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
    from rclpy.parameter import Parameter
    from flashrt_ros.sim.sim_node import make_sim_node
    folder, cfg = g1['scene'].parent, g1['cfg']
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    try:
        common = [Parameter('world', value='mjcf'),
                  Parameter('mjcf_path', value=str(folder / 'scene.xml')),
                  Parameter('policy_bundle', value=str(folder))]
        sim = make_sim_node('flashrt_sim_bundle', context=ctx, parameter_overrides=common)
        w = sim.world
        assert w.kps.tolist() == list(cfg['kps']) and w.kds.tolist() == list(cfg['kds'])
        assert w.default_angles.tolist() == list(cfg['default_angles'])
        assert (w.sim_dt, w.decimation) == (cfg['simulation_dt'], cfg['control_decimation'])
        assert w.joint_names[0] == 'left_hip_pitch_joint' and len(w.joint_names) == 12
        sim.destroy_node()
        sim = make_sim_node('flashrt_sim_bundle2', context=ctx, parameter_overrides=common + [
            Parameter('decimation', value=5)])
        assert sim.world.decimation == 5
        sim.destroy_node()
    finally:
        rclpy.try_shutdown(context=ctx)
