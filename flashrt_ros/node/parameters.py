'''Parameters of the flashrt_policy node, declared from typed configs (with their true types,
descriptions and ranges, so `ros2 param describe` says what is allowed) and read back into
them. Which settings are live (apply at once while configured) and which shape what configure
builds is declared once, on the field (`live=True`); ParameterHandler enforces it.

Policy parameters come from the policy configs (runtime/config.py, one per kind); the node's own
settings from NodeConfig below. A field's annotation is its parameter type (parameter_types.py).
Observation terms are declared per term at configure, under `observation.<term>.<setting>`, since
their names come from `observation_terms` (term_parameters.py).
'''

import array
from dataclasses import dataclass, fields
from functools import partial
import os

from rcl_interfaces.msg import ParameterType, SetParametersResult

from flashrt_ros.node import term_parameters
from flashrt_ros.node.parameter_types import as_type, coerce, descriptor, WHAT, wire_type
from flashrt_ros.node.parameter_types import declare as declare_typed
# settings.py reads the term dicts through this module
from flashrt_ros.node.term_parameters import term_specs  # noqa: F401
from flashrt_ros.runtime.config import check_field, check_fields, param
from flashrt_ros.runtime.errors import InvalidConfig
from flashrt_ros.runtime.observation import NUMERICS, TERM_TYPES
from flashrt_ros.runtime.policies import KINDS, option_kinds


