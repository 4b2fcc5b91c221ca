"""The node's robot-side I/O: per session, its subscriptions, its publishers and its latest
readings. No decisions: what arrives is stored and handed to the control loop's callbacks;
what the control loop computes is published here.

A single-session node has one SessionIO: the robot's readings on the relative names
joint_states, imu and cmd_vel (as robot_state_publisher and nav2 name them: the node's
namespace alone connects it to a robot), its own API under '~/' (observation, action,
input/<term>, instruction, the command outputs); a cameras observation's camera topics are
the ones camera_topics names. Session i of a fleet has its own under '<name>/' and
'~/<name>/' (one robot's messages stay standard messages in its own namespace).
Subscriptions are made in the control callback group (see control_loop.py), so readings are
taken by the control thread and never wait behind services; camera frames in the camera
group, so that their decoding never delays a tick (camera_readings.py).
"""
from dataclasses import dataclass, field
from functools import partial
import math
import time

from geometry_msgs.msg import Twist
import numpy as np
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image, Imu, JointState
from std_msgs.msg import Float32MultiArray, Float64MultiArray, String
from trajectory_msgs.msg import JointTrajectory

from flashrt_ros.messages import action_message, chunk_message, command_message
from flashrt_ros.msg import SafetyEvent

COMMAND_TOPICS = {'float64_array': (Float64MultiArray, 'joint_commands'),
                  'joint_trajectory': (JointTrajectory, 'joint_trajectory')}


def stamp_of(msg):
    return (msg.header.stamp.sec, msg.header.stamp.nanosec)


@dataclass
class SessionIO:
    """One session's topics, latest readings and lock-step bookkeeping."""

    index: int
    name: str
    prefix: str                   # the node's own topics: '~/' or '~/<name>/'
    robot: str                    # the robot's readings: '' or '<name>/' (relative names)
    label: str                    # 'session <name>: ' in a fleet, '' alone (log prefixes)
    inputs: dict = field(default_factory=dict)   # key -> (value, stamp, arrival time)
    # lock-step: the tag of the readings the state answered last, and whether the state
    # changed under the node since (then readings of that very stamp get their command re-sent
    # instead of a second step); pending: the tag of complete readings waiting for the tick
    stepped_tag: int = 0
    resend: bool = False
    # the action answering stepped_tag when its commands went out while no subscriber was
    # matched (a new world, a restarted node still in discovery): they reached nobody, so the
    # world's re-send of those readings gets them again; once they reached one, never twice
    # (a world steps on every command it receives)
    unsent: object = None
    pending: int = 0
    # the values of the readings stepped last (key -> value): a reading of that stamp with
    # other values is a driver's stamping fault, counted, not a re-send
    answered: dict = field(default_factory=dict)
    seen: bool = False            # readings came since activation (lock-step waits for it)
    action_pub: object = None
    command_pubs: list = field(default_factory=list)
    safety_pub: object = None     # ~/safety_event, when the safety supervisor is on
    chunk_pub: object = None      # ~/action_chunk, for a chunk policy with action_joint_names
    chunk_owed: bool = False      # the state was replaced: the next step sends its chunk's rest

    def store(self, key, value, stamp=None):
        self.inputs[key] = (value, stamp, time.monotonic())

    def forget_readings(self, cameras=None):
        """Readings answer a state; after the state is replaced they are stale, and so are the
        frames in cameras (the session's CameraObservation, if any). The velocity command is
        a setting, not a reading: kept."""
        self.inputs = {k: v for k, v in self.inputs.items() if k == 'command'}
        if cameras is not None:
            cameras.forget_images()


class ReadingCounter:
    """Readings lost before the node saw them: gaps in each input topic's publication
    sequence numbers. A number at or below the last one is a new or restarted publisher: a
    new baseline, nothing counted."""

    def __init__(self, on_lost):
        self._last = {}
        self._on_lost = on_lost       # (topic, count)

    def reset(self):
        """A new baseline for every topic (at activate: what was published while the node was
        inactive was not lost by it)."""
        self._last.clear()

    def saw(self, topic, info):
        seq = info.get('publication_sequence_number')
        if seq is None:
            return              # an rmw without sequence numbers: nothing to count with
        last = self._last.get(topic)
        self._last[topic] = seq
        if last is not None and seq > last + 1:
            self._on_lost(topic, seq - last - 1)


