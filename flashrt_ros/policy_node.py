"""The flashrt_policy lifecycle node: a policy on a captured step graph, with capsule services.

configure: read and check parameters, build the policy, the state arena and the step graph.
activate: observation subscription, action/status/diagnostics publishers, a pinned
'episode_start' capsule. deactivate/cleanup/shutdown release them in that order.

Every observation is one committed step and publishes one action. With `sessions` > 1 the
node serves a fleet: one policy state per session, all stepped in one graph replay per tick
(lock-step: once every session that has had readings has its next ones; timer: every session with
fresh readings), each session's topics under ~/<session name>/ (the robot messages of one
robot stay standard messages in its own namespace), flat vectors also batched on
~/observations -> ~/actions (one message per tick for a simulation farm), and the capsule
services addressed by their `session` field. Capsule services have
their own callback group; the engine's lock makes each operation happen between two steps,
on any executor (main() spins a single thread; see there for why). Services exist in every
lifecycle state so that a call made while the node is not active gets a clear refusal
instead of silence.
"""
from dataclasses import asdict
from functools import partial
import math
import os
import re
import threading
import time

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from lifecycle_msgs.msg import State
import numpy as np
import rclpy
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from geometry_msgs.msg import Twist
from rcl_interfaces.msg import SetParametersResult
from sensor_msgs.msg import Imu, JointState
from std_msgs.msg import Float32MultiArray, Float64MultiArray
import torch
from trajectory_msgs.msg import JointTrajectory

from flashrt_ros import msg as fmsg
from flashrt_ros import params
from flashrt_ros.client import SERVICE_TYPES
from flashrt_ros.executors import publisher_events, run
from flashrt_ros.messages import action_message, capsule_info, command_message
from flashrt_ros.recovery import RecoveryMixin
from flashrt_ros.runtime.capsule import load_signing_key
from flashrt_ros.runtime.engine import EPISODE_START, PolicyEngine
from flashrt_ros.runtime.errors import FlashRTError, InvalidConfig, InvalidObservation
from flashrt_ros.runtime.observation import JointTargets, ObservationLayout
from flashrt_ros.runtime.policies import build_policy

STATE_NAMES = {State.PRIMARY_STATE_UNCONFIGURED: 'unconfigured',
               State.PRIMARY_STATE_INACTIVE: 'inactive',
               State.PRIMARY_STATE_ACTIVE: 'active',
               State.PRIMARY_STATE_FINALIZED: 'finalized'}


def _stamp(msg):
    return (msg.header.stamp.sec, msg.header.stamp.nanosec)


def _input_tag(stamp):
    """A lock-step reading's stamp as the engine's step tag: nanoseconds + 1 (0: none)."""
    sec, nanosec = stamp
    return sec * 1_000_000_000 + nanosec + 1


def _same_values(a, b):
    """Two readings' values equal (tuples of names, arrays or numbers)."""
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


class SessionIO:
    """One session's topics and lock-step bookkeeping: a single-session node has one, under
    '~/'; session i of a fleet has its own under '~/<name>/'."""

    def __init__(self, index, name, prefix):
        self.index, self.name, self.prefix = index, name, prefix
        self.inputs = {}        # terms: reading -> (value, stamp, arrival time)
        # lockstep: the tag (_input_tag) of the readings the state answered last, and whether
        # the state changed under the node since (then readings of that very stamp get their
        # command re-sent instead of a second step: see _sync_lockstep); pending: the tag of
        # complete readings waiting for the fleet's tick (0: none)
        self.stepped_tag, self.resend, self.pending = 0, False, 0
        # the values of the readings stepped last (key -> value): a reading of that stamp
        # with other values is a driver's stamping fault, counted, not a re-send
        self.answered = {}
        self.action_pub, self.command_pubs = None, []
        self.held = False       # fleet: poisoned, its steps refused until restored or reset
        self.seen = False       # fleet lock-step: readings came since activation (a robot
        #                         that is there: ticks wait for it, up to lockstep_wait)

    def label(self, fleet):
        return f'session {self.name}: ' if fleet else ''


def build_engine(cfg, policy_cfg, layout=None):
    """The PolicyEngine a configure builds (also used by tests for reference runs)."""
    policy = build_policy(policy_cfg, device='cpu',
                          term_history=layout.term_history() if layout else None)
    return PolicyEngine(policy, device=cfg['device'], cuda_graph=cfg['cuda_graph'],
                        sessions=cfg.get('sessions', 1),
                        session_names=cfg.get('session_names') or None,
                        batch_sessions=cfg.get('batch_sessions', False),
                        rollback_depth=cfg['rollback_depth'],
                        device_budget=cfg['device_budget_mb'] << 20,
                        host_budget=cfg['host_budget_mb'] << 20,
                        capsule_dir=cfg['capsule_dir'],
                        last_action=layout.device_feedback() if layout else None,
                        signing_key=load_signing_key(cfg['signing_key_file'])
                        if cfg.get('signing_key_file') else None)