@dataclass
class NodeConfig:
    '''The node's own settings (everything but the policy's).'''

    autostart: bool = param(True, 'configure and activate on start; a failure ends the '
                            'process with exit status 1')
    policy_bundle: str = param('', 'a training run to deploy as it comes: an Isaac Lab / '
                               'unitree_rl_lab run folder (params/deploy.yaml + exported/'
                               'policy.onnx) or a unitree_rl_gym deploy config (+ its policy '
                               'and MJCF beside it). At configure it sets every parameter it '
                               'derives (policy, terms, scales, history, joints, defaults, '
                               'action scale, control rate) that was not set by the user, and '
                               'logs the table; see runtime/bundles.py')
    robot_joint_names: list[str] = param([], "policy_bundle: the robot's joints in its own "
                                         '(motor, joint_ids_map) order, for bundles that name '
                                         'none (Isaac Lab deploy.yaml)')
    policy_type: str = param('recurrent', 'policy kind', choices=tuple(KINDS))
    device: str = param('auto', "'auto' (cuda when available), 'cpu', 'cuda' or 'cuda:N'")
    cuda_graph: bool = param(True, 'capture the step as a CUDA graph (ignored on CPU)')
    capsule_dir: str = param('', "capsule files; '' = $ROS_HOME/flashrt_capsules/<node's "
                             'fully qualified name> (ROS_HOME default ~/.ros; one directory '
                             'per node)')
    device_budget_mb: int = param(1024, 'capsule bytes on the device (LRU moves to host)',
                                  low=0)
    host_budget_mb: int = param(4096, 'capsule bytes in pinned host memory (LRU moves to '
                                'disk)', low=0)
    rollback_depth: int = param(32, 'steps ~/rollback can undo', low=1, high=100000)
    observation_type: str = param(
        'float32_array', 'float32_array: ~/observation holds the vector; joint_state: '
        '~/observation is a JointState in joint_names order; terms: assembled from '
        'joint_states, imu, cmd_vel (relative names) and ~/input/<term> by '
        'observation_terms; cameras (a LeRobot checkpoint): assembled on the device from '
        'camera_topics, joint_states (the state: joint_names) and the instruction',
        choices=('float32_array', 'joint_state', 'terms', 'cameras'))
    joint_names: list[str] = param([], 'robot joints in action order (joint_state and '
                                   'terms); cameras: the joints of the state, in its order')
    joint_scale: list[float] = param([], "cameras: the checkpoint's units per ROS unit, one "
                                     'per joint of joint_names (LeRobot\'s arm drivers record '
                                     'degrees, or -100..100 by calibration): the state is '
                                     '(position - joint_offset) * joint_scale, an action of '
                                     'action_joint_names goes out as value / joint_scale + '
                                     'joint_offset; empty: the checkpoint reads ROS units')
    joint_offset: list[float] = param([], "cameras: each joint's ROS position that is the "
                                      "checkpoint's 0 (joint_scale); empty: 0")
    camera_topics: list[str] = param([], "cameras: one 'feature key=topic' per camera of the "
                                     "checkpoint ('observation.images.top=/camera/image_raw'),"
                                     ' a sensor_msgs/Image; sessions > 1: relative, per robot')
    compressed_cameras: list[str] = param([], 'cameras: feature keys whose topic is a '
                                          'sensor_msgs/CompressedImage (JPEG, PNG)')
    camera_sync: str = param('newest', "cameras, lockstep: each camera's newest frame, or "
                             "(stamp) its frame of the joint state's stamp",
                             choices=('newest', 'stamp'))
    instruction: str = param('', 'cameras, a language policy: the instruction, also while '
                             'running (as one on ~/instruction, std_msgs/String, is; empty too); '
                             'empty at configure: steps wait for one', live=True)
    action_joint_names: list[str] = param([], 'joint_state: publish ~/action as a JointState '
                                          'with these names (empty: Float32MultiArray); '
                                          'LeRobot kinds: the joints of ~/action_chunk and, '
                                          'on cameras, of the command outputs')
    observation_terms: list[str] = param([], 'terms: ordered term names; each term is set '
                                         'under observation.<name>.{type,scale,offset,clip,'
                                         'joints,period,dt,decimation,size,history_length}; '
                                         f'types {TERM_TYPES}')
    observation_numerics: str = param(
        'float64', 'terms: whose arithmetic the observation and joint targets follow, bit for '
        'bit: float64 (the package default: float64, clip after scale), unitree_rl_gym '
        '(deploy_mujoco.py: float32 list parameters, numpy promotion, float32 targets), '
        'isaaclab (Isaac Lab / unitree_rl_lab: float32, clip before scale, float32 targets); '
        'see docs/runtime.md', choices=NUMERICS)
    default_angles: list[float] = param([], 'terms: default joint angles (rad), one per '
                                        'joint')
    action_scale: list[float] = param([], 'terms: joint target = default_angles + '
                                      'action_scale * action (one value or one per joint)')
    joint_lower_limits: list[float] = param([], 'terms: joint targets are clipped to these '
                                            '(empty: no lower clip)')
    joint_upper_limits: list[float] = param([], 'terms: upper clip of the joint targets')
    command_outputs: list[str] = param(
        ['float64_array'], 'terms (and cameras with action_joint_names: each action, in ROS '
        'units, in their order): joint target outputs: float64_array (~/joint_commands, '
        'for a forward-command position controller), joint_trajectory (~/joint_trajectory, '
        'for a JointTrajectoryController: zero stamp, one point one control period ahead)')
    initial_command: list[float] = param([], 'terms: velocity command (vx, vy, yaw rate) used '
                                         'until the first cmd_vel arrives (empty: refuse '
                                         'steps until then)')
    control_mode: str = param(
        'lockstep', 'terms, cameras: lockstep (a step per new joint state, with the IMU '
        'reading of the same stamp, or the newest camera frames: simulation) or timer '
        '(control_rate Hz over the newest readings: robot)',
        choices=('lockstep', 'timer'))
    control_rate: float = param(50.0, 'timer mode: policy steps per second', low=0.1,
                                high=10000.0)
    chunk_period: float = param(0.0, 'smolvla, act, diffusion with action_joint_names: seconds '
                                'between the points of ~/action_chunk (0: 1 / control_rate)',
                                low=0.0)
    max_input_age: float = param(0.1, 'timer mode: readings older than this (s, by arrival) '
                                 'are stale: the step is refused and counted; cameras, '
                                 'lockstep (newest): a joint state stamped this much after '
                                 "a camera's newest frame is refused alike", low=0.0)
    qos_depth: int = param(100, 'subscription and action queue depth', low=1, high=100000)
    qos_reliability: str = param('reliable', 'QoS reliability of the inputs and ~/action '
                                 '(joint commands are always reliable, as controllers expect)',
                                 choices=('reliable', 'best_effort'))
    control_priority: int = param(
        0, 'the control thread\'s real-time priority (SCHED_FIFO 1-99, as ros2_control\'s '
        'thread_priority); 0: the default scheduler. Needs CAP_SYS_NICE or an rtprio limit '
        '(/etc/security/limits.conf); refused, the node logs it and runs on the default '
        'scheduler', low=0, high=99)
    process_priority: int = param(
        0, 'every thread of the node process under SCHED_FIFO at this priority (1-99; set '
        'control_priority above it), from the first activate: on a saturated machine a service '
        'thread preempted while it holds the GIL would stall the control thread; 0: the '
        'default scheduler. Needs CAP_SYS_NICE or an rtprio limit', low=0, high=99)
    status_period: float = param(1.0, 'seconds between ~/status and /diagnostics messages',
                                 low=0.01, high=3600.0, live=True)
    checkpoint_every: int = param(0, 'a host-tier checkpoint capsule every N steps (0: off)',
                                  low=0, live=True)
    checkpoint_keep: int = param(3, 'newest checkpoints kept', low=1, high=1000, live=True)
    checkpoint_to_disk: bool = param(False, 'also write checkpoints to capsule_dir',
                                     live=True)
    poison_check: bool = param(True, 'never publish an action, or keep a state, holding '
                               'NaN/Inf', live=True)
    on_poison: str = param('recover', 'recover: restore the newest valid checkpoint; hold: '
                           'publish nothing until ~/recover, ~/restore or ~/reset_episode',
                           choices=('recover', 'hold'), live=True)
    sessions: int = param(1, 'policy states (robots) served by this node, stepped together '
                          'in one graph replay per tick; more than 1: topics per session under '
                          '~/<session name>/ and a session field in the capsule services',
                          low=1, high=4096)
    session_names: list[str] = param([], 'sessions > 1: one name per session (a ROS name '
                                     'token: topic namespace and service address); empty: '
                                     's0, s1, ...')
    lockstep_wait: float = param(0.02, 'sessions > 1, lockstep: a tick waits for every '
                                 'session with readings at most this long (s), then steps the '
                                 'ready ones', low=0.001, high=60.0)
    batch_sessions: bool = param(False, 'compute all sessions as one batch (mlp/recurrent '
                                 'weights only): faster, but actions then match a '
                                 'single-session run to float rounding, not bit for bit')
    kernels: str = param('default', "default: the exporter's kernels (cuBLAS, cuDNN, MKL); "
                         'batch_invariant: each session computed as if alone (mlp/recurrent '
                         'weights only), so sessions step as one batch and stay bit for bit a '
                         'single-session node on the same kernels. Part of the model digest',
                         choices=('default', 'batch_invariant'))
    restore_on_start: str = param('', "'' | latest | a capsule file in capsule_dir, restored "
                                  'at configure so a restarted process resumes')
    safety: list[str] = param([], "terms: the safety supervisor, entries 'detector:response'"
                              ' (detectors tilt, joint_position, joint_velocity, action_rate; '
                              'responses hold, ramp, rollback); empty: off. See '
                              'runtime/safety.py')
    safety_max_tilt: float = param(0.8, 'tilt detector: the base tilt (rad) from the IMU '
                                   'orientation that trips it', low=0.0, high=3.1416)
    safety_joint_margin: float = param(0.0, 'joint_position detector: rad beyond '
                                       'joint_lower_limits / joint_upper_limits', low=0.0)
    safety_model_file: str = param('', 'joint_position detector: an MJCF or URDF file whose '
                                   'joint ranges are the limits (where joint_lower_limits / '
                                   'joint_upper_limits are not set)')
    safety_max_joint_velocity: list[float] = param([], 'joint_velocity detector: rad/s, one '
                                                   'value or one per joint')
    safety_max_action_rate: float = param(0.0, 'action_rate detector: the largest change of '
                                          'an action value in one step', low=0.0)
    safety_safe_every: int = param(10, 'a safe capsule every N steps without a trip',
                                   low=1, high=100000)
    safety_safe_keep: int = param(4, 'safe capsules kept (rollback goes one further back per '
                                  'trip in a row)', low=1, high=1000)
    safety_max_rollbacks: int = param(3, 'rollbacks in a row before the supervisor holds',
                                      low=0, high=1000)
    safety_ramp_time: float = param(1.0, 'ramp response: seconds from the last safe targets '
                                    'to default_angles', low=0.0)
    safety_startup_ramp: float = param(0.0, 'seconds over which the published targets fade '
                                       "from the joints' first reading to the policy's (0: "
                                       'none)', low=0.0)
    signing_key_file: str = param('', 'file holding an HMAC key (>= 16 bytes): capsule files '
                                  'are signed on save and must carry a valid signature to '
                                  "load ('' = checksums only; see docs/runtime.md)")

    def __post_init__(self):
        check_fields(self)


