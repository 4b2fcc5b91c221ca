"""The node's joint commands as the stock ros2_controllers take them (issue 21, item 4).

The controllers are C++ and cannot run here, so their acceptance rules are transcribed below,
small, from their source: ros-controls/ros2_controllers, branch jazzy (4.x), each function
cited where it is transcribed. They judge the messages the node's own code builds
(RobotIO.publish_commands, which calls messages.command_message), with the node's clock and
the controller's clock set apart: sim time, wall time, latency.
"""
import numpy as np
import pytest

pytest.importorskip('rclpy', reason='ROS 2 missing: source tools/env.sh')

from flashrt_ros.messages import sim_stamp  # noqa: E402
from flashrt_ros.node.parameters import NodeConfig  # noqa: E402
from flashrt_ros.node.robot_io import RobotIO  # noqa: E402
from flashrt_ros.node.settings import Settings  # noqa: E402
from flashrt_ros.runtime.observation import JointTargets  # noqa: E402
from std_msgs.msg import Float64MultiArray  # noqa: E402
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint  # noqa: E402

JOINTS = ['hip', 'knee', 'ankle']
DEFAULT = [-0.1, 0.3, -0.2]
ACTION = np.array([0.4, -0.8, 1.2], dtype=np.float32)
RATE = 50.0                         # control_rate: T = 20 ms
T = 20_000_000                      # ns
WALL = 1_760_000_000.25             # a wall-clock now (s)
SIM = 12.34                         # a sim-time now (s), as /clock gives it
FLT_EPSILON = float(np.finfo(np.float32).eps)   # std::numeric_limits<float>::epsilon()


def ns(t):
    """rclcpp::Time / rclcpp::Duration of a builtin_interfaces message: integer nanoseconds."""
    return t.sec * 1_000_000_000 + t.nanosec


# -- forward_command_controller (position_controllers/JointGroupPositionController) ------------

def forward_command_controller(msg, joints, interface_name='position'):
    """{command interface: value} a ForwardCommandController writes for `msg` on ~/commands,
    None where it writes nothing.

    forward_command_controller/src/forward_command_controller.cpp,
    ForwardCommandController::read_parameters(): one command interface per joint,
    '<joint>/<interface_name>', in `joints` order (position_controllers'
    JointGroupPositionController sets interface_name 'position').
    forward_command_controller/src/forward_controllers_base.cpp,
    ForwardControllersBase::update(): data.size() != command_interfaces_.size() -> "command
    size (%zu) does not match number of interfaces (%zu)", return_type::ERROR, nothing
    written; else data[i] to interface i. The layout is never read."""
    interfaces = [f'{joint}/{interface_name}' for joint in joints]
    if len(msg.data) != len(interfaces):
        return None
    return dict(zip(interfaces, msg.data))


# -- joint_trajectory_controller -----------------------------------------------------------------

def jtc_refusal(traj, joints, now):
    """None where a JTC accepts `traj` arriving at controller time `now` (ns), else why not.

    joint_trajectory_controller/src/joint_trajectory_controller.cpp,
    JointTrajectoryController::validate_trajectory_msg(), with jazzy's defaults:
    allow_partial_joints_goal, allow_integration_in_goal_trajectories and
    allow_nonzero_velocity_at_trajectory_end false (the last one since jazzy, #834)."""
    names, points = list(traj.joint_names), list(traj.points)
    if len(names) != len(joints):
        return "Joints on incoming trajectory don't match the controller joints."
    if not names:
        return 'Empty joint names on incoming trajectory.'
    if not points:
        return 'Empty trajectory received.'
    # "If the starting time it set to 0.0, it means the controller should start it now.
    # Otherwise we check if the trajectory ends before the current time" (get_node()->now())
    start = ns(traj.header.stamp)
    if start != 0 and start + ns(points[-1].time_from_start) < now:
        return 'Received trajectory with non-zero start time that ends in the past'
    if any(name not in joints for name in names):
        return "Incoming joint doesn't match the controller's joints."
    if any(abs(v) > FLT_EPSILON for v in points[-1].velocities):
        return 'Velocity of last trajectory point is not zero'
    previous = 0
    for i, point in enumerate(points):
        if i > 0 and ns(point.time_from_start) <= previous:
            return 'Time between points is not strictly increasing'
        previous = ns(point.time_from_start)
        # validate_trajectory_point_field: positions required, the others empty or complete
        if len(point.positions) != len(names) or any(
                len(f) not in (0, len(names)) for f in (point.velocities, point.accelerations)):
            return 'Mismatch between joint_names size and a point field'
        if len(point.effort):
            return 'Trajectories with effort fields are currently not supported.'
    return None


