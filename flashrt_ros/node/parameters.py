'''Parameters of the flashrt_policy node, declared from typed configs (with descriptions and
ranges, so `ros2 param describe` says what is allowed) and read back into them.

Which settings are live (apply at once while configured) and which shape what configure
builds is declared once, on the field (`live=True`); ParameterHandler enforces it.

Policy parameters come from the policy configs (runtime/config.py, one per kind); the node's
own settings from NodeConfig below. Observation terms are declared per term at configure,
under `observation.<term>.<setting>`, since their names come from `observation_terms`.
'''

from dataclasses import dataclass, fields
import math
import os

from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor,
                                ParameterType, SetParametersResult)

from flashrt_ros.runtime.config import check_fields, param
from flashrt_ros.runtime.errors import InvalidConfig
from flashrt_ros.runtime.observation import NUMERICS, TERM_TYPES
from flashrt_ros.runtime.policies import KINDS


@dataclass
class NodeConfig:
    '''The node's own settings (everything but the policy's).'''

    autostart: bool = param(True, 'configure and activate on start; a failure ends the '
                            'process with exit status 1')
    policy_type: str = param('recurrent', 'policy kind', choices=tuple(KINDS))
    device: str = param('auto', "'auto' (cuda when available), 'cpu', 'cuda' or 'cuda:N'")
    cuda_graph: bool = param(True, 'capture the step as a CUDA graph (ignored on CPU)')
    capsule_dir: str = param('', "capsule files; '' = ~/.ros/flashrt_capsules/<node's "
                             'fully qualified name> (one directory per node)')
    device_budget_mb: int = param(1024, 'capsule bytes on the device (LRU moves to host)',
                                  low=0)
    host_budget_mb: int = param(4096, 'capsule bytes in pinned host memory (LRU moves to '
                                'disk)', low=0)
    rollback_depth: int = param(32, 'steps ~/rollback can undo', low=1, high=100000)
    observation_type: str = param(
        'float32_array', 'float32_array: ~/observation holds the vector; joint_state: '
        '~/observation is a JointState in joint_names order; terms: assembled from '
        '~/joint_states, ~/imu, ~/cmd_vel and ~/input/<term> by observation_terms',
        choices=('float32_array', 'joint_state', 'terms'))
    joint_names: list = param([], 'robot joints in action order (joint_state and terms)')
    action_joint_names: list = param([], 'joint_state: publish ~/action as a JointState with '
                                     'these names (empty: Float32MultiArray)')
    observation_terms: list = param([], 'terms: ordered term names; each term is set under '
                                    'observation.<name>.{type,scale,offset,clip,joints,'
                                    f'period,dt,decimation,size,history_length}}; types '
                                    f'{TERM_TYPES}')
    observation_numerics: str = param(
        'float64', 'terms: whose arithmetic the observation and joint targets follow, bit for '
        'bit: float64 (the package default: float64, clip after scale), unitree_rl_gym '
        '(deploy_mujoco.py: float32 list parameters, numpy promotion, float32 targets), '
        'isaaclab (Isaac Lab / unitree_rl_lab: float32, clip before scale, float32 targets); '
        'see docs/runtime.md', choices=NUMERICS)
    default_angles: list = param([], 'terms: default joint angles (rad), one per joint')
    action_scale: list = param([], 'terms: joint target = default_angles + action_scale * '
                               'action (one value or one per joint)')
    joint_lower_limits: list = param([], 'terms: joint targets are clipped to these (empty: '
                                     'no lower clip)')
    joint_upper_limits: list = param([], 'terms: upper clip of the joint targets')
    command_outputs: list = param(
        ['float64_array'], 'terms: joint target outputs: float64_array (~/joint_commands, '
        'for a forward-command position controller), joint_trajectory (~/joint_trajectory)')
    initial_command: list = param([], 'terms: velocity command (vx, vy, yaw rate) used until '
                                  'the first ~/cmd_vel arrives (empty: refuse steps until then)')
    control_mode: str = param(
        'lockstep', 'terms: lockstep (a step per new joint state, with the IMU reading of the '
        'same stamp: simulation) or timer (control_rate Hz over the newest readings: robot)',
        choices=('lockstep', 'timer'))
    control_rate: float = param(50.0, 'timer mode: policy steps per second', low=0.1,
                                high=10000.0)
    max_input_age: float = param(0.1, 'timer mode: readings older than this (s, by arrival) '
                                 'are stale: the step is refused and counted', low=0.0)
    qos_depth: int = param(100, 'subscription and action queue depth', low=1, high=100000)
    qos_reliability: str = param('reliable', 'QoS reliability of observation and action',
                                 choices=('reliable', 'best_effort'))
    control_priority: int = param(
        0, 'the control thread\'s real-time priority (SCHED_FIFO 1-99, as ros2_control\'s '
        'thread_priority); 0: the default scheduler. Needs CAP_SYS_NICE or an rtprio limit '
        '(/etc/security/limits.conf); refused, the node logs it and runs on the default '
        'scheduler', low=0, high=99)
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
    session_names: list = param([], 'sessions > 1: one name per session (a ROS name token: '
                                'topic namespace and service address); empty: s0, s1, ...')
    lockstep_wait: float = param(0.02, 'sessions > 1, lockstep: a tick waits for every '
                                 'session with readings at most this long (s), then steps the '
                                 'ready ones', low=0.001, high=60.0)
    batch_sessions: bool = param(False, 'compute all sessions as one batch (mlp/recurrent '
                                 'weights only): faster, but actions then match a '
                                 'single-session run to float rounding, not bit for bit')
    restore_on_start: str = param('', "'' | latest | a capsule file in capsule_dir, restored "
                                  'at configure so a restarted process resumes')
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
LIVE = {f.name for f in ALL_FIELDS if f.metadata.get('live')}
_TYPES = {bool: ParameterType.PARAMETER_BOOL, int: ParameterType.PARAMETER_INTEGER,
          float: ParameterType.PARAMETER_DOUBLE, str: ParameterType.PARAMETER_STRING}