def _policy_fields():
    '''Every policy kind's fields, once each (the same name means the same thing).'''
    seen = {}
    for _, config_cls in KINDS.values():
        for f in fields(config_cls):
            seen.setdefault(f.name, f)
    return list(seen.values())


ALL_FIELDS = fields(NodeConfig) + tuple(_policy_fields())
FIELDS = {f.name: f for f in ALL_FIELDS}
LIVE = {f.name for f in ALL_FIELDS if f.metadata.get('live')}
_OUTPUTS = ('float64_array', 'joint_trajectory')


def _default(f):
    return f.default_factory() if callable(f.default_factory) else f.default


def declare(node):
    for f in ALL_FIELDS:
        declare_typed(node, f.name, wire_type(f.type), _default(f), descriptor(f))


def value_of(f, value):
    '''`value` of field `f` as its config holds it (an int where a float is meant is that
    float; any sequence is a list); InvalidConfig names the parameter when it is not one.'''
    kind = wire_type(f.type)
    converted = as_type(kind, value)
    if kind == ParameterType.PARAMETER_STRING_ARRAY and converted is not None and \
            not all(converted):
        converted = None        # names: an empty one names nothing
    if converted is None:
        shown = list(value) if isinstance(value, (tuple, array.array)) else value
        what = WHAT[kind].replace('strings', 'non-empty strings')
        raise InvalidConfig(f'parameter {f.name!r} = {shown!r}: must be {what}')
    return converted


