"""The `flashrt_sim` ROS node: a MuJoCo world served over ROS 2.

`SimNode` (node `flashrt_sim`) serves the cart-pole (`MujocoWorld`, cartpole.py: plain Python,
deterministic, with world snapshots that restore bit for bit) over ROS 2:
  ~/reset      std_srvs/Trigger           back to the seeded start state
  ~/step       std_srvs/Trigger           advance `steps_per_call` control steps, holding the
                                          last control
  ~/snapshot   flashrt_ros/srv/Snapshot   world state by name (capsule.nbytes = state bytes)
  ~/restore    flashrt_ros/srv/Restore    world state by name
  ~/action     std_msgs/Float32MultiArray in: one message = one control step (lock-step)
  ~/observation std_msgs/Float32MultiArray out after every reset/step/restore: qpos, qvel
  ~/reward     std_msgs/Float64           out with every observation
  /clock       rosgraph_msgs/Clock        out with every observation: the simulation time
                                          (back in time after a reset or restore), so nodes
                                          with use_sim_time follow the world
The official `simulation_interfaces` package is not installable here (not on PyPI), hence the
std_srvs/Trigger + topics + this package's Snapshot/Restore types.

Parameter `world`: 'cartpole' (default, the above) or 'mjcf': a floating-base robot from an
MJCF file under joint PD control (`RobotWorld`, robot_world.py), parameters
`mjcf_path`, `kps`, `kds`, `default_angles` (one per joint), `sim_dt` (0: the MJCF's),
`decimation` (physics steps per control period), `joint_names` (empty: the actuated joints in
actuator order), `clip_targets` (true: targets clipped to the joint ranges). The services and
~/action, ~/observation ([qpos, qvel]), ~/reward (base x velocity) work as above (one ~/action
or ~/step = one control period), and the robot topics are added:
  ~/joint_commands std_msgs/Float64MultiArray in: position targets in joint order; one message
                   = one control period (`decimation` physics steps), then the topics below
  ~/joint_states   sensor_msgs/JointState out: name, position, velocity, effort (the joint
                   actuator force of the last physics step)
  ~/imu            sensor_msgs/Imu out: base orientation (world frame), angular velocity and
                   linear acceleration (specific force) in the base frame; frame_id = the
                   base body's name
  ~/base_pose      geometry_msgs/PoseStamped out: the base body's pose, frame_id 'world'
published after every reset, step and restore, all stamped with the simulation time.
"""
import array
import threading
import time

from geometry_msgs.msg import PoseStamped
import numpy as np
from rcl_interfaces.msg import ParameterDescriptor
import rclpy
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import Imu, JointState
from std_msgs.msg import Float32MultiArray, Float64, Float64MultiArray
from std_srvs.srv import Trigger

from flashrt_ros import srv as fsrv
from flashrt_ros.executors import run
from flashrt_ros.messages import robot_messages, sim_stamp
from flashrt_ros.sim.cartpole import MujocoWorld
from flashrt_ros.sim.robot_world import RobotWorld
from flashrt_ros.sim.world import mujoco

ROBOT_PARAMETERS = ('mjcf_path', 'kps', 'kds', 'default_angles', 'joint_names', 'sim_dt',
                    'decimation', 'clip_targets')


def robot_world_from_parameters(node):
    """Declares the mjcf world's parameters (ROBOT_PARAMETERS, see the module docstring) on a
    node and builds its RobotWorld: the flashrt_sim node's world, or the episode runner's."""
    # Dynamically typed, so YAML integers (kps: [100, ...]) are accepted as well.
    free = ParameterDescriptor(dynamic_typing=True)
    declared = [(name, None, free) for name in ('kps', 'kds', 'default_angles', 'joint_names')]
    declared += [('mjcf_path', '', None), ('sim_dt', 0.0, None), ('decimation', 1, None),
                 ('clip_targets', True, None)]
    for name, default, descriptor in declared:
        if not node.has_parameter(name):    # a second world on the same node (parallel)
            node.declare_parameter(name, default, descriptor)
    v = {name: node.get_parameter(name).value for name in ROBOT_PARAMETERS}
    missing = [k for k in ('mjcf_path', 'kps', 'kds', 'default_angles') if not v[k]]
    if missing:
        raise ValueError(f"world 'mjcf' needs the parameters {', '.join(missing)}")
    return RobotWorld(v['mjcf_path'], v['kps'], v['kds'], v['default_angles'],
                      sim_dt=v['sim_dt'], decimation=v['decimation'],
                      joint_names=v['joint_names'] or None, clip_targets=v['clip_targets'])


class _RobotTopics:
    """The mjcf world's robot topics on a node: ~/joint_commands in; ~/joint_states, ~/imu,
    ~/base_pose out (see the module docstring)."""

    def __init__(self, node, world, qos, group, on_command):
        self.world = world
        self.joint_pub = node.create_publisher(JointState, '~/joint_states', qos)
        self.imu_pub = node.create_publisher(Imu, '~/imu', qos)
        self.pose_pub = node.create_publisher(PoseStamped, '~/base_pose', qos)
        node.create_subscription(Float64MultiArray, '~/joint_commands', on_command, qos,
                                 callback_group=group)

    def publish(self):
        pubs = (self.joint_pub, self.imu_pub, self.pose_pub)
        for pub, msg in zip(pubs, robot_messages(self.world)):
            pub.publish(msg)