class RobotIO:
    """Publishers (made at configure) and subscriptions (made at activate) of every session.

    create_publisher / destroy_publisher: the lifecycle node's; create_subscription /
    destroy_subscription: the node's; now() -> builtin_interfaces/Time; on_lost(topic, count):
    readings lost before the node saw them; chunks: whether the policy's chunks hold the
    actions it sends (a LeRobot chunk policy's; not ACT's temporal ensembling).
    """

    def __init__(self, settings, session_names, *, create_publisher, destroy_publisher,
                 create_subscription, destroy_subscription, now, on_lost, chunks=False):
        cfg = settings.node
        self.settings, self.now = settings, now
        self.qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=cfg.qos_depth,
                              reliability=(ReliabilityPolicy.RELIABLE
                                           if cfg.qos_reliability == 'reliable'
                                           else ReliabilityPolicy.BEST_EFFORT))
        self._create_sub, self._destroy_sub = create_subscription, destroy_subscription
        self._destroy_pub = destroy_publisher
        self.counter = ReadingCounter(on_lost)
        fleet = len(session_names) > 1
        self.sessions = [SessionIO(i, n, *((f'~/{n}/', f'{n}/', f'session {n}: ') if fleet
                                           else ('~/', '', '')))
                         for i, n in enumerate(session_names)]
        action_type = JointState if cfg.observation_type == 'joint_state' and \
            cfg.action_joint_names else Float32MultiArray
        self._pubs = []

        def publisher(msg_type, topic, qos=self.qos):
            pub = create_publisher(msg_type, topic, qos)
            self._pubs.append(pub)
            return pub
        # commands always reliable: the standard controllers subscribe reliably
        # (SystemDefaultsQoS), which a best-effort publisher never matches; a reliable one
        # also matches best-effort subscribers
        command_qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=cfg.qos_depth,
                                 reliability=ReliabilityPolicy.RELIABLE)
        # joint commands: terms' targets, or a cameras policy's actions by action_joint_names
        commands = settings.terms or settings.cameras and cfg.action_joint_names
        for s in self.sessions:
            s.action_pub = publisher(action_type, s.prefix + 'action')
            for output in cfg.command_outputs if commands else ():
                msg_type, topic = COMMAND_TOPICS[output]
                s.command_pubs.append(publisher(msg_type, s.prefix + topic, command_qos))
            if cfg.safety and settings.terms:
                s.safety_pub = publisher(SafetyEvent, s.prefix + 'safety_event', command_qos)
            if chunks and cfg.action_joint_names:
                s.chunk_pub = publisher(JointTrajectory, s.prefix + 'action_chunk',
                                        command_qos)
        # a farm that assembles its observations: [sessions, obs_dim] in, one tick out
        self.actions_pub = publisher(Float32MultiArray, '~/actions') \
            if fleet and cfg.observation_type == 'float32_array' else None
        self._subs = []

    # -- subscriptions ---------------------------------------------------------------------------

    def subscribe(self, loop, group, guarded, camera_group=None):
        """Every session's input topics, each reading handed to `loop` (ControlLoop); camera
        frames are taken in camera_group (decoded there, off the control thread)."""
        cfg, layout = self.settings.node, self.settings.layout
        for s in self.sessions:
            p = s.prefix
            s.inputs, s.pending, s.seen = {}, 0, False
            if cfg.observation_type == 'float32_array':
                self._subscribe(Float32MultiArray, p + 'observation', group, guarded,
                                lambda msg, s=s: loop.on_vector(s, _vector(msg)))
                continue
            if cfg.observation_type == 'joint_state':
                self._subscribe(JointState, p + 'observation', group, guarded,
                                lambda msg, s=s: loop.on_joint_observation(s, msg))
                continue
            if cfg.observation_type == 'cameras':
                self._subscribe_cameras(loop, s, group, guarded, camera_group or group)
                continue
            if 'joint_state' in layout.needs:
                self._subscribe(JointState, s.robot + 'joint_states', group, guarded,
                                lambda msg, s=s: self._joint_state(loop, s, msg))
            if 'imu' in layout.needs:
                self._subscribe(Imu, s.robot + 'imu', group, guarded,
                                lambda msg, s=s: self._imu(loop, s, msg))
            if 'command' in layout.needs:
                self._subscribe(Twist, s.robot + 'cmd_vel', group, guarded,
                                lambda msg, s=s: s.store('command', (
                                    msg.linear.x, msg.linear.y, msg.angular.z)))
                if cfg.initial_command:
                    s.inputs['command'] = (tuple(cfg.initial_command), None, math.inf)
            for term in layout.terms:
                if term.type == 'raw':
                    self._subscribe(Float32MultiArray, f'{p}input/{term.name}', group, guarded,
                                    lambda msg, s=s, key='raw:' + term.name:
                                    s.store(key, msg.data))
        if self.actions_pub is not None:
            self._subscribe(Float32MultiArray, '~/observations', group, guarded,
                            lambda msg: loop.on_farm_tick(_vector(msg)))

    def _subscribe_cameras(self, loop, s, group, guarded, camera_group):
        """A LeRobot checkpoint's cameras, the joint states and ~/instruction. A camera keeps
        its newest frame only (a step takes that one), best effort: it matches a driver's
        reliable and best-effort (sensor data) publishers alike, and a frame lost or replaced
        before the node read it is no reading lost: the next one takes its place. A frame is
        decoded and staged without the lock (camera_readings.py), then guarded."""
        setup, readings = self.settings.cameras, loop.cameras[s.index]
        self._subscribe(JointState, s.robot + 'joint_states', group, guarded,
                        lambda msg: self._joint_state(loop, s, msg))
        newest = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                            reliability=ReliabilityPolicy.BEST_EFFORT)

        def frame(key, problem, stamp):     # a new frame may complete a held lock-step
            if readings.on_image(s, key, problem, stamp):
                loop.on_reading(s, 'camera:' + key)
        for key, topic in setup.topics.items():
            put = guarded(partial(frame, key), s.robot + topic)
            self._subs.append(self._create_sub(
                CompressedImage if key in setup.compressed else Image, s.robot + topic,
                lambda msg, key=key, put=put: put(readings.stage(key, msg), stamp_of(msg)),
                newest, callback_group=camera_group))
        self._subscribe(String, s.prefix + 'instruction', group, guarded,
                        lambda msg: readings.on_instruction(s, msg.data) and
                        loop.on_reading(s, 'instruction'))  # a held lock-step may go on

    def _subscribe(self, msg_type, topic, group, guarded, callback):
        def seen(msg, info):
            self.counter.saw(topic, info)
            callback(msg)
        run = guarded(seen, topic)

        def take(msg, info):    # two named parameters: rclpy then passes the message info
            run(msg, info)
        self._subs.append(self._create_sub(msg_type, topic, take, self.qos,
                                           callback_group=group))

    @staticmethod
    def _joint_state(loop, s, msg):
        s.store('joint_state', (list(msg.name), np.asarray(msg.position),
                                np.asarray(msg.velocity)), stamp_of(msg))
        s.seen = True
        loop.on_reading(s, 'joint_state')

    @staticmethod
    def _imu(loop, s, msg):
        o, w = msg.orientation, msg.angular_velocity
        s.store('imu', ((o.x, o.y, o.z, o.w), (w.x, w.y, w.z)), stamp_of(msg))
        loop.on_reading(s, 'imu')

    def reading_ages(self):
        """(name, seconds since it arrived) of each session's newest readings (terms, cameras;
        sorted by name): the diagnostics show them, so that a camera gone quiet is seen there,
        not only in the refused steps."""
        now = time.monotonic()
        return [(s.label + key, now - arrived) for s in self.sessions
                for key, (_, _, arrived) in sorted(s.inputs.items()) if arrived != math.inf]

    def unsubscribe(self):
        for sub in self._subs:
            self._destroy_sub(sub)
        self._subs = []

    # -- outputs ---------------------------------------------------------------------------------

    def in_ros_units(self, actions):
        """Actions (numpy, [..., act_dim]) as the robot takes them: with joint_scale /
        joint_offset (cameras) value / scale + offset in float64, else as they are."""
        units = self.settings.cameras and self.settings.cameras.action_units
        if units is None:
            return actions
        return actions.astype(np.float64) / units[0] + units[1]

    def publish_action(self, s, action):
        pub = s.action_pub
        stamp = self.now() if pub.msg_type is JointState else None
        pub.publish(action_message(pub.msg_type, self.in_ros_units(action),
                                   self.settings.node.action_joint_names, stamp))

    def publish_commands(self, s, action):
        if not s.command_pubs:
            return
        if self.settings.terms:
            self.publish_targets(s, self.settings.targets(action))
        else:       # cameras: the action itself, in ROS units, by action_joint_names
            self.publish_targets(s, np.asarray(self.in_ros_units(action), np.float64),
                                 self.settings.node.action_joint_names)

    def publish_targets(self, s, targets, joints=None):
        """Joint targets (in `joints` order, joint_names by default) on the session's command
        outputs."""
        if not s.command_pubs:
            return
        cfg = self.settings.node
        # a trajectory reaches the targets one control period after the controller takes it;
        # lock-step's period is the world's, unknown here: 0, the targets at once (as the
        # forward controller sets them), held until the world steps and the next one comes
        period = 1.0 / cfg.control_rate if cfg.control_mode == 'timer' else 0.0
        for pub in s.command_pubs:
            pub.publish(command_message(pub.msg_type, targets, joints or cfg.joint_names,
                                        period))

    def publish_chunk(self, s, policy, views):
        """The chunk the policy's latest step computed ([steps, act_dim]) as a JointTrajectory;
        after the state was replaced (restore, reset, rollback), the rest of the state's chunk
        from this step's action on, whichever step computed it: the controller would otherwise
        play the old state's until the next chunk. views: the session's arena views."""
        chunk = policy.fresh_chunk(views)
        if chunk is None and s.chunk_owed:
            chunk = policy.chunk_left(views)
        s.chunk_owed = False
        if chunk is None:
            return
        cfg = self.settings.node
        s.chunk_pub.publish(chunk_message(self.in_ros_units(chunk).astype(np.float64),
                                          cfg.action_joint_names,
                                          cfg.chunk_period or 1.0 / cfg.control_rate))

    def publish_safety_event(self, s, stamp, detector, detail, response, trip_capsule,
                             restored_capsule='', restored_stamp=None):
        msg = SafetyEvent(session=s.name if s.label else '', detector=detector, detail=detail,
                          response=response, trip_capsule=trip_capsule,
                          restored_capsule=restored_capsule)
        if stamp is not None:
            msg.header.stamp = stamp
        if restored_stamp is not None:
            msg.restored_stamp = restored_stamp
        s.safety_pub.publish(msg)

    @staticmethod
    def reaches(s):
        """Whether each publisher that carries the session's commands (its action when it has
        no command output) has a matched subscription now. A message published without one
        reached nobody: a volatile writer keeps nothing for a reader matched later."""
        return all(pub.get_subscription_count() > 0 for pub in s.command_pubs or [s.action_pub])

    def publish_farm_actions(self, actions):
        self.actions_pub.publish(action_message(Float32MultiArray, actions.reshape(-1), [],
                                                None))

    def release(self):
        self.unsubscribe()
        for pub in self._pubs:
            self._destroy_pub(pub)
        self._pubs = []


def _vector(msg):
    return np.asarray(msg.data, dtype=np.float32) if len(msg.data) else np.zeros(0, np.float32)