def check(name, value):
    '''One field parameter's value, converted and checked on its own (type, range, choices);
    InvalidConfig names it. What spans parameters is checked at configure (settings.py).'''
    f = FIELDS[name]
    value = value_of(f, value)
    check_field(f, value)
    bad = [o for o in value if o not in _OUTPUTS] if name == 'command_outputs' else []
    if bad:
        raise InvalidConfig(f"parameter 'command_outputs': unknown outputs {bad}; "
                            f'{", ".join(_OUTPUTS)}')
    return value


def build(values):
    '''(NodeConfig, policy config) from a {name: value} dict; InvalidConfig names the
    parameter.'''
    values = {f.name: value_of(f, values[f.name]) for f in ALL_FIELDS}
    check('command_outputs', values['command_outputs'])
    node = NodeConfig(**{f.name: values[f.name] for f in fields(NodeConfig)})
    config_cls = KINDS[node.policy_type][1]
    # a checkpoint option (real-time chunking, vision_dtype) set for a kind without it would
    # be ignored, and the user would run other actions than asked for
    for name, takes in sorted(option_kinds().items()):
        if node.policy_type not in takes and values[name] != _default(FIELDS[name]):
            raise InvalidConfig(f'parameter {name!r} is an option of {" / ".join(takes)}; '
                                f'policy_type is {node.policy_type}')
    policy = config_cls(**{f.name: values[f.name] for f in fields(config_cls)})
    if policy.policy_file:
        policy.policy_file = os.path.expanduser(policy.policy_file)
    return node, policy


def read(node):
    '''NodeConfig and policy config from the node's parameters.'''
    return build({f.name: node.get_parameter(f.name).value for f in ALL_FIELDS})


class ParameterHandler:
    '''The node's parameters (nav2's ParameterHandler pattern): declares them with their true
    types, converts what a set sends to them, vets every change before it lands, and applies
    live ones to the configured settings, calling the update callback registered for that
    name.

    One rule: a setting marked live on its field applies at once while configured; every
    other one, observation.<term>.* included, shapes what configure builds and is refused
    while configured, with what to do instead. Every value is checked when set, on its own:
    an invalid one is refused naming the parameter, configured or not. `lock` is held while
    vetting, as transitions hold it: a change never lands in the middle of a configure.
    '''

    def __init__(self, node, lock):
        declare(node)
        self._node, self._lock = node, lock
        self.settings = None           # the configured Settings (settings.py); None if not
        self._updates = {}             # live name -> callback(value)
        # what the user set after start (a policy bundle's value never replaces it); the
        # bundle's own sets are made with `applying` true
        self.user_set, self.applying = set(), False
        node.add_pre_set_parameters_callback(partial(coerce, node))
        node.add_on_set_parameters_callback(self._vet)

    def on_update(self, name, callback):
        '''callback(value) runs when the live parameter `name` changes while configured.'''
        assert name in LIVE, name
        self._updates[name] = callback

    def _declaring(self, name):
        # a term setting declared at configure: its override or default, checked by the
        # configure itself, so that a bad one stays declared and can be set right
        node = self._node
        return not node.has_parameter(name) or \
            node.get_parameter_type(name) == ParameterType.PARAMETER_NOT_SET

    def _vet(self, changes):
        with self._lock:
            changes = [p for p in changes if not self._declaring(p.name)]
            if not self.applying:
                self.user_set.update(p.name for p in changes)
            try:
                updates = {p.name: check(p.name, p.value) for p in changes
                           if p.name in FIELDS}
                term_parameters.check(self._node, {p.name: p.value for p in changes
                                                   if term_parameters.split(p.name)},
                                      self.settings)
            except InvalidConfig as exc:
                return SetParametersResult(successful=False, reason=str(exc))
            settings = self.settings
            if settings is None:
                return SetParametersResult(successful=True)
            fixed = [p.name for p in changes if (p.name in FIELDS and p.name not in LIVE) or
                     term_parameters.split(p.name)]
            if fixed:
                return SetParametersResult(successful=False, reason=(
                    f'{fixed} shape what configure builds: deactivate and cleanup the node, '
                    'set them, then configure again'))
            if updates.get('instruction') and not (settings.cameras and
                                                   settings.cameras.tokens):
                return SetParametersResult(successful=False, reason=(
                    "'instruction': observation_type cameras and a checkpoint that takes one "
                    f'only (this {settings.node.policy_type} node: no instruction reaches '
                    'its policy)'))
            for name, value in updates.items():
                setattr(settings.node, name, value)
                if name in self._updates:
                    self._updates[name](value)
            return SetParametersResult(successful=True)