def _default(f):
    return f.default_factory() if callable(f.default_factory) else f.default


def descriptor(f):
    meta = f.metadata
    d = ParameterDescriptor(description=meta['description'])
    default = _default(f)
    if isinstance(default, list):
        d.dynamic_typing = True       # an empty list has no element type of its own
    else:
        d.type = _TYPES[type(default)]
    if meta.get('choices'):
        d.additional_constraints = 'one of: ' + ', '.join(map(str, meta['choices']))
    if not meta.get('live'):
        extra = 'changes take effect at the next configure (cleanup, set, configure)'
        d.additional_constraints = '; '.join(filter(None, [d.additional_constraints, extra]))
    low, high = meta.get('low'), meta.get('high')
    if isinstance(default, bool) or isinstance(default, list) or (low is None and high is None):
        return d
    if isinstance(default, int):
        d.integer_range = [IntegerRange(from_value=int(low if low is not None else -2**63),
                                        to_value=int(high if high is not None else 2**63 - 1))]
    else:
        d.floating_point_range = [FloatingPointRange(
            from_value=float(low if low is not None else -math.inf),
            to_value=float(high if high is not None else math.inf))]
    return d


def declare(node):
    for f in ALL_FIELDS:
        node.declare_parameter(f.name, _default(f), descriptor(f))


def build(values):
    '''(NodeConfig, policy config) from a {name: value} dict; InvalidConfig names the
    parameter.'''
    node_names = {f.name for f in fields(NodeConfig)}
    for f in ALL_FIELDS:
        want, value = type(_default(f)), values[f.name]
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            values[f.name] = value = float(value)
        if want is list:
            if not isinstance(value, list):
                raise InvalidConfig(f'parameter {f.name!r} = {value!r}: must be a list')
        elif not isinstance(value, want):
            raise InvalidConfig(f'parameter {f.name!r} = {value!r}: must be a '
                                f'{want.__name__}')
    for name in ('joint_names', 'action_joint_names', 'observation_terms', 'command_outputs',
                 'session_names'):
        if not all(isinstance(v, str) and v for v in values[name]):
            raise InvalidConfig(f'parameter {name!r} = {values[name]!r}: must be a list of '
                                'non-empty strings')
    for name in ('default_angles', 'action_scale', 'joint_lower_limits', 'joint_upper_limits',
                 'initial_command'):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                   for v in values[name]):
            raise InvalidConfig(f'parameter {name!r} = {values[name]!r}: must be a list of '
                                'numbers')
        values[name] = [float(v) for v in values[name]]
    node = NodeConfig(**{k: v for k, v in values.items() if k in node_names})
    config_cls = KINDS[node.policy_type][1]
    policy = config_cls(**{f.name: values[f.name] for f in fields(config_cls)})
    if policy.policy_file:
        policy.policy_file = os.path.expanduser(policy.policy_file)
    bad = [o for o in node.command_outputs if o not in ('float64_array', 'joint_trajectory')]
    if bad:
        raise InvalidConfig(f"parameter 'command_outputs': unknown outputs {bad}; "
                            'float64_array, joint_trajectory')
    return node, policy


