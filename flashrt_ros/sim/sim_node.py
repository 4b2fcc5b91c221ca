"""The `flashrt_sim` ROS node: a MuJoCo world served over ROS 2.

`SimNode` (node `flashrt_sim`) serves the cart-pole (`MujocoWorld`, cartpole.py: plain Python,
deterministic, with world snapshots that restore bit for bit) over ROS 2:
  ~/reset      std_srvs/Trigger           back to the seeded start state
  ~/step       std_srvs/Trigger           advance `steps_per_call` control steps (paused only)
  ~/snapshot, ~/restore, ~/save_capsule, ~/load_capsule, ~/list_capsules, ~/delete_capsule
               world capsules (world_capsules.py), this package's capsule service types
  ~/action     std_msgs/Float32MultiArray in: the control (see `lockstep`)
  ~/observation std_msgs/Float32MultiArray out: qpos, qvel
  ~/reward     std_msgs/Float64           out with every observation
  /clock       rosgraph_msgs/Clock        the simulation time (back in time after a reset or
                                          restore), so nodes with use_sim_time follow the world
and the ROS standard simulator API, simulation_interfaces (simulation_services.py), where that
package is built: simulation state (starts PAUSED), steps, the SimulateSteps action, resets,
entities.

Parameter `lockstep`: how commands and steps meet.
  'command' (default)  while paused, each command message steps one control period, then the
                       readings go out (a controller drives the clock)
  'steps'              each step (step_simulation, simulate_steps, ~/step) first sends the
                       readings of the current state, waits `command_timeout` s for the command
                       that answers them, and steps with it: paused lock-step, world and policy
                       advance exactly together (the episode runner's world 'simulator')
  'off'                commands are held for the next step
While PLAYING (real time x `real_time_factor`) every mode steps on the timer, holding the last
command, and publishes after each step.

Parameter `world`: 'cartpole' (default, the above) or 'mjcf': a floating-base robot from an
MJCF file under joint PD control (`RobotWorld`, robot_world.py), parameters
`mjcf_path`, `kps`, `kds`, `default_angles` (one per joint), `sim_dt` (0: the MJCF's),
`decimation` (physics steps per control period), `joint_names` (empty: the actuated joints in
actuator order), `clip_targets` (true: targets clipped to the joint ranges). The services and
~/action, ~/observation ([qpos, qvel]), ~/reward (base x velocity) work as above (one ~/action
or ~/step = one control period), and the robot topics are added:
  ~/joint_commands std_msgs/Float64MultiArray in: position targets in joint order, as ~/action
  ~/joint_states   sensor_msgs/JointState out: name, position, velocity, effort (the joint
                   actuator force of the last physics step)
  ~/imu            sensor_msgs/Imu out: base orientation (world frame), angular velocity and
                   linear acceleration (specific force) in the base frame; frame_id = the
                   base body's name
  ~/base_pose      geometry_msgs/PoseStamped out: the base body's pose, frame_id 'world'
published with every observation, all stamped with the simulation time.
"""
import array
from collections import deque
import os
import threading
import time

from geometry_msgs.msg import PoseStamped
import numpy as np
from rcl_interfaces.msg import ParameterDescriptor
import rclpy
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.node import Node
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.task import Future
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import Imu, JointState
from std_msgs.msg import Float32MultiArray, Float64, Float64MultiArray
from std_srvs.srv import Trigger

from flashrt_ros.executors import run
from flashrt_ros.messages import robot_messages, sim_stamp
from flashrt_ros.msg import SafetyEvent
from flashrt_ros.runtime.bundles import load_bundle
from flashrt_ros.sim import simulation_services
from flashrt_ros.sim.cartpole import MujocoWorld
from flashrt_ros.sim.robot_world import RobotWorld
from flashrt_ros.sim.world import mujoco
from flashrt_ros.sim.stepping import LOCKSTEP_MODES, PAUSED, PLAYING, Stepping
from flashrt_ros.sim.world_capsules import CapsuleServices, WorldCapsules


ROBOT_PARAMETERS = ('mjcf_path', 'kps', 'kds', 'default_angles', 'joint_names', 'sim_dt',
                    'decimation', 'clip_targets')


