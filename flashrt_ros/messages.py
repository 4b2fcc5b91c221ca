"""Message conversions between the runtime and ROS: capsule manifests, actions, joint
commands for ros2_control, and a simulated robot's sensor readings."""
import array
import math

from builtin_interfaces.msg import Duration, Time
from geometry_msgs.msg import PoseStamped
from sensor_msgs.msg import Imu, JointState
from std_msgs.msg import Float32MultiArray, Float64MultiArray
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from flashrt_ros import msg as fmsg


def capsule_info(manifest):
    """flashrt_ros/msg/CapsuleInfo from a runtime Manifest (an empty message for None)."""
    info = fmsg.CapsuleInfo()
    if manifest is None:
        return info
    info.name = manifest.name
    info.parent = manifest.parent
    info.tier = manifest.tier
    info.pinned = bool(manifest.pinned)
    info.step = int(manifest.step)
    info.episode = int(manifest.episode)
    info.position = int(manifest.position)
    info.nbytes = int(manifest.nbytes)
    info.schema_digest = manifest.schema_digest
    info.model_digest = manifest.model_digest
    frac, whole = math.modf(manifest.created)
    info.stamp.sec = int(whole)
    info.stamp.nanosec = int(frac * 1e9)
    return info


def action_message(msg_type, action, joint_names=(), stamp=None):
    """The raw action (float32 numpy) as Float32MultiArray, or as a JointState of
    `joint_names` (positions) stamped `stamp`."""
    if msg_type is JointState:
        out = JointState()
        out.header.stamp = stamp
        out.name = list(joint_names)
        out.position = action.astype('float64').tolist()
        return out
    out = Float32MultiArray()
    out.data = array.array('f', action.astype('float32', copy=False).tobytes())
    return out


def command_message(msg_type, targets, joint_names=(), period=0.0):
    """Joint position targets (float64 numpy, in `joint_names` order) as the stock
    ros2_controllers accept them (their rules, cited from source, are transcribed in
    test/unit/test_controller_acceptance.py):

    - Float64MultiArray for a forward_command_controller (JointGroupPositionController):
      one value per joint in its `joints` order, else it refuses the message; the layout
      stays empty (it reads data only).
    - JointTrajectory for a joint_trajectory_controller: one point of positions at
      time_from_start `period` (s) and a zero header.stamp, "start when the controller
      takes it". A stamp from the node's clock meets the controller's clock: refused once
      stamp + time_from_start is in the controller's past (latency, sim time), stalled
      when it lies in its future (a wall-clock node, a sim-time controller). The controller
      moves from its state to the targets in `period` (one control period) and holds them
      until the next command; 0 sets them at once, as the forward controller does.
      Positions only: no velocity at the last point, which jazzy refuses by default."""
    if msg_type is Float64MultiArray:
        out = Float64MultiArray()
        out.data = array.array('d', targets.tobytes())
        return out
    out = JointTrajectory()
    out.joint_names = list(joint_names)
    point = JointTrajectoryPoint()
    point.positions = array.array('d', targets.tobytes())
    point.time_from_start = Duration(**_sec_nanosec(period))
    out.points = [point]
    return out


def chunk_message(chunk, joint_names, period):
    """An action chunk (float64 numpy [steps, joints]: the actions a chunk policy will take,
    the first one now) as one joint_trajectory_controller trajectory: a point per action,
    `period` s apart, the first one period out (as command_message), a zero stamp ("start
    when the controller takes it"), positions only."""
    out = JointTrajectory()
    out.joint_names = list(joint_names)
    for i, targets in enumerate(chunk):
        point = JointTrajectoryPoint()
        point.positions = array.array('d', targets.tobytes())
        point.time_from_start = Duration(**_sec_nanosec((i + 1) * period))
        out.points.append(point)
    return out


def _sec_nanosec(seconds):
    """Seconds as builtin_interfaces' (sec, nanosec): integer nanoseconds, no float carry."""
    sec, nanosec = divmod(int(round(seconds * 1e9)), 1_000_000_000)
    return {'sec': sec, 'nanosec': nanosec}


def sim_stamp(seconds):
    """Simulation time as builtin_interfaces/Time (integer nanoseconds, no float carry)."""
    return Time(**_sec_nanosec(seconds))


def robot_messages(world):
    """(JointState, Imu, PoseStamped) of a RobotWorld's current readings, stamped with its
    simulation time: what the mjcf world publishes, and what the episode runner sends a
    policy node for an in-process robot (see the module docstring for the fields)."""
    stamp = sim_stamp(world.sim_time)
    names, q, dq, tau = world.joint_state()
    js = JointState()
    js.header.stamp = stamp
    js.name = names
    js.position = array.array('d', q.tobytes())
    js.velocity = array.array('d', dq.tobytes())
    js.effort = array.array('d', tau.tobytes())
    quat, gyro, acc = (v.tolist() for v in world.imu())
    imu = Imu()
    imu.header.stamp, imu.header.frame_id = stamp, world.base_body
    o = imu.orientation
    o.w, o.x, o.y, o.z = quat
    imu.angular_velocity.x, imu.angular_velocity.y, imu.angular_velocity.z = gyro
    a = imu.linear_acceleration
    a.x, a.y, a.z = acc
    pose = PoseStamped()
    pose.header.stamp, pose.header.frame_id = stamp, 'world'
    p = pose.pose.position
    p.x, p.y, p.z = world.base_position().tolist()
    pose.pose.orientation = o
    return js, imu, pose
