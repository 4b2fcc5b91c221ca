"""The real `ros2 param` CLI against a policy node spinning in this process (issue 21, item 1):
list parameters describe and get as their true types, and `ros2 param set` of a numeric list
(sent as a double array, or a string when it mixes 0 and 0.5) lands.

The CLI comes from ../shared/ros-tools (installed by tools/bootstrap.sh where that folder
exists); it runs without a daemon, in this test run's ROS domain (conftest.py).
"""
import os
import subprocess

import pytest

from support.ros_tools import NEEDS_ROS2, ROS2

pytestmark = NEEDS_ROS2
rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')


def _param(*args):
    """`ros2 param ...` (no daemon: it finds the node itself); its exit status must be 0."""
    r = subprocess.run([ROS2, 'param', *args[:1], '--no-daemon', '--timeout', '30', *args[1:]],
                       env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f'ros2 param {args}: {r.returncode}\n{r.stdout}{r.stderr}'
    return r.stdout


def test_ros2_param_describe_get_and_set_of_list_parameters(make):
    h = make(start=False)
    node = '/' + h.name
    out = _param('describe', node, 'default_angles', 'session_names', 'actor_hidden_dims')
    types = [line.split(':', 1)[1].strip() for line in out.splitlines()
             if line.strip().startswith('Type:')]
    assert types == ['double array', 'string array', 'integer array'], out
    assert _param('get', node, 'joint_names').startswith('String values are:')
    for text, value in [('[0.1, 0.2, 0.3]', [0.1, 0.2, 0.3]), ('[0, 0.5, 1]', [0.0, 0.5, 1.0])]:
        assert 'Set parameter successful' in _param('set', node, 'default_angles', text)
        assert list(h.node.get_parameter('default_angles').value) == value