def robot_world_from_parameters(node):
    """Declares the mjcf world's parameters (ROBOT_PARAMETERS, see the module docstring) on a
    node and builds its RobotWorld: the flashrt_sim node's world, or the episode runner's.
    With `policy_bundle` (a training run: runtime/bundles.py) the joint order, PD gains,
    default angles, sim_dt and decimation come from it, except those set as parameters."""
    # Dynamically typed, so YAML integers (kps: [100, ...]) are accepted as well.
    free = ParameterDescriptor(dynamic_typing=True)
    declared = [(name, None, free) for name in ('kps', 'kds', 'default_angles', 'joint_names')]
    declared += [('mjcf_path', '', None), ('sim_dt', 0.0, None), ('decimation', 1, None),
                 ('clip_targets', True, None), ('policy_bundle', '', None),
                 ('robot_joint_names', [''], None)]
    for name, default, descriptor in declared:
        if not node.has_parameter(name):    # a second world on the same node (parallel)
            node.declare_parameter(name, default, descriptor)
    v = {name: node.get_parameter(name).value for name in ROBOT_PARAMETERS}
    bundle = node.get_parameter('policy_bundle').value
    if bundle:
        names = [n for n in node.get_parameter('robot_joint_names').value if n]
        robot = load_bundle(bundle, names).robot
        user = set(getattr(node, '_parameter_overrides', {}))
        for name in ('kps', 'kds', 'default_angles', 'joint_names', 'sim_dt', 'decimation'):
            if name in robot and name not in user:
                v[name] = robot[name]
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