def jtc_desired(traj, taken, state, t):
    """The desired positions a JTC samples at controller time t (ns) from a one-point `traj`
    it first sampled at `taken`, when the joints stood at `state`.

    joint_trajectory_controller/src/joint_trajectory_controller.cpp, update(): on the first
    sample, set_point_before_trajectory_msg(time, state_current_), the measured state (it
    writes the sample one controller cycle ahead, command_next_: the same curve).
    joint_trajectory_controller/src/trajectory.cpp, Trajectory::sample(): a zero stamp
    becomes the first sample's time; before the first point, interpolate_between_points
    from that state (positions only: the linear case); from the point on, the point itself,
    held ("whole animation has played out")."""
    start = ns(traj.header.stamp) or taken
    point = traj.points[0]
    arrival = start + ns(point.time_from_start)
    if t < arrival:
        fraction = (t - taken) / (arrival - taken)
        return [a + (b - a) * fraction for a, b in zip(state, point.positions)]
    return list(point.positions)


# -- the node's messages ------------------------------------------------------------------------

class Publisher:
    def __init__(self, msg_type):
        self.msg_type, self.sent = msg_type, []

    def publish(self, msg):
        self.sent.append(msg)


def published(control_mode, node_now):
    """{message type: message} one publish_commands of ACTION sends, on a node whose clock reads
    `node_now` (s), and the joint targets it carries."""
    cfg = NodeConfig(observation_type='terms', joint_names=JOINTS, default_angles=DEFAULT,
                     action_scale=[0.25], control_mode=control_mode, control_rate=RATE,
                     command_outputs=['float64_array', 'joint_trajectory'])
    settings = Settings(cfg, None, None, '', targets=JointTargets(JOINTS, DEFAULT, [0.25]))
    pubs = []

    def create_publisher(msg_type, topic, qos):
        pubs.append(Publisher(msg_type))
        return pubs[-1]
    robot = RobotIO(settings, ['robot'], create_publisher=create_publisher,
                    destroy_publisher=pubs.remove, create_subscription=None,
                    destroy_subscription=None, now=lambda: sim_stamp(node_now), on_lost=None)
    robot.publish_commands(robot.sessions[0], ACTION)
    return {p.msg_type: p.sent[-1] for p in pubs if p.sent}, settings.targets(ACTION)


# (node clock, controller clock when the message arrives), s: the same clock a latency later
# (one controller cycle, or a loaded machine), or a node and a controller on different clocks
CLOCKS = [(SIM, SIM + 0.001), (SIM, SIM + 0.05), (WALL, WALL + 0.001), (WALL, SIM),
          (SIM, WALL)]


@pytest.mark.parametrize('mode', ['timer', 'lockstep'])
def test_forward_command_controller_takes_each_command(mode):
    msgs, targets = published(mode, SIM)
    msg = msgs[Float64MultiArray]
    assert forward_command_controller(msg, JOINTS) == {
        f'{j}/position': v for j, v in zip(JOINTS, targets)}
    # the transcription refuses what the controller refuses: another joint count
    assert forward_command_controller(msg, JOINTS[:2]) is None