class SimNode(Node):
    """The MuJoCo cart-pole or MJCF robot world over ROS: see the module docstring."""

    def __init__(self, node_name='flashrt_sim', **kwargs):
        super().__init__(node_name, **kwargs)
        self.declare_parameter('seed', 0)
        self.declare_parameter('frame_skip', 2)
        self.declare_parameter('action_scale', 1.0)
        self.declare_parameter('steps_per_call', 1)
        self.declare_parameter('qos_depth', 10)
        self.declare_parameter('world', 'cartpole')
        p = self.get_parameter
        kind = p('world').value
        if kind == 'cartpole':
            self.world = MujocoWorld(frame_skip=p('frame_skip').value,
                                     action_scale=p('action_scale').value)
        elif kind == 'mjcf':
            self.world = robot_world_from_parameters(self)
        else:
            raise ValueError(f"parameter world must be 'cartpole' or 'mjcf', got {kind!r}")
        self.world.reset(p('seed').value)
        self.lock = threading.Lock()    # one world operation at a time
        group = MutuallyExclusiveCallbackGroup()
        qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=p('qos_depth').value,
                         reliability=ReliabilityPolicy.RELIABLE)
        self.obs_pub = self.create_publisher(Float32MultiArray, '~/observation', qos)
        # the stamps this world puts on its readings, as the time source of use_sim_time nodes
        # (rclpy's TimeSource subscribes /clock with the default QoS, depth 10, reliable)
        self.clock_pub = self.create_publisher(Clock, '/clock', 10)
        self.reward_pub = self.create_publisher(Float64, '~/reward', qos)
        self.create_subscription(Float32MultiArray, '~/action', self.action_callback, qos,
                                 callback_group=group)
        self.robot = None
        if kind == 'mjcf':
            self.robot = _RobotTopics(self, self.world, qos, group, self.action_callback)
            # Lock-step self-heals: while no command comes, the current readings are sent
            # again (same stamp, so a lockstep policy steps on them once). A controller
            # that started after the world, or missed a message, then picks the loop up.
            self.declare_parameter('republish_period', 0.5)
            self._last_publish = time.monotonic()
            period = float(p('republish_period').value)
            if period > 0:
                self.create_timer(period, self._republish, callback_group=group)
        self.create_service(Trigger, '~/reset', self.reset_callback, callback_group=group)
        self.create_service(Trigger, '~/step', self.step_callback, callback_group=group)
        self.create_service(fsrv.Snapshot, '~/snapshot', self.snapshot_callback,
                            callback_group=group)
        self.create_service(fsrv.Restore, '~/restore', self.restore_callback,
                            callback_group=group)
        what = 'cart-pole' if self.robot is None else \
            f'{p("mjcf_path").value}, joints {", ".join(self.world.joint_names)}, ' \
            f'dt {self.world.sim_dt} s x {self.world.decimation}'
        self.get_logger().info(
            f'MuJoCo {mujoco.__version__} {what}: obs_dim {self.world.obs_dim}, '
            f'act_dim {self.world.act_dim}, state {self.world.state_size * 8} bytes')

    def _republish(self):
        with self.lock:
            if time.monotonic() - self._last_publish >= \
                    self.get_parameter('republish_period').value:
                self.robot.publish()
                self._last_publish = time.monotonic()

    def publish(self, obs, reward):
        self._last_publish = time.monotonic()
        msg = Float32MultiArray()
        msg.data = array.array('f', np.asarray(obs, dtype=np.float32).tobytes())
        self.obs_pub.publish(msg)
        self.reward_pub.publish(Float64(data=float(reward)))
        self.clock_pub.publish(Clock(clock=sim_stamp(float(self.world.data.time))))
        if self.robot is not None:
            self.robot.publish()

    def action_callback(self, msg):
        with self.lock:
            try:
                obs, reward = self.world.step(list(msg.data))
            except ValueError as exc:
                self.get_logger().warning(f'action refused: {exc}',
                                          throttle_duration_sec=1.0)
                return
            self.publish(obs, reward)

    def reset_callback(self, request, response):
        with self.lock:
            obs = self.world.reset(self.get_parameter('seed').value)
            self.publish(obs, self.world.reward())
        response.success, response.message = True, 'world reset'
        return response

    def step_callback(self, request, response):
        n = max(1, int(self.get_parameter('steps_per_call').value))
        with self.lock:
            for _ in range(n):
                obs, reward = self.world.step(None)
            self.publish(obs, reward)
            response.message = f'{n} steps, world step {self.world.steps}, ' \
                               f'time {self.world.data.time:.4f} s'
        response.success = True
        return response

    def snapshot_callback(self, request, response):
        t0 = time.perf_counter()
        with self.lock:
            try:
                nbytes = self.world.snapshot(request.name)
            except ValueError as exc:
                response.success, response.message = False, str(exc)
                return response
            steps = self.world.steps
        self._fill_response(response, request.name, steps, nbytes, t0)
        response.message = f'world snapshot {request.name!r} at step {steps}'
        return response

    def restore_callback(self, request, response):
        t0 = time.perf_counter()
        with self.lock:
            try:
                obs = self.world.restore(request.name)
            except KeyError as exc:
                response.success, response.message = False, exc.args[0]
                return response
            steps = self.world.steps
            self.publish(obs, self.world.reward())
        self._fill_response(response, request.name, steps, self.world.state_size * 8, t0)
        response.message = f'world restored to {request.name!r} (step {steps})'
        return response

    def _fill_response(self, response, name, steps, nbytes, t0):
        response.success = True
        response.latency_us = (time.perf_counter() - t0) * 1e6
        response.capsule.name = name
        response.capsule.tier = 'host'
        response.capsule.step = int(steps)
        response.capsule.nbytes = int(nbytes)
        response.capsule.stamp = self.get_clock().now().to_msg()


def make_sim_node(node_name='flashrt_sim', **kwargs):
    """Builds the `flashrt_sim` node (rclpy must be initialised)."""
    return SimNode(node_name, **kwargs)


def main(args=None):
    rclpy.init(args=args)
    run(make_sim_node())


if __name__ == '__main__':
    main()