class SimNode(Stepping, CapsuleServices, Node):
    """The MuJoCo cart-pole or MJCF robot world over ROS: see the module docstring."""

    def __init__(self, node_name='flashrt_sim', **kwargs):
        super().__init__(node_name, **kwargs)
        self.declare_parameter('seed', 0)
        self.declare_parameter('frame_skip', 2)
        self.declare_parameter('action_scale', 1.0)
        self.declare_parameter('steps_per_call', 1)
        self.declare_parameter('qos_depth', 10)
        self.declare_parameter('world', 'cartpole')
        self.declare_parameter('lockstep', 'command')
        self.declare_parameter('command_timeout', 10.0)
        self.declare_parameter('real_time_factor', 1.0)
        self.declare_parameter('capsule_dir', '')
        self.declare_parameter('follow_rollbacks', '')
        self.declare_parameter('rollback_window', 500)
        p = self.get_parameter
        kind = p('world').value
        if kind == 'cartpole':
            self.world = MujocoWorld(frame_skip=p('frame_skip').value,
                                     action_scale=p('action_scale').value)
        elif kind == 'mjcf':
            self.world = robot_world_from_parameters(self)
        else:
            raise ValueError(f"parameter world must be 'cartpole' or 'mjcf', got {kind!r}")
        self.lockstep = p('lockstep').value
        if self.lockstep not in LOCKSTEP_MODES:
            raise ValueError(f'parameter lockstep must be one of {", ".join(LOCKSTEP_MODES)}, '
                             f'got {self.lockstep!r}')
        if not p('real_time_factor').value > 0 or not p('command_timeout').value > 0:
            raise ValueError('parameters real_time_factor and command_timeout must be > 0')
        self.world.reset(p('seed').value)
        self.capsules = WorldCapsules(self.world, p('capsule_dir').value or os.path.join(
            os.environ.get('ROS_HOME') or os.path.join('~', '.ros'), 'flashrt_capsules',
            self.get_fully_qualified_name().lstrip('/')))
        self.lock = threading.Lock()    # one world operation at a time
        self.sim_state = PAUSED
        self.busy = ''          # what is stepping now ('a SimulateSteps goal', ...), or ''
        self.held = None        # the command the next step applies (None: keep the last)
        self._answer = None     # lockstep 'steps': resolved by the command after the readings
        self._published = False     # lockstep 'steps': the current state's readings went out
        self._play_timer = None
        # One reentrant group on a single-threaded executor: callbacks interleave only where
        # a step awaits the policy's command (lockstep 'steps'), never inside a world operation.
        group = ReentrantCallbackGroup()
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
        # follow_rollbacks: the world's state after each step, by the stamp of the readings
        # the step's command answered, so that a policy's rollback takes the world back too
        self._history = deque()
        followed = p('follow_rollbacks').value
        self._following = bool(followed)    # read once: the subscription is made here only
        if followed:
            self.create_subscription(SafetyEvent, f'{followed.rstrip("/")}/safety_event',
                                     self._on_safety_event, qos, callback_group=group)
        self.create_service(Trigger, '~/reset', self.reset_callback, callback_group=group)
        self.create_service(Trigger, '~/step', self.step_callback, callback_group=group)
        self.serve_capsules(group)
        standard = 'simulation_interfaces services'
        if simulation_services.available():
            self.standard = simulation_services.SimulationServices(self, group)
        else:
            self.standard = None
            standard = 'no simulation_interfaces (not built: install ' \
                'ros-jazzy-simulation-interfaces or build it in the workspace)'
        what = 'cart-pole' if self.robot is None else \
            f'{p("mjcf_path").value}, joints {", ".join(self.world.joint_names)}, ' \
            f'dt {self.world.sim_dt} s x {self.world.decimation}'
        self.get_logger().info(
            f'MuJoCo {mujoco.__version__} {what}: obs_dim {self.world.obs_dim}, '
            f'act_dim {self.world.act_dim}, state {self.world.state_size * 8} bytes; '
            f'lockstep {self.lockstep!r}; {standard}')

    # -- readings out ---------------------------------------------------------------------

    def _republish(self):
        # lockstep 'steps' sends again only readings already sent (never a new state's early:
        # the policy must see a restored or pushed state first, when the next step asks)
        if self.lockstep == 'steps' and not self._published and self.sim_state != PLAYING:
            return
        with self.lock:
            if time.monotonic() - self._last_publish >= \
                    self.get_parameter('republish_period').value:
                self.robot.publish()
                self._last_publish = time.monotonic()

    def _publish_clock(self):
        self.clock_pub.publish(Clock(clock=sim_stamp(float(self.world.data.time))))

    def publish(self, obs, reward):
        self._last_publish = time.monotonic()
        if self.lockstep == 'steps':
            self._answer = Future()     # before the readings go out: no answer is missed
            self._published = True
        msg = Float32MultiArray()
        msg.data = array.array('f', np.asarray(obs, dtype=np.float32).tobytes())
        self.obs_pub.publish(msg)
        self.reward_pub.publish(Float64(data=float(reward)))
        self._publish_clock()
        if self.robot is not None:
            self.robot.publish()

    def changed(self, obs=None):
        """After a reset, restore or set state: the new readings go out, except under lockstep
        'steps' while not playing, where the next step sends them (only /clock now)."""
        if self.lockstep == 'steps' and self.sim_state != PLAYING:
            self._published = False
            self._publish_clock()
            return
        self.publish(self.world.observation() if obs is None else obs, self.world.reward())

    # -- the package's own services ---------------------------------------------------------

    def reset_callback(self, request, response):
        if self.busy:
            response.success, response.message = False, f'{self.busy} is running'
            return response
        self.reset_world()
        response.success, response.message = True, 'world reset'
        return response

    async def step_callback(self, request, response):
        n = max(1, int(self.get_parameter('steps_per_call').value))
        if self.busy or self.sim_state != PAUSED:
            response.success = False
            response.message = self.busy + ' is running' if self.busy else \
                'the simulation is not paused (set_simulation_state PAUSED)'
            return response
        done, error = await self.advance(n, 'a ~/step call')
        response.success = not error
        response.message = error or f'{n} steps, world step {self.world.steps}, ' \
                                    f'time {self.world.data.time:.4f} s'
        return response


def make_sim_node(node_name='flashrt_sim', **kwargs):
    """Builds the `flashrt_sim` node (rclpy must be initialised)."""
    return SimNode(node_name, **kwargs)


def main(args=None):
    rclpy.init(args=args)
    run(make_sim_node())


if __name__ == '__main__':
    main()
