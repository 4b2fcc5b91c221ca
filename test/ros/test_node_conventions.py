"""Smaller things a ROS user runs into (issue 21, item 9), each through the real node over Fast
DDS: an overwrite of episode_start keeps it pinned, a finalized node says it cannot be
activated again, an unwritable capsule_dir does not make the log lie about resets, and the
capsule directory follows ROS_HOME, and capsule stamps follow the node's clock (sim time under
use_sim_time)."""
import os

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytestmark = pytest.mark.ros

from rclpy.parameter import Parameter  # noqa: E402
from flashrt_ros.node.policy_node import PolicyNode  # noqa: E402
from support.common import obs, wait_for  # noqa: E402
from support.nodes import Harness, RECURRENT, SUCCESS  # noqa: E402


def _capsule(h, name):
    return next(c for c in h.call('list_capsules').capsules if c.name == name)


def test_overwriting_episode_start_keeps_it_pinned(ros, tmp_path):
    h = Harness(tmp_path, RECURRENT)
    try:
        assert _capsule(h, 'episode_start').pinned
        h.steps([obs(t) for t in range(3)])
        r = h.call('snapshot', name='episode_start', overwrite=True)
        assert r.success, r.message
        assert _capsule(h, 'episode_start').pinned      # was silently unpinned
        assert _capsule(h, 'episode_start').step == 3
        # a fork onto it replaces it the same way
        assert h.call('snapshot', name='other').success
        r = h.call('fork', source='other', target='episode_start', overwrite=True)
        assert r.success, r.message
        assert _capsule(h, 'episode_start').pinned
    finally:
        h.close()


def test_a_finalized_node_does_not_ask_to_be_activated(ros, tmp_path):
    h = Harness(tmp_path, RECURRENT)
    try:
        h.transition('deactivate')
        h.transition('shutdown')
        r = h.call('snapshot', name='late')
        assert not r.success
        assert 'finalized' in r.message and 'cannot be activated again' in r.message
        assert 'activate it before' not in r.message
    finally:
        h.close()


def test_an_unwritable_capsule_dir_keeps_episode_start_in_memory_and_says_so(ros, tmp_path):
    from rcl_interfaces.msg import Log
    blocked = tmp_path / 'a_file'
    blocked.write_text('not a directory')           # capsule_dir below a file: unwritable
    h = Harness(tmp_path, dict(RECURRENT, capsule_dir=str(blocked / 'capsules'),
                               checkpoint_to_disk=True), start=False)
    logs = []
    h.client_node.create_subscription(Log, '/rosout', logs.append, 100)
    try:
        h.transition('configure')
        h.activate()
        mine = lambda: [m.msg for m in list(logs)  # noqa: E731
                        if m.name == h.name and 'episode_start' in m.msg and m.level >= 30]
        wait_for(mine, what='the warning about episode_start on /rosout')
        assert all('initial state' not in w for w in mine()), mine()
        assert any('kept in memory' in w for w in mine()), mine()
        # and reset_episode does use it
        assert _capsule(h, 'episode_start').pinned
        assert h.call('reset_episode').success
    finally:
        h.close()


def test_the_default_capsule_dir_is_under_ros_home(ros, tmp_path, monkeypatch):
    monkeypatch.setenv('ROS_HOME', str(tmp_path / 'ros_home'))
    node = PolicyNode(f'conventions_{os.getpid()}', parameter_overrides=[
        Parameter(k, value=v) for k, v in dict(RECURRENT, device='cpu').items()])
    try:
        assert node.trigger_configure() == SUCCESS
        assert node.settings.capsule_dir == str(
            tmp_path / 'ros_home' / 'flashrt_capsules' / node.get_name())
    finally:
        node.destroy_node()


def test_capsule_stamps_are_sim_time_under_use_sim_time(ros, tmp_path):
    from rosgraph_msgs.msg import Clock
    h = Harness(tmp_path, dict(RECURRENT, use_sim_time=True))
    clock = h.client_node.create_publisher(Clock, '/clock', 10)
    try:
        sim = Clock()
        sim.clock.sec, sim.clock.nanosec = 1234, 500_000_000

        def node_time_is_sim():
            clock.publish(sim)      # the node may match the publisher after the first one
            return h.node.get_clock().now().nanoseconds == 1_234_500_000_000
        wait_for(node_time_is_sim, what="the node's clock on /clock")
        r = h.call('snapshot', name='at_sim_time')
        assert r.success, r.message
        stamp = _capsule(h, 'at_sim_time').stamp
        assert (stamp.sec, stamp.nanosec) == (1234, 500_000_000)    # was wall time
    finally:
        h.close()