def test_command_array_layout_is_empty():
    """The controller reads data only; its own tests send data alone (forward_command_controller/
    test/test_forward_command_controller.cpp, CommandCallbackTest), and a described layout
    would claim a shape nothing checks."""
    msg = published('timer', SIM)[0][Float64MultiArray]
    assert not msg.layout.dim and msg.layout.data_offset == 0


@pytest.mark.parametrize('node_now,controller_now', CLOCKS)
@pytest.mark.parametrize('mode', ['timer', 'lockstep'])
def test_joint_trajectory_controller_takes_each_command(mode, node_now, controller_now):
    """Failed before the fix: a stamp from the node's clock with time_from_start 0 ended in
    the controller's past as soon as any latency separated them (sim time included)."""
    traj = published(mode, node_now)[0][JointTrajectory]
    assert jtc_refusal(traj, JOINTS, int(controller_now * 1e9)) is None
    assert list(traj.joint_names) == JOINTS


@pytest.mark.parametrize('node_now,controller_now', CLOCKS)
def test_timer_targets_are_reached_in_one_control_period(node_now, controller_now):
    """Whatever the clocks, the JTC moves from where the joints stand to the targets in one
    control period (1 / control_rate) from taking the command, then holds them. Before the
    fix a wall-clock stamp on a sim-time controller was a start decades ahead: no motion."""
    msgs, targets = published('timer', node_now)
    traj, taken, state = msgs[JointTrajectory], int(controller_now * 1e9), [0.0, 0.0, 0.0]
    assert ns(traj.points[0].time_from_start) == T
    assert jtc_desired(traj, taken, state, taken) == state
    assert jtc_desired(traj, taken, state, taken + T // 2) == pytest.approx(targets / 2)
    for t in (taken + T, taken + 10 * T):
        assert jtc_desired(traj, taken, state, t) == list(targets)


def test_lockstep_targets_are_set_at_once():
    """Lock-step's period is the world's, unknown to the node: the targets at once and held,
    as the forward controller sets them."""
    msgs, targets = published('lockstep', SIM)
    traj, taken = msgs[JointTrajectory], int(SIM * 1e9)
    assert ns(traj.points[0].time_from_start) == 0
    assert jtc_desired(traj, taken, [0.0] * 3, taken) == list(targets)


def _trajectory(stamp=0.0, time_from_start=0.0, names=JOINTS, **fields):
    traj = JointTrajectory(joint_names=list(names))
    traj.header.stamp = sim_stamp(stamp)
    point = JointTrajectoryPoint(positions=[0.0] * len(JOINTS), **fields)
    point.time_from_start.sec, point.time_from_start.nanosec = divmod(
        int(time_from_start * 1e9), 1_000_000_000)
    traj.points = [point]
    return traj


@pytest.mark.parametrize('traj,why', [
    (_trajectory(stamp=SIM), 'ends in the past'),           # what the node sent before
    (_trajectory(stamp=SIM - 0.03, time_from_start=0.02), 'ends in the past'),
    (_trajectory(velocities=[0.0, 0.5, 0.0]), 'Velocity of last trajectory point'),
    (_trajectory(effort=[0.0] * 3), 'effort'),
    (_trajectory(names=JOINTS[:2]), "don't match the controller joints"),
    (_trajectory(names=['hip', 'knee', 'toe']), "Incoming joint doesn't match"),
])
def test_transcription_refuses_what_the_controller_refuses(traj, why):
    assert why in (jtc_refusal(traj, JOINTS, int((SIM + 0.001) * 1e9)) or '')


@pytest.mark.parametrize('traj', [_trajectory(stamp=SIM, time_from_start=0.02), _trajectory(),
                                  _trajectory(velocities=[0.0] * 3)])
def test_transcription_accepts_what_the_controller_accepts(traj):
    # a stamp that ends after now, a zero stamp (start now), zero velocities at the end
    assert jtc_refusal(traj, JOINTS, int((SIM + 0.001) * 1e9)) is None
