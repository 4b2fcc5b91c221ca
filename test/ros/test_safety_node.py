"""The safety supervisor inside a running policy node (config/g1.yaml, the G1's motion.pt from
../shared), over real topics, control_mode timer: readings that stop coming trip the stale
detector, and the node then publishes the held targets every tick; ~/status counts the trip,
~/safety_event reports it, /diagnostics carries it as an ERROR; ~/reset_episode ends the hold
(and, the readings still stale, the next tick trips again)."""
import threading

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from sensor_msgs.msg import Imu, JointState  # noqa: E402
from std_msgs.msg import Float64MultiArray  # noqa: E402

from flashrt_ros.client import PolicyClient, spin_in_thread  # noqa: E402
from flashrt_ros.msg import SafetyEvent  # noqa: E402
from flashrt_ros.node.policy_node import PolicyNode  # noqa: E402
from support.common import wait_for  # noqa: E402
from support.robots import G1 as ROBOT, G1_YAML, NEEDS_G1  # noqa: E402

pytestmark = [pytest.mark.ros, NEEDS_G1]


class _Topics:
    def __init__(self, node, name):
        self.cond = threading.Condition()
        self.commands, self.events, self.diagnostics = [], [], []
        for msg_type, topic, into in ((Float64MultiArray, f'{name}/joint_commands',
                                       self.commands),
                                      (SafetyEvent, f'{name}/safety_event', self.events),
                                      (DiagnosticArray, '/diagnostics', self.diagnostics)):
            node.create_subscription(msg_type, topic,
                                     lambda m, into=into: self._on(into, m), 100)

    def _on(self, into, msg):
        with self.cond:
            into.append(msg)
            self.cond.notify_all()


def test_stale_readings_trip_the_supervisor_and_the_targets_are_held(ros, tmp_path):
    name = '/flashrt_policy'
    node = PolicyNode('flashrt_policy', cli_args=[
        '--ros-args', '--params-file', str(G1_YAML),
        '-p', f'policy_file:={ROBOT / "motion.pt"}', '-p', 'device:=cpu',
        '-p', f'capsule_dir:={tmp_path}', '-p', 'control_mode:=timer',
        '-p', 'max_input_age:=0.2', '-p', 'status_period:=0.1',
        '-p', "safety:=['stale:hold']"])
    robot = rclpy.create_node('stale_robot')
    topics = _Topics(robot, name)
    joints_pub = robot.create_publisher(JointState, 'joint_states', 10)
    imu_pub = robot.create_publisher(Imu, 'imu', 10)
    spinner = spin_in_thread(node, robot)
    client = PolicyClient(robot, name, timeout=20.0)
    try:
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert node.trigger_activate() == TransitionCallbackReturn.SUCCESS
        joints = list(node.get_parameter('joint_names').value)
        js = JointState(name=joints, position=list(node.get_parameter('default_angles').value),
                        velocity=[0.0] * len(joints))
        imu = Imu()
        imu.orientation.w = 1.0
        wait_for(lambda: joints_pub.get_subscription_count() and imu_pub.get_subscription_count(),
                 what='the node subscribed')
        for _ in range(5):          # fresh readings for a few ticks, then none
            joints_pub.publish(js)
            imu_pub.publish(imu)
            with topics.cond:
                n = len(topics.commands)
                topics.cond.wait_for(lambda: len(topics.commands) > n, 5.0)
        with topics.cond:
            assert topics.cond.wait_for(lambda: topics.events, 10.0), 'no safety event'
            first = len(topics.commands)
            assert topics.cond.wait_for(lambda: len(topics.commands) >= first + 5, 10.0)
            held = [np.array(c.data) for c in topics.commands[first - 1:first + 5]]
        event = topics.events[0]
        assert event.detector == 'stale' and event.response == 'hold', event
        assert all(np.array_equal(h, held[0]) for h in held), 'targets not held'
        wait_for(lambda: client.last_status is not None and client.last_status.safety_trips == 1
                 and len(client.last_status.safety_holding) == 1, what='the trip in ~/status')
        wait_for(lambda: any(s.level == DiagnosticStatus.ERROR and 'safety' in s.message
                             for a in topics.diagnostics for s in a.status),
                 what='the trip as a diagnostics ERROR')
        # a reset ends the hold; the readings are still stale, so the next tick trips again
        assert client.call('reset_episode')[0].success
        wait_for(lambda: client.last_status.safety_trips == 2, what='a second trip after reset')
    finally:
        spinner.shutdown()
        node.destroy_node()
        robot.destroy_node()
