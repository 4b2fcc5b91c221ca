"""A policy node configured from a policy bundle alone (policy_bundle, no observation
parameters): the real unitree_rl_lab G1 bundle (Isaac Lab deploy.yaml + policy.onnx) over
real topics. Its policy input equals Isaac Lab's per-term history (test/support/isaaclab.py,
written from Isaac Lab's semantics) bit for bit and its actions equal onnxruntime's on that
input; an override is named in the log; a broken bundle fails configure naming the field."""
import threading

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
from geometry_msgs.msg import Twist  # noqa: E402
from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from sensor_msgs.msg import Imu, JointState  # noqa: E402
from std_msgs.msg import Float32MultiArray  # noqa: E402

from flashrt_ros.client import spin_in_thread  # noqa: E402
from flashrt_ros.messages import sim_stamp  # noqa: E402
from flashrt_ros.node.policy_node import PolicyNode  # noqa: E402
from support.common import wait_for  # noqa: E402
from support.isaaclab import BUNDLE, deploy, IsaacLabReference, ONNX, readings  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.skipif(
    not ONNX.exists(), reason=f'needs the unitree_rl_lab G1 bundle in {BUNDLE} (../shared, '
    'absent in a fresh clone)')]


class _Rig:
    """The node under test and a robot-side node: joint_states, imu, cmd_vel out, ~/action in."""

    def __init__(self, name, tmp_path, **params):
        params = {'policy_bundle': str(BUNDLE), 'device': 'cpu',
                  'capsule_dir': str(tmp_path), **params}
        self.node = PolicyNode(name, parameter_overrides=[
            Parameter(k, value=v) for k, v in params.items()])
        self.robot = rclpy.create_node(f'{name}_robot')
        self.joints = self.robot.create_publisher(JointState, 'joint_states', 10)
        self.imu = self.robot.create_publisher(Imu, 'imu', 10)
        self.cmd = self.robot.create_publisher(Twist, 'cmd_vel', 10)
        self.actions, self.cond = [], threading.Condition()
        self.robot.create_subscription(Float32MultiArray, f'/{name}/action', self._on, 10)
        self.spinner = spin_in_thread(self.node, self.robot)

    def _on(self, msg):
        with self.cond:
            self.actions.append(np.array(msg.data, dtype=np.float32))
            self.cond.notify_all()

    def close(self):
        self.spinner.shutdown()
        self.node.destroy_node()
        self.robot.destroy_node()


@pytest.fixture
def rig(ros, tmp_path):
    made = []

    def make(name='flashrt_bundle', **params):
        made.append(_Rig(name, tmp_path, **params))
        return made[-1]
    yield make
    for r in made:
        r.close()


def test_isaaclab_bundle_alone_equals_isaac_lab_and_onnxruntime(rig):
    import onnxruntime
    r = rig()
    assert r.node.trigger_configure() == TransitionCallbackReturn.SUCCESS
    assert r.node.trigger_activate() == TransitionCallbackReturn.SUCCESS
    cfg = deploy()
    ids = cfg['joint_ids_map']
    names = [f'joint_{ids[i]}' for i in range(29)]      # the bundle's stand-in names
    assert r.node.get_parameter('joint_names').value == names
    session = onnxruntime.InferenceSession(str(ONNX), providers=['CPUExecutionProvider'])
    reference, last = IsaacLabReference(cfg), np.zeros(29, np.float32)
    command = readings()[0][2]       # one velocity command for the whole run
    twist = Twist()
    twist.linear.x, twist.linear.y, twist.angular.z = (float(v) for v in command)
    r.cmd.publish(twist)
    wait_for(lambda: 'command' in r.node.parts.robot.sessions[0].inputs,
             what='the velocity command at the node')
    worst = 0.0
    for k, ((_, q, dq), (xyzw, omega), _) in enumerate(readings()):
        stamp = sim_stamp(0.02 * (k + 1))
        js = JointState(name=list(reversed(names)), position=[float(v) for v in q[::-1]],
                        velocity=[float(v) for v in dq[::-1]])     # by name, any order
        js.header.stamp = stamp
        imu = Imu()
        imu.header.stamp = stamp
        o, w = imu.orientation, imu.angular_velocity
        o.x, o.y, o.z, o.w = (float(v) for v in xyzw)
        w.x, w.y, w.z = (float(v) for v in omega)
        r.imu.publish(imu)
        r.joints.publish(js)
        with r.cond:
            assert r.cond.wait_for(lambda: len(r.actions) > k, 10.0), f'no action {k}'
            action = r.actions[k]
        want = reference(((None, q, dq), (xyzw, omega), command), last)
        got = r.node.parts.engine.arena.session_views[0]['term_history'].numpy()
        assert np.array_equal(got, want), f'step {k}: policy input differs'
        ort = session.run(None, {'obs': want[None]})[0][0]
        worst = max(worst, float(np.abs(action - ort).max()))
        last = action
    print(f'node from the bundle vs onnxruntime over {k + 1} steps: max |diff| {worst:.3g}')
    assert worst <= 1e-5 * max(1.0, float(np.abs(last).max()))


def test_parameters_the_user_set_override_the_bundle(rig):
    """Set on the command line (initial_command, robot_joint_names) or with set_parameters
    after start (a term scale): the user's values stay, the rest comes from the bundle."""
    r = rig('flashrt_bundle_override', initial_command=[0.4, 0.0, 0.0],
            robot_joint_names=[f'motor_{i}' for i in range(29)])
    assert r.node.trigger_configure() == TransitionCallbackReturn.SUCCESS
    ids = deploy()['joint_ids_map']
    assert r.node.get_parameter('joint_names').value == [f'motor_{ids[i]}' for i in range(29)]
    assert r.node.get_parameter('obs_dim').value == 96
    # set after start, before configure: the user's value too
    r.node.trigger_cleanup()
    r.node.set_parameters([Parameter('observation.joint_vel_rel.scale', value=[0.1])])
    assert r.node.trigger_configure() == TransitionCallbackReturn.SUCCESS
    assert list(r.node.get_parameter('observation.joint_vel_rel.scale').value) == [0.1]
    assert list(r.node.get_parameter('initial_command').value) == [0.4, 0.0, 0.0]


def test_a_broken_bundle_fails_configure(rig, tmp_path):
    """A term this package does not know: configure fails and builds nothing (the loader's
    refusal names the field: test/unit/test_bundles.py)."""
    import shutil
    import yaml
    run = tmp_path / 'run'
    shutil.copytree(BUNDLE, run)
    cfg = deploy()
    cfg['observations']['height_scan'] = {'scale': [1.0], 'history_length': 1}
    cfg.pop('actions')['JointPositionAction']['joint_ids'] = None
    cfg['actions'] = {'JointPositionAction': {'scale': [0.25], 'offset': None, 'clip': None}}
    (run / 'params' / 'deploy.yaml').write_text(yaml.safe_dump(cfg))
    r = rig('flashrt_bundle_broken', policy_bundle=str(run))
    assert r.node.trigger_configure() == TransitionCallbackReturn.FAILURE
    assert r.node.parts is None