def read(node, changes=()):
    '''NodeConfig and policy config from the node's parameters, with `changes` (rclpy
    Parameters about to be set) applied: what the set-parameters callback vets.'''
    values = {f.name: node.get_parameter(f.name).value for f in ALL_FIELDS}
    values.update((p.name, p.value) for p in changes if p.name in values)
    return build({k: list(v) if isinstance(v, (list, tuple)) else v
                  for k, v in values.items()})


TERM_SETTINGS = {'type': '', 'scale': [1.0], 'offset': [0.0], 'clip': [0.0], 'joints': [''],
                 'period': 0.0, 'dt': 0.0, 'decimation': 1, 'size': 0, 'history_length': 1}
_TERM_HELP = {'type': f'term type (default: the term name): one of {TERM_TYPES}',
              'scale': 'multiplies (x - offset): one value or one per element (unitree_rl_gym '
                       'numerics: one value is a Python float, a list float32, as there)',
              'offset': 'subtracted before scaling (joint_pos: the default angles if unset)',
              'clip': '[limit] or [low, high] after scaling (before it with isaaclab '
                      'numerics); [0.0] = no clip',
              'joints': "joint_pos/joint_vel: joints in order; [''] = joint_names",
              'period': 'phase: gait period (s)',
              'dt': 'phase: seconds per counter tick (per policy step when decimation is 1)',
              'decimation': 'phase: counter ticks per policy step (the deploy loop counts '
                            'simulation steps: t = ((step + 1) * decimation) * dt)',
              'size': 'raw: number of values',
              'history_length': "the term's last N readings in the policy input, oldest "
                                'first, filled with the first reading after a reset (Isaac '
                                'Lab); 1 = none'}


def term_specs(node, names):
    '''observation.<name>.<setting> parameters -> term dicts for ObservationLayout. Declared
    here (with typed defaults, so `ros2 param dump` shows them) on first use.'''
    specs = []
    for name in names:
        spec = {'name': name}
        for key, default in TERM_SETTINGS.items():
            full = f'observation.{name}.{key}'
            if not node.has_parameter(full):
                node.declare_parameter(full, default,
                                       ParameterDescriptor(description=_TERM_HELP[key]))
            value = node.get_parameter(full).value
            if isinstance(value, (list, tuple)):
                value = list(value)
            if value == default or (key == 'clip' and value == [0.0]):
                continue            # unset: the term's own default applies
            spec[key] = value
        specs.append(spec)
    return specs


class ParameterHandler:
    '''The node's parameters (nav2's ParameterHandler pattern): declares them, vets every
    change against the typed configs before it lands, and applies live ones to the
    configured settings, calling the update callback registered for that name.

    Changes to settings that shape what configure builds are refused while configured, with
    what to do instead. `lock` is held while vetting, as transitions hold it: a change never
    lands in the middle of a configure.
    '''

    def __init__(self, node, lock):
        declare(node)
        self._node, self._lock = node, lock
        self.settings = None           # the configured Settings (settings.py); None if not
        self._updates = {}             # live name -> callback(value)
        node.add_on_set_parameters_callback(self._vet)

    def on_update(self, name, callback):
        '''callback(value) runs when the live parameter `name` changes while configured.'''
        assert name in LIVE, name
        self._updates[name] = callback

    def _vet(self, changes):
        with self._lock:
            try:
                read(self._node, changes)
            except (InvalidConfig, TypeError) as exc:
                return SetParametersResult(successful=False, reason=str(exc))
            settings = self.settings
            if settings is None:
                return SetParametersResult(successful=True)
            names = {f.name for f in ALL_FIELDS}
            fixed = [p.name for p in changes if p.name in names and p.name not in LIVE]
            if fixed:
                return SetParametersResult(successful=False, reason=(
                    f'{fixed} shape what configure builds: deactivate and cleanup the node, '
                    'set them, then configure again'))
            for p in changes:
                if p.name in LIVE:
                    setattr(settings.node, p.name, p.value)
                    if p.name in self._updates:
                        self._updates[p.name](p.value)
            return SetParametersResult(successful=True)