class PolicyNode(RecoveryMixin, LifecycleNode):
    """Lifecycle node `flashrt_policy`: see the module docstring."""

    def __init__(self, node_name='flashrt_policy', **kwargs):
        super().__init__(node_name, **kwargs)
        params.declare(self)
        self.engine = None
        self.config = None            # dict of NodeConfig and policy config fields
        self.layout = self.targets = None
        self._state = 'unconfigured'
        self._rejected = 0            # refused before reaching the engine (joint names, ...)
        self._refusals = {}           # reason -> count, for diagnostics
        self._last_refusal = ''
        self._poisoned = 0            # steps whose action or state held NaN/Inf
        self._holding = False         # on_poison 'hold': refuse observations until restored
        self._scrub = False           # a poisoned step may have left NaN rows past position
        self._resumed_from = ''
        self._rejected_reported = 0
        self._dropped, self._dropped_reported = {}, 0   # input topic -> readings lost
        self._last_seq = {}           # input topic -> last publication sequence number seen
        self._io = []                 # SessionIO per session (topics, readings, lock-step)
        self._pending_since = None    # fleet lock-step: when the oldest waiting reading came
        self._subs, self._control_timer, self._status_timer = [], None, None
        self._status_pub = self._diag_pub = self._actions_pub = None
        # Every transition and every callback that reads what a transition builds or clears
        # (engine, config, topics) runs under this lock, whatever thread calls it (an executor
        # of several threads, a trigger_* from another thread): a callback never sees half a
        # configure or a cleared config. Callbacks made for one activation do nothing after it
        # (_activations). Uncontended on the single-threaded executor main() spins.
        self._lifecycle_lock = threading.RLock()
        self._activations = 0
        self._callback_failures = self._failures_reported = 0
        self._obs_group = MutuallyExclusiveCallbackGroup()
        self._srv_group = ReentrantCallbackGroup()
        # one table for node and client: ~/<name> served by <name>_callback
        for name, srv_type in SERVICE_TYPES.items():
            self.create_service(srv_type, '~/' + name, getattr(self, f'{name}_callback'),
                                callback_group=self._srv_group)
        self.add_on_set_parameters_callback(self._on_set_parameters)
        # rclpy (Jazzy) serves a change_state request by transition id that the current state
        # does not offer (configure while active) by raising RCLError out of the callback: the
        # caller never gets an answer. Refuse it with success=False first.
        service = self._service_change_state
        service.callback = partial(self._change_state_checked, service.callback)

    def _change_state_checked(self, serve, request, response):
        transition = request.transition
        offered = {t[0]: t[1] for t in self._state_machine.available_transitions}
        if not transition.label and transition.id not in offered:
            self.get_logger().warning(
                f'change_state refused: transition id {transition.id} is not available in '
                f'state {self._state!r} (available: {offered or "none"})')
            response.success = False
            return response
        return serve(request, response)

    # -- parameters ----------------------------------------------------------------------------

    def _on_set_parameters(self, changes):
        """Vets every change against the typed configs before it lands; settings marked live
        apply at once, the others only while unconfigured (they shape what configure builds)."""
        with self._lifecycle_lock:
            return self._apply_parameters(changes)

    def _apply_parameters(self, changes):
        names = {f.name for f in params.ALL_FIELDS}
        try:
            params.read(self, changes)
        except (InvalidConfig, TypeError) as exc:
            return SetParametersResult(successful=False, reason=str(exc))
        fixed = [p.name for p in changes if p.name in names and p.name not in params.LIVE]
        if self.engine is not None and fixed:
            return SetParametersResult(successful=False, reason=(
                f'{fixed} shape what configure builds: deactivate and cleanup the node, set '
                'them, then configure again'))
        if self.config is not None:
            for p in changes:
                if p.name in params.LIVE:
                    self.config[p.name] = p.value
                    if p.name == 'status_period' and self._status_timer is not None:
                        self.destroy_timer(self._status_timer)
                        self._status_timer = self.create_timer(
                            p.value, self._guarded(self.publish_status, 'status'))
        return SetParametersResult(successful=True)

    def _read_config(self):
        """(dict of every setting, policy config, observation layout or None); InvalidConfig
        names the offending parameter."""
        node_cfg, policy_cfg = params.read(self)
        cfg = {**asdict(policy_cfg), **asdict(node_cfg)}

        def need(ok, name, what):
            if not ok:
                raise InvalidConfig(f'parameter {name!r} = {cfg[name]!r}: {what}')

        if policy_cfg.policy_file:
            need(os.path.isfile(policy_cfg.policy_file), 'policy_file', 'no such file')
        device = cfg['device']
        if device == 'auto':
            device = 'cuda' if torch.cuda.is_available() else 'cpu'
        try:
            device = torch.device(device)
        except RuntimeError:
            need(False, 'device', "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        need(device.type in ('cpu', 'cuda'), 'device', "must be 'auto', 'cpu' or 'cuda[:N]'")
        need(device.type != 'cuda' or torch.cuda.is_available(), 'device',
             'CUDA is not available on this machine')
        cfg['device'] = device
        joints = cfg['joint_names']
        if len(set(joints)) != len(joints):
            need(False, 'joint_names', 'names a joint twice')
        layout = None
        if cfg['observation_type'] == 'joint_state':
            need(len(joints) > 0 and cfg['obs_dim'] in (len(joints), 2 * len(joints)),
                 'joint_names', 'joint_state observations need obs_dim == len(joint_names) '
                 '(positions) or 2 * len(joint_names) (positions then velocities)')
            need(len(cfg['action_joint_names']) in (0, cfg['act_dim']), 'action_joint_names',
                 'must be empty or hold act_dim names')
            # the same by-name reading as the terms' joint_pos / joint_vel, unscaled
            terms = [{'name': 'joint_pos', 'offset': [0.0]}] + (
                [{'name': 'joint_vel'}] if cfg['obs_dim'] == 2 * len(joints) else [])
            layout = ObservationLayout(terms, joints, [], cfg['act_dim'])
        elif cfg['observation_type'] == 'terms':
            need(len(joints) == cfg['act_dim'], 'joint_names',
                 f'terms: one joint per action (act_dim {cfg["act_dim"]})')
            need(len(cfg['default_angles']) == len(joints), 'default_angles',
                 'terms: one default angle per joint in joint_names')
            need(len(cfg['action_scale']) in (1, len(joints)), 'action_scale',
                 'terms: one value, or one per joint')
            need(len(cfg['initial_command']) in (0, 3), 'initial_command',
                 'empty or (vx, vy, yaw rate)')
            need(len(cfg['observation_terms']) > 0, 'observation_terms',
                 "observation_type 'terms' needs the ordered term names")
            layout = ObservationLayout(params.term_specs(self, cfg['observation_terms']),
                                       joints, cfg['default_angles'], cfg['act_dim'],
                                       cfg['observation_numerics'])
            need(layout.obs_dim == cfg['obs_dim'], 'obs_dim',
                 f'the observation terms add up to {layout.obs_dim} values')
            need(cfg['control_mode'] == 'timer' or 'joint_state' in layout.needs,
                 'control_mode', 'lockstep steps on each new joint state; these terms read '
                 "none: use 'timer'")
            self.targets = JointTargets(joints, cfg['default_angles'], cfg['action_scale'],
                                        cfg['joint_lower_limits'], cfg['joint_upper_limits'],
                                        cfg['observation_numerics'])
        sessions = cfg['sessions']
        if sessions > 1:
            # count and distinctness: the engine checks them (build_engine)
            names = cfg['session_names'] or [f's{i}' for i in range(sessions)]
            bad = [n for n in names if not re.fullmatch(r'[A-Za-z][A-Za-z0-9_]*', n)]
            need(not bad, 'session_names', f'{bad} are not ROS name tokens (a letter, then '
                 'letters, digits, _): they name each session\'s topic namespace')
            cfg['session_names'] = names
            need(cfg['checkpoint_every'] == 0, 'checkpoint_every', 'periodic checkpoints '
                 'cover one session; with sessions > 1 take per-session capsules')
            need(not cfg['restore_on_start'], 'restore_on_start', 'resumes one session; with '
                 'sessions > 1 load and restore capsules per session')
        else:
            need(not cfg['session_names'], 'session_names', 'names sessions; set sessions')
        if not cfg['capsule_dir']:
            # one directory per node: two robots on one machine never share capsules
            cfg['capsule_dir'] = os.path.join('~', '.ros', 'flashrt_capsules',
                                              self.get_fully_qualified_name().lstrip('/'))
        cfg['capsule_dir'] = os.path.expanduser(cfg['capsule_dir'])
        return cfg, policy_cfg, layout

    # -- lifecycle -----------------------------------------------------------------------------

    def on_configure(self, state):
        with self._lifecycle_lock:
            return self._configure()

    def _log_determinism(self):
        # the engine replays its captured step(s) from one state at construction: a kernel
        # that is not reproducible there would make restores and replays diverge
        verdict = self.engine.determinism
        if verdict.get('deterministic') is False:
            self.get_logger().warning(
                f'the policy step is NOT reproducible run to run on {self.engine.device}: '
                f'{verdict}; restored capsules may not replay the original actions bit for bit')
        elif verdict.get('probed'):
            self.get_logger().info(f'determinism probe: {verdict["replays"]} replays of '
                                   f'{verdict["graphs"]} step graph(s) identical')

    def _configure(self):
        try:
            cfg, policy_cfg, layout = self._read_config()
            self.engine = build_engine(cfg, policy_cfg, layout)
            self.config, self.layout = cfg, layout
            self._log_determinism()
            self._resume(cfg['restore_on_start'])
            self._create_publishers(cfg)
        except Exception as exc:  # noqa: B902 - rclpy would swallow it without a word
            self.get_logger().error(f'configure failed: {exc}')
            self._release_configured()
            return TransitionCallbackReturn.FAILURE
        self._rejected = self._rejected_reported = self._poisoned = 0
        self._dropped, self._dropped_reported, self._last_seq = {}, 0, {}
        self._refusals, self._last_refusal = {}, ''
        self._holding = self._scrub = False
        self._callback_failures = self._failures_reported = 0
        e = self.engine
        self.get_logger().info(
            f'configured: {cfg["policy_type"]} policy on {e.device}, cuda graph '
            f'{"captured" if e.graph_captured else "off (eager)"}, state '
            f'{e.arena.storage.numel()} bytes, capsules in {e.store.directory}')
        self._state = 'inactive'
        return TransitionCallbackReturn.SUCCESS

    @property
    def fleet(self):
        return len(self._io) > 1

    def _create_publishers(self, cfg):
        self._qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=cfg['qos_depth'],
                               reliability=(ReliabilityPolicy.RELIABLE
                                            if cfg['qos_reliability'] == 'reliable'
                                            else ReliabilityPolicy.BEST_EFFORT))
        action_type = JointState if cfg['observation_type'] == 'joint_state' and \
            cfg['action_joint_names'] else Float32MultiArray
        names = self.engine.session_names
        self._io = [SessionIO(i, n, '~/' if len(names) == 1 else f'~/{n}/')
                    for i, n in enumerate(names)]

        def pub(msg_type, topic, qos):
            return self.create_lifecycle_publisher(msg_type, topic, qos,
                                                   event_callbacks=publisher_events())
        for io in self._io:
            io.action_pub = pub(action_type, io.prefix + 'action', self._qos)
            if cfg['observation_type'] == 'terms':
                for output in cfg['command_outputs']:
                    msg_type, topic = {'float64_array': (Float64MultiArray, 'joint_commands'),
                                       'joint_trajectory': (JointTrajectory, 'joint_trajectory')
                                       }[output]
                    io.command_pubs.append(pub(msg_type, io.prefix + topic, self._qos))
        if self.fleet and cfg['observation_type'] == 'float32_array':
            # a farm that assembles its observations: [sessions, obs_dim] in, one tick out
            self._actions_pub = pub(Float32MultiArray, '~/actions', self._qos)
        self._status_pub = pub(fmsg.PolicyStatus, '~/status', 10)
        self._diag_pub = pub(DiagnosticArray, '/diagnostics', 10)

    def on_activate(self, state):
        with self._lifecycle_lock:
            return self._activate(state)

    def _activate(self, state):
        cfg = self.config
        self._activations += 1         # callbacks of an earlier activation go quiet
        sub = self._subscribe
        for io in self._io:
            self._subscribe_session(cfg, io)
        if self._actions_pub is not None:
            sub(Float32MultiArray, '~/observations', self.observations_callback)
        if cfg['observation_type'] == 'terms':
            self._sync_lockstep()
            self._pending_since = None
            if self.fleet and cfg['control_mode'] == 'lockstep':
                self._control_timer = self.create_timer(
                    cfg['lockstep_wait'] / 4,
                    self._guarded(self._lockstep_deadline, 'lock-step deadline'),
                    callback_group=self._obs_group)
            if cfg['control_mode'] == 'timer':
                self._control_timer = self.create_timer(
                    1.0 / cfg['control_rate'], self._guarded(self.control_callback, 'control'),
                    callback_group=self._obs_group)
        self._status_timer = self.create_timer(cfg['status_period'],
                                               self._guarded(self.publish_status, 'status'))
        try:
            # Kept across deactivate/activate; a resumed process keeps the one it loaded.
            if EPISODE_START not in self.engine.store and not self._resumed_from:
                # every session starts from the same initial state: session 0's is it
                result = self.engine.snapshot(EPISODE_START, pin=True, session=0)
                self.get_logger().info(result.message)
                if cfg['checkpoint_to_disk']:
                    self.engine.save(EPISODE_START)
        except FlashRTError as exc:   # e.g. zero budgets: run on, reset uses the initial state
            self.get_logger().warning(f'no {EPISODE_START!r} capsule: {exc}; reset_episode '
                                      'will start from the initial state')
        self._state = 'active'
        return super().on_activate(state)

    def _subscribe_session(self, cfg, io):
        sub, p = self._subscribe, io.prefix
        if cfg['observation_type'] == 'float32_array':
            sub(Float32MultiArray, p + 'observation', partial(self.observation_callback, io=io))
            return
        if cfg['observation_type'] == 'joint_state':
            sub(JointState, p + 'observation', partial(self.observation_callback, io=io))
            return
        io.inputs, io.pending, io.seen = {}, 0, False
        needs = self.layout.needs
        if 'joint_state' in needs:
            sub(JointState, p + 'joint_states', partial(self.joint_state_callback, io=io))
        if 'imu' in needs:
            sub(Imu, p + 'imu', partial(self.imu_callback, io=io))
        if 'command' in needs:
            sub(Twist, p + 'cmd_vel', partial(self.command_callback, io=io))
            if cfg['initial_command']:
                io.inputs['command'] = (tuple(cfg['initial_command']), None, math.inf)
        for term in self.layout.terms:
            if term.type == 'raw':
                sub(Float32MultiArray, f'{p}input/{term.name}',
                    lambda msg, name=term.name: self._store(io, 'raw:' + name, msg.data))

    def _subscribe(self, msg_type, topic, callback):
        def counted(msg, info):
            self._count_lost(topic, info)
            callback(msg)
        guarded = self._guarded(counted, topic)

        def take(msg, info):    # two named parameters: rclpy then passes the message info
            guarded(msg, info)
        self._subs.append(self.create_subscription(msg_type, topic, take, self._qos,
                                                   callback_group=self._obs_group))

    def _guarded(self, callback, what):
        """`callback` as the executor runs it: under the lifecycle lock, only while active and
        only for the activation that made it (a message taken before a cleanup must not step
        the next configure's engine). An exception is logged and counted (diagnostics), never
        raised into the executor: that would end its spin thread, and the node with it."""
        activation = self._activations

        def run(*args):
            with self._lifecycle_lock:
                if not self.active or activation != self._activations:
                    return
                try:
                    callback(*args)
                except Exception as exc:  # noqa: B902 - a callback must never kill the node
                    self._callback_failures += 1
                    self.get_logger().error(
                        f'{what} callback failed and was dropped ({self._callback_failures} '
                        f'since configure): {exc!r}', throttle_duration_sec=1.0)
        return run

    def _count_lost(self, topic, info):
        """Readings lost before this callback (queue overflow, network): the gap in the
        publisher's sequence numbers. A number at or below the last one is a new or
        restarted publisher: a new baseline, nothing counted."""
        seq = info.get('publication_sequence_number')
        if seq is None:
            return              # an rmw without sequence numbers: nothing to count with
        last = self._last_seq.get(topic)
        self._last_seq[topic] = seq
        if last is not None and seq > last + 1:
            self._dropped[topic] = self._dropped.get(topic, 0) + seq - last - 1
            self.get_logger().warning(
                f'{seq - last - 1} readings on {topic} lost before the node saw them '
                f'({sum(self._dropped.values())} since configure): raise qos_depth or lower '
                'the rate', throttle_duration_sec=1.0)

    def on_deactivate(self, state):
        with self._lifecycle_lock:
            self._state = 'inactive'
            self._release_active()
            return super().on_deactivate(state)

    def on_cleanup(self, state):
        with self._lifecycle_lock:
            self._release_active()
            self._release_configured()
            self._state = 'unconfigured'
            return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state):
        with self._lifecycle_lock:
            self._release_active()
            self._release_configured()
            self._state = 'finalized'
            return TransitionCallbackReturn.SUCCESS

    def _release_active(self):
        for sub in self._subs:
            self.destroy_subscription(sub)
        self._subs = []
        for timer in (self._control_timer, self._status_timer):
            if timer is not None:
                self.destroy_timer(timer)
        self._control_timer = self._status_timer = None

    def _release_configured(self):
        pubs = [self._status_pub, self._diag_pub, self._actions_pub]
        for io in self._io:
            pubs += [io.action_pub, *io.command_pubs]
        for pub in pubs:
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        self._status_pub = self._diag_pub = self._actions_pub = None
        self._io = []
        self.engine = self.config = self.layout = self.targets = None   # frees arena, graphs

    @property
    def active(self):
        return self._state == 'active'

    # -- control loop --------------------------------------------------------------------------

    def _refuse(self, reason, level='warning', key=None, counted=False):
        """Counts a refused step under `key` (default: the reason's text before a colon, after
        the session's name in a fleet; diagnostics report the counts) and logs it. counted:
        the engine has counted it."""
        self._rejected += not counted
        parts = reason.split(':')
        # a fleet's reasons start 'session <name>: ': keep the session and the reason's head
        key = key or ':'.join(parts[:2 if reason.startswith('session ') else 1])[:60]
        self._refusals[key] = self._refusals.get(key, 0) + 1
        self._last_refusal = reason
        getattr(self.get_logger(), level)(f'step refused: {reason}', throttle_duration_sec=1.0)

    def _observation_vector(self, msg):
        if isinstance(msg, Float32MultiArray):
            return np.asarray(msg.data, dtype=np.float32) \
                if len(msg.data) else np.zeros(0, np.float32)
        return self.layout.assemble(0, joint_state=(list(msg.name), msg.position,
                                                    msg.velocity))

    def observation_callback(self, msg, io=None):
        """One observation = one committed step (of its session) = one published action."""
        if not self.active or self.engine is None:
            return
        io = io or self._io[0]
        try:
            obs = self._observation_vector(msg)
        except InvalidObservation as exc:
            self._refuse(io.label(self.fleet) + str(exc))
            return
        if self.fleet:
            self._step_fleet({io.index: obs}, {})
        else:
            self._step(obs)

    def observations_callback(self, msg):
        """A farm's tick: [sessions, obs_dim] (row-major) -> ~/actions [sessions, act_dim] and
        each session's ~/<name>/action; a row of NaN skips that session this tick (its
        state is kept; its row of ~/actions is NaN)."""
        if not self.active or self.engine is None:
            return
        n, dim = len(self._io), self.engine.obs_dim
        data = np.asarray(msg.data, dtype=np.float32)
        if data.size != n * dim:
            self._refuse(f'~/observations holds {data.size} values, expected sessions x '
                         f'obs_dim = {n} x {dim}')
            return
        rows = data.reshape(n, dim)
        skip = np.isnan(rows).all(axis=1)
        out = self._step_fleet({i: rows[i] for i in range(n) if not skip[i]}, {})
        actions = np.full((n, self.engine.act_dim), np.nan, dtype=np.float32)
        for i, action in out.items():
            actions[i] = action
        self._actions_pub.publish(action_message(Float32MultiArray, actions.reshape(-1), [],
                                                 None))

    # terms: readings are kept with their stamp and arrival time; steps assemble them
    def _store(self, io, key, value, stamp=None):
        io.inputs[key] = (value, stamp, time.monotonic())

    def joint_state_callback(self, msg, io=None):
        io = io or self._io[0]
        self._store(io, 'joint_state', (list(msg.name), np.asarray(msg.position),
                                        np.asarray(msg.velocity)), _stamp(msg))
        io.seen = True
        self._lockstep(io, 'joint_state')

    def imu_callback(self, msg, io=None):
        io = io or self._io[0]
        o, w = msg.orientation, msg.angular_velocity
        self._store(io, 'imu', ((o.x, o.y, o.z, o.w), (w.x, w.y, w.z)), _stamp(msg))
        self._lockstep(io, 'imu')

    def command_callback(self, msg, io=None):
        self._store(io or self._io[0], 'command', (msg.linear.x, msg.linear.y, msg.angular.z))

    def _lockstep(self, io, key):
        """Simulation: one step per new joint state, once the IMU reading of the same stamp
        (if the terms use one) has arrived too, whichever came second. A fleet steps when
        every session that has had readings (and is not held) has its next ones: one tick
        (a restored session's world re-sends; one that stops is left behind after
        lockstep_wait)."""
        if self.config is None or self.config['control_mode'] != 'lockstep':
            return
        joint = io.inputs.get('joint_state')
        if joint is None:
            return
        tag = _input_tag(joint[1])
        if tag == io.stepped_tag:
            reading = io.inputs[key]
            if reading[1] != joint[1]:
                return              # an IMU reading ahead of the joints: wait for them
            if io.resend:
                io.answered[key] = reading[0]
                self._resend_commands(io)
            elif key in io.answered and not _same_values(io.answered[key], reading[0]):
                # new values under an answered stamp (e.g. a driver that leaves header.stamp
                # at 0): stepping would break the stamp = state rule, so refuse it, audibly
                sec, nanosec = joint[1]
                self._refuse(f'{io.label(self.fleet)}stale stamp: a {key} reading with new '
                             f'values carries stamp {sec}.{nanosec:09d}, already answered; not '
                             'stepped (lock-step steps once per stamp: the driver must stamp '
                             'each reading, header.stamp)')
            return
        if 'imu' in self.layout.needs:
            imu = io.inputs.get('imu')
            if imu is None or imu[1] != joint[1]:
                return              # wait for the matching IMU reading
        io.pending = tag
        waiting = [s for s in self._io if s.seen and not s.held]
        if all(s.pending for s in waiting):
            self._tick_pending()
        elif self._pending_since is None:
            self._pending_since = time.monotonic()

    def _tick_pending(self):
        """Steps every session with complete readings waiting, in one tick."""
        ready = [s for s in self._io if s.pending and not s.held]
        self._pending_since = None
        if not ready:
            return
        tags = {s.index: s.pending for s in ready}
        for s in ready:
            s.stepped_tag, s.resend, s.pending = s.pending, False, 0
            s.answered = {k: s.inputs[k][0] for k in ('joint_state', 'imu') if k in s.inputs}
        self._step_terms(ready, tags)

    def _lockstep_deadline(self):
        """Fleet lock-step: a world that stopped publishing must not stall the others; after
        lockstep_wait the sessions that are ready step without it (the grouping of a tick
        changes no action: each session's row is computed as if alone)."""
        since = self._pending_since
        if since is not None and time.monotonic() - since >= self.config['lockstep_wait']:
            self._tick_pending()

    def _sync_lockstep(self, session=None):
        """After the state changed under the node (restore, reset, rollback, recover, resume at
        start): the readings it answered last are the state's own (the engine's input tag,
        which capsules and checkpoints carry). A world that re-sends those readings (it never
        got their command: the node died or was restored in between) gets the command of the
        state's last action again instead of a second step on the same readings.
        session: only that session's (an index); None: every session's."""
        cfg = self.config
        if self.engine is None or cfg is None or cfg['observation_type'] != 'terms' \
                or cfg['control_mode'] != 'lockstep':
            return
        for io in self._io:
            if session is None or io.index == session:
                io.stepped_tag = self.engine.input_tag(session=io.index)
                io.resend, io.pending, io.answered = True, 0, {}

    def _resend_commands(self, io):
        io.resend = False
        last = self.engine.last_action(session=io.index)
        if last is None:
            self.get_logger().warning(
                f'{io.label(self.fleet)}readings of an already answered stamp arrived after a '
                "restore, and this policy's state keeps no last action to re-send; waiting "
                'for new readings')
            return
        self.get_logger().info(f'{io.label(self.fleet)}readings of the restored state\'s last '
                               'stamp arrived again: re-sending the commands of its last action')
        self._publish_action(io, last)
        self._publish_commands(io, last)

    def control_callback(self):
        """Robot: a step at control_rate over the newest readings; stale or missing ones
        refuse the step (counted, diagnosed) and nothing new is published. A fleet steps the
        sessions whose readings are fresh, in one tick."""
        now, limit = time.monotonic(), self.config['max_input_age']
        keys = sorted(self.layout.needs - {'raw'}) + [
            'raw:' + t.name for t in self.layout.terms if t.type == 'raw']
        ready = []
        for io in self._io:
            for key in keys:
                reading = io.inputs.get(key)
                if reading is None:
                    self._refuse(f'{io.label(self.fleet)}missing input: no {key} received yet')
                    break
                if key != 'command' and now - reading[2] > limit:
                    self._refuse(f'{io.label(self.fleet)}stale input: {key} is '
                                 f'{1e3 * (now - reading[2]):.0f} ms old (max_input_age '
                                 f'{1e3 * limit:.0f} ms)')
                    break
            else:
                ready.append(io)
        if ready:
            self._step_terms(ready, {})

    def _step_terms(self, ios, tags):
        if not self.active or self.engine is None:
            return
        rows = {}
        for io in ios:
            get = io.inputs.get
            raw = {t.name: get('raw:' + t.name, (None,))[0] for t in self.layout.terms
                   if t.type == 'raw'}
            try:
                rows[io.index] = self.layout.assemble(
                    self.engine.session(io.index).step_index,
                    joint_state=get('joint_state', (None,))[0], imu=get('imu', (None,))[0],
                    command=get('command', (None,))[0], raw=raw)
            except InvalidObservation as exc:
                self._refuse(io.label(self.fleet) + str(exc))
        if not rows:
            return
        if self.fleet:
            actions = self._step_fleet(rows, tags)
        else:
            action = self._step(rows[0], tags.get(0))
            actions = {} if action is None else {0: action.numpy()}
        for i, action in actions.items():
            self._publish_commands(self._io[i], action)

    def _publish_action(self, io, action):
        pub = io.action_pub
        stamp = self.get_clock().now().to_msg() if pub.msg_type is JointState else None
        pub.publish(action_message(pub.msg_type, action, self.config['action_joint_names'],
                                   stamp))

    def _publish_commands(self, io, action):
        targets = self.targets(action)
        for pub in io.command_pubs:
            stamp = self.get_clock().now().to_msg() if pub.msg_type is JointTrajectory \
                else None
            pub.publish(command_message(pub.msg_type, targets, self.config['joint_names'],
                                        stamp))

    def _step(self, obs, tag=None):
        """The committed step of a single-session node and the raw action; None (nothing
        published) when refused."""
        engine = self.engine
        if self._holding:
            self._refuse('the state was poisoned (NaN/Inf); call ~/recover, ~/restore or '
                         '~/reset_episode', level='error')
            return None
        try:
            action = engine.step(obs, tag=tag)
        except FlashRTError as exc:
            # the engine counts its own InvalidObservation refusals
            engine_counted = isinstance(exc, InvalidObservation)
            self._refuse(str(exc), key='observation' if engine_counted else None,
                         counted=engine_counted)
            return None
        if self.config['poison_check'] and self._poison(engine, action):
            return None
        self._publish_action(self._io[0], action.numpy())
        every = self.config['checkpoint_every']
        if every and engine.step_index % every == 0:
            self._checkpoint(engine)
        return action

    def _step_fleet(self, rows, tags):
        """One tick of a fleet: rows {session index: obs} step together in one replay; the
        others keep their state. Returns {index: action (numpy)} of the published ones. A bad
        row or a held session is refused alone; a poisoned session is held (its action not
        published) until ~/restore or ~/reset_session gives it a state."""
        engine, dim = self.engine, self.engine.obs_dim
        obs = np.zeros((len(self._io), dim), dtype=np.float32)
        active = np.zeros(len(self._io), dtype=bool)
        for i, row in rows.items():
            io = self._io[i]
            if io.held:
                self._refuse(f'session {io.name}: its state was poisoned (NaN/Inf); restore '
                             'or reset it (~/restore, ~/reset_session)', level='error')
            elif row.shape != (dim,) or not np.isfinite(row).all():
                self._refuse(f'session {io.name}: observation has shape {row.shape} or holds '
                             f'NaN/Inf (expected {dim} finite values)', key='observation')
            else:
                obs[i], active[i] = row, True
        if not active.any():
            return {}
        try:
            actions = engine.step_all(obs, active, [tags.get(i) if active[i] else None
                                                    for i in range(len(self._io))])
        except FlashRTError as exc:
            self._refuse(str(exc))
            return {}
        out = {}
        for i in np.flatnonzero(active):
            io = self._io[i]
            if self.config['poison_check'] and not engine.last_finite[i]:
                io.held = True
                self._poisoned += 1
                self.get_logger().error(f'session {io.name}: poisoned state at step '
                                        f'{engine.session(i).step_index} (NaN/Inf); action not '
                                        'published, session held until restored or reset')
                continue
            out[i] = actions[i].numpy()
            self._publish_action(io, out[i])
        return out

    def rejected_observations(self):
        return self._rejected + self._poisoned + (
            self.engine.rejected_observations if self.engine else 0)

    # -- status and diagnostics ----------------------------------------------------------------

    def status_message(self):
        status = fmsg.PolicyStatus()
        status.header.stamp = self.get_clock().now().to_msg()
        status.state = self._state
        e = self.engine
        if e is None:
            return status
        status.policy = self.config['policy_type'] + (
            f' ({self.config["policy_file"]})' if self.config['policy_file'] else ' (seeded demo)')
        status.device = str(e.device)
        status.cuda_graph = bool(e.graph_captured)
        status.step, status.episode, status.position = e.step_index, e.episode, e.position
        status.rollback_available = e.rollback_available
        p50, p99 = e.step_latency_us()
        status.step_latency_p50_us, status.step_latency_p99_us = p50, p99
        status.capsules = len(e.store.list())
        status.device_bytes_used = e.store.device_bytes_used
        status.device_bytes_budget = e.store.device_budget
        status.host_bytes_used = e.store.host_bytes_used
        status.rejected_observations = self.rejected_observations()
        status.dropped_observations = sum(self._dropped.values())
        sessions = [e.session(i) for i in range(e.sessions)]
        status.sessions = e.sessions
        status.session_names = [s.name for s in sessions]
        status.session_steps = [s.step_index for s in sessions]
        status.session_episodes = [s.episode for s in sessions]
        status.held_sessions = [io.name for io in self._io if io.held]
        return status

    def publish_status(self):
        status = self.status_message()
        self._status_pub.publish(status)
        array_msg = DiagnosticArray()
        array_msg.header.stamp = status.header.stamp
        array_msg.status = [self.diagnostic(status)]
        self._diag_pub.publish(array_msg)

    def diagnostic(self, status):
        """The /diagnostics entry for `status`: WARN when steps were refused since the last
        report, or while checkpoint writes fail; the figures and refusal counts as values."""
        problems = []
        rejected = status.rejected_observations
        if rejected > self._rejected_reported:
            problems.append(f'{rejected - self._rejected_reported} steps refused since last '
                            f'report; last: {self._last_refusal}')
        self._rejected_reported = rejected
        dropped = status.dropped_observations
        if dropped > self._dropped_reported:
            problems.append(f'{dropped - self._dropped_reported} input readings lost before '
                            'the node saw them since last report (' + ', '.join(
                                f'{t}: {n}' for t, n in sorted(self._dropped.items())) + ')')
        self._dropped_reported = dropped
        recovery = self.recovery
        if recovery is not None and recovery.failed_checkpoints:
            problems.append(f'{recovery.failed_checkpoints} checkpoint writes failed; last: '
                            f'{recovery.last_failure}')
        if status.held_sessions:
            problems.append(f'sessions held after a poisoned step: {list(status.held_sessions)}')
        failures = self._callback_failures
        if failures > self._failures_reported:
            problems.append(f'{failures - self._failures_reported} callbacks failed and were '
                            'dropped since last report (the error log names them)')
        self._failures_reported = failures
        determinism = self.engine.determinism if self.engine is not None else {}
        if determinism.get('deterministic') is False:
            problems.append('the policy step is not reproducible run to run (replays '
                            f'differed by up to {determinism.get("max_abs_diff")})')
        diag = DiagnosticStatus(
            level=DiagnosticStatus.WARN if problems else DiagnosticStatus.OK,
            name=f'flashrt_ros: {self.get_name()}', hardware_id=status.device,
            message='; '.join(problems) or f'{status.state}, step {status.step}')
        for field in ('policy', 'cuda_graph', 'step', 'episode', 'position',
                      'rollback_available', 'step_latency_p50_us', 'step_latency_p99_us',
                      'capsules', 'device_bytes_used', 'device_bytes_budget', 'host_bytes_used',
                      'rejected_observations', 'dropped_observations', 'sessions'):
            diag.values.append(KeyValue(key=field, value=str(getattr(status, field))))
        if recovery is not None:
            diag.values.append(KeyValue(key='failed_checkpoints',
                                        value=str(recovery.failed_checkpoints)))
        diag.values.append(KeyValue(key='callback_failures', value=str(failures)))
        diag.values.append(KeyValue(key='deterministic',
                                    value=str(determinism.get('deterministic'))))
        for reason, count in sorted(self._refusals.items()):
            diag.values.append(KeyValue(key=f'refused: {reason}', value=str(count)))
        return diag

    # -- services ------------------------------------------------------------------------------

    def _serve(self, response, operation):
        """Runs a capsule operation; refusals become success=False with the reason. Under the
        lifecycle lock: a transition never clears the engine under an operation."""
        with self._lifecycle_lock:
            return self._serve_locked(response, operation)

    def _serve_locked(self, response, operation):
        if not self.active:
            response.success = False
            response.message = f'node {self.get_name()!r} is {self._state}, not active: ' \
                               'activate it before calling capsule services'
            return response
        try:
            operation()
            response.success = True
        except FlashRTError as exc:
            response.success = False
            response.message = str(exc)
        except Exception as exc:  # noqa: B902 - a service must answer, never crash the node
            self.get_logger().error(f'capsule service failed: {exc!r}')
            response.success = False
            response.message = f'internal error: {exc!r}'
        return response

    def _fill(self, response, result):
        response.message = result.message
        if hasattr(response, 'capsule'):
            response.capsule = capsule_info(result.manifest)
        if hasattr(response, 'latency_us'):
            response.latency_us = float(result.latency_us)

    def _state_changed(self, session, restored=True):
        """After a restore or reset (restored) or a rollback of a session (an index): its
        lock-step bookkeeping follows the state, and a restore or reset ends its poison hold
        (a rollback does not: ~/recover, ~/restore or a reset do, as documented)."""
        if self.fleet:
            io = self._io[session]
            io.held = io.held and not restored
            # its readings answered the old state (the command is a setting, not a reading:
            # kept); its world sends the restored state's readings next
            io.inputs = {k: v for k, v in io.inputs.items() if k == 'command'}
        elif restored:
            self._clear_poison(self.engine)
        self._sync_lockstep(session)

    def snapshot_callback(self, request, response):
        return self._serve(response, lambda: self._fill(response, self.engine.snapshot(
            request.name, overwrite=request.overwrite, pin=request.pin,
            session=request.session)))

    def restore_callback(self, request, response):
        def op():
            session = self.engine.session(request.session).index
            self._fill(response, self.engine.restore(request.name, session=session))
            self._state_changed(session)
        return self._serve(response, op)

    def fork_callback(self, request, response):
        # the session matters only when forking the live state (source '')
        return self._serve(response, lambda: self._fill(response, self.engine.fork(
            request.source, request.target, overwrite=request.overwrite,
            session=request.session if not request.source else 0)))

    def rollback_callback(self, request, response):
        def op():
            session = self.engine.session(request.session).index
            result = self.engine.rollback(int(request.steps), session=session)
            self._fill(response, result)
            response.step = result.step
            self._state_changed(session, restored=False)
        return self._serve(response, op)

    def list_capsules_callback(self, request, response):
        with self._lifecycle_lock:
            return self._list_capsules(response)

    def _list_capsules(self, response):
        engine = self.engine
        if engine is None:
            return response       # unconfigured: no store, nothing to list
        response.capsules = [capsule_info(m) for m in engine.store.list()]
        response.device_bytes_used = engine.store.device_bytes_used
        response.device_bytes_budget = engine.store.device_budget
        response.host_bytes_used = engine.store.host_bytes_used
        response.host_bytes_budget = engine.store.host_budget
        return response

    def delete_capsule_callback(self, request, response):
        return self._serve(response, lambda: self._fill(response,
                                                        self.engine.delete(request.name)))

    def save_capsule_callback(self, request, response):
        def op():
            result = self.engine.save(request.name, request.path)
            self._fill(response, result)
            response.path = result.path
            response.nbytes = result.manifest.nbytes
        return self._serve(response, op)

    def load_capsule_callback(self, request, response):
        return self._serve(response, lambda: self._fill(response, self.engine.load(
            request.path, request.name, overwrite=request.overwrite)))

    def reset_episode_callback(self, request, response):
        """A new episode in every session (a fleet's reset between episodes)."""
        def op():
            results = [self.engine.reset_episode(session=i) for i in range(self.engine.sessions)]
            for i in range(self.engine.sessions):
                self._state_changed(i)
            if len(results) == 1:
                response.message = results[0].message
            else:
                response.message = f'{len(results)} sessions: {results[0].message}; ...; ' \
                    f'{results[-1].message}'
        return self._serve(response, op)

    def reset_session_callback(self, request, response):
        def op():
            session = self.engine.session(request.session).index
            self._fill(response, self.engine.reset_episode(session=session))
            self._state_changed(session)
        return self._serve(response, op)

    def recover_callback(self, request, response):
        """Restores the newest checkpoint that passes validation (finite bytes)."""
        def op():
            if self.fleet:
                raise InvalidConfig('~/recover restores the checkpoints of a single-session '
                                    'node; a fleet restores capsules per session (~/restore, '
                                    '~/reset_session)')
            response.message = self._recover(self.engine)
        return self._serve(response, op)


def _autostart(node):
    """What nav2's lifecycle manager would do: configure, then activate, when `autostart` is
    set. False (a robot without its policy must not look alive) makes main exit 1."""
    if not node.get_parameter('autostart').value:
        return True
    if node.trigger_configure() == TransitionCallbackReturn.SUCCESS and \
            node.trigger_activate() == TransitionCallbackReturn.SUCCESS:
        return True
    node.get_logger().fatal('autostart failed (the reason is logged above); exiting with '
                            'status 1')
    return False


def main(args=None):
    rclpy.init(args=args)
    # A single-threaded executor by default (flashrt_ros/executors.py says why); the callback
    # groups stay, so the node may still be composed into a multi-threaded executor: the
    # engine's lock keeps that correct.
    run(PolicyNode(), startup=_autostart)


if __name__ == '__main__':
    main()
