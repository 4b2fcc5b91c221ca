'''Observation assembly from robot readings, and joint targets from actions (no ROS here).

An observation is an ordered list of terms (as in Isaac Lab's observation groups, Unitree's
deploy scripts, rl_sar), each `(x - offset) * scale` clipped, over plain arrays, stored as
float32. `numerics` names the deploy loop whose dtypes and order of operations the arithmetic
follows, so the same readings give that loop's observation bit for bit (NUMERICS below; the
table is in docs/runtime.md). Term types:

  joint_pos          joint positions by name, offset defaults to the default angles
  joint_vel          joint velocities by name
  base_ang_vel       IMU angular velocity (base frame)                      [3]
  projected_gravity  gravity in the base frame from the IMU orientation     [3]
  command            velocity command (vx, vy, yaw rate) from a Twist       [3]
  last_action        the previous raw action: filled on the device from the arena
  phase              sin, cos of 2 pi frac(t / period), t = ((step + 1) * decimation) * dt:
                     the deploy loop's counter of simulation steps times their dt       [2]
  raw                any vector, given by the caller under the term's name

Per-term history (Isaac Lab's `history_length`): a term with history_length N > 1 enters the
policy input as its last N readings, oldest first, filled with the first reading after a
reset; the policy wrapper (policies.TermHistory) keeps them in the arena. A reading holding
NaN/Inf is refused before any clip can hide it.

State: the last action lives in the arena ('last_action', written inside the step) and the
phase is a function of the engine's step counter (meta, in the arena). A restore or an episode
reset therefore reproduces the next observation, and with it the next action, exactly.
'''

from dataclasses import dataclass
import math

import numpy as np

from .errors import InvalidConfig, InvalidObservation

# How the origin's deploy loop computes each term (docs/runtime.md, 'Observation numerics'):
#   float64         parameters and arithmetic float64, clip after scale, one rounding to
#                   float32 at the end (this package's own choice, the default)
#   unitree_rl_gym  deploy_mujoco.py: list parameters (default angles, cmd_scale, the command)
#                   are float32 arrays, single scales Python floats; readings float64; numpy
#                   promotion decides each operation's dtype; clip after scale; phase from
#                   the simulation-step counter with np.sin / np.cos; targets in float32
#   isaaclab        ObservationManager / unitree_rl_lab's C++ deploy: readings, parameters and
#                   arithmetic float32, clip before scale; targets in float32
NUMERICS = ('float64', 'unitree_rl_gym', 'isaaclab')

TERM_TYPES = ('joint_pos', 'joint_vel', 'base_ang_vel', 'projected_gravity', 'command',
              'last_action', 'phase', 'raw')
# which reading each term type needs
NEEDS = {'joint_pos': 'joint_state', 'joint_vel': 'joint_state', 'base_ang_vel': 'imu',
         'projected_gravity': 'imu', 'command': 'command', 'last_action': None,
         'phase': None, 'raw': 'raw'}


@dataclass
class Term:
    name: str
    type: str
    size: int
    scale: np.ndarray       # float64 [size]
    offset: np.ndarray      # float64 [size]
    clip: tuple             # (low, high) or None
    period: float = 0.0     # phase
    dt: float = 0.0         # phase: seconds per counter tick
    decimation: int = 1     # phase: counter ticks per policy step
    history: int = 1        # frames of this term in the policy input (1: no history)
    start: int = 0          # slice of the observation vector
    joints: list = None     # joint_pos / joint_vel: joint names in term order


def projected_gravity(q_wxyz):
    '''Unit gravity (0, 0, -1) of the world expressed in the base frame: R(q)^T g.'''
    w, x, y, z = q_wxyz
    return np.array([2.0 * (-z * x + w * y), -2.0 * (z * y + w * x),
                     1.0 - 2.0 * (w * w + z * z)])


def _vector(value, size, what, default):
    if value is None or (hasattr(value, '__len__') and len(value) == 0):
        return np.full(size, default, dtype=np.float64)
    a = np.asarray(value, dtype=np.float64).reshape(-1)
    if a.size == 1:
        return np.full(size, a[0])
    if a.size != size:
        raise InvalidConfig(f'{what}: {a.size} values for a term of size {size}')
    return a


def _numerics(numerics):
    if numerics not in NUMERICS:
        raise InvalidConfig(f'observation_numerics {numerics!r}: one of {NUMERICS}')
    return numerics


def _as_origin(value, vector, numerics):
    '''A float64 parameter vector in the origin's dtype. unitree_rl_gym reads a YAML list
    with np.array(..., dtype=np.float32) and leaves a single value a Python float (numpy then
    computes in the other operand's dtype); Isaac Lab holds every parameter as float32.'''
    if numerics == 'isaaclab' or (numerics == 'unitree_rl_gym' and len(value or ()) > 1):
        return vector.astype(np.float32)
    if numerics == 'unitree_rl_gym':
        return float(vector[0])
    return vector


class ObservationLayout:
    '''Terms in order -> one float32 observation vector.

    joint_names: the robot's joints in action order (also the joint_pos/joint_vel default
    order); default_angles: one per joint; act_dim: the last_action term's size.
    term dicts: {'name', 'type' (default: name), 'scale', 'offset', 'clip', 'joints',
    'period', 'dt', 'decimation', 'size' (raw only), 'history_length'}. numerics: one of
    NUMERICS (module notes).
    '''

    def __init__(self, terms, joint_names, default_angles, act_dim, numerics='float64'):
        if len(set(joint_names)) != len(joint_names):
            raise InvalidConfig(f'joint_names holds duplicates: {list(joint_names)}')
        self.numerics = _numerics(numerics)
        self.joint_names = list(joint_names)
        self.default_angles = _vector(default_angles, len(self.joint_names),
                                      'default_angles', 0.0)
        self.terms, start = [], 0
        for spec in terms:
            term = self._term(dict(spec), act_dim)
            term.start = start
            start += term.size
            self.terms.append(term)
        if not self.terms:
            raise InvalidConfig('observation terms: the list is empty')
        names = [t.name for t in self.terms]
        if len(set(names)) != len(names):
            raise InvalidConfig(f'observation terms: duplicate names in {names}')
        self.obs_dim = start
        self.needs = {NEEDS[t.type] for t in self.terms} - {None}
        self._last_action_term = next((t for t in self.terms if t.type == 'last_action'), None)

    def term_history(self):
        '''[(size, history_length)] per term in order, or None when no term keeps history:
        what policies.make_policy(term_history=...) stacks into the policy input.'''
        if all(t.history == 1 for t in self.terms):
            return None
        return [(t.size, t.history) for t in self.terms]

    def _term(self, spec, act_dim):
        name = spec.pop('name')
        kind = spec.pop('type', '') or name
        if kind not in TERM_TYPES:
            raise InvalidConfig(f'observation term {name!r}: type {kind!r} is not one of '
                                f'{TERM_TYPES}')
        joints = list(spec.pop('joints', []) or [])
        if kind in ('joint_pos', 'joint_vel'):
            joints = joints or self.joint_names
            unknown = [j for j in joints if j not in self.joint_names]
            if unknown:
                raise InvalidConfig(f'observation term {name!r}: joints {unknown} are not in '
                                    'joint_names')
            if len(set(joints)) != len(joints):
                raise InvalidConfig(f'observation term {name!r}: duplicate joints {joints}')
        size = {'joint_pos': len(joints), 'joint_vel': len(joints), 'base_ang_vel': 3,
                'projected_gravity': 3, 'command': 3, 'last_action': act_dim, 'phase': 2,
                'raw': int(spec.pop('size', 0) or 0)}[kind]
        if size < 1:
            raise InvalidConfig(f'observation term {name!r}: a raw term needs size >= 1')
        offset = spec.pop('offset', None)
        if kind == 'joint_pos' and (offset is None or len(offset) == 0):
            offset = [self.default_angles[self.joint_names.index(j)] for j in joints]
        scale = spec.pop('scale', None)
        clip = spec.pop('clip', None)
        if clip is not None and len(clip):
            clip = (-abs(clip[0]), abs(clip[0])) if len(clip) == 1 else tuple(clip)
            if len(clip) != 2 or clip[0] > clip[1]:
                raise InvalidConfig(f'observation term {name!r}: clip must be [limit] or '
                                    f'[low, high], got {list(clip)}')
        else:
            clip = None
        n = self.numerics
        term = Term(name, kind, size,
                    _as_origin(scale, _vector(scale, size, f'term {name!r} scale', 1.0), n),
                    _vector(offset, size, f'term {name!r} offset', 0.0), clip)
        if n != 'float64':      # the origins hold offsets as float32 arrays (default angles)
            term.offset = term.offset.astype(np.float32)
        if n == 'isaaclab' and clip is not None:
            term.clip = (np.float32(clip[0]), np.float32(clip[1]))
        if kind == 'phase':
            term.period, term.dt = float(spec.pop('period', 0.0)), float(spec.pop('dt', 0.0))
            term.decimation = spec.pop('decimation', 1)
            if not (term.period > 0 and term.dt > 0):
                raise InvalidConfig(f'observation term {name!r}: a phase needs period > 0 and '
                                    'dt > 0 (seconds per counter tick)')
            if not isinstance(term.decimation, int) or term.decimation < 1:
                raise InvalidConfig(f'observation term {name!r}: decimation must be an '
                                    f'integer >= 1, got {term.decimation!r}')
        term.history = spec.pop('history_length', 1)
        if not isinstance(term.history, int) or not 1 <= term.history <= 1024:
            raise InvalidConfig(f'observation term {name!r}: history_length must be an '
                                f'integer in [1, 1024], got {term.history!r}')
        term.joints = joints
        if spec:
            raise InvalidConfig(f'observation term {name!r}: unknown settings {sorted(spec)}')
        return term

    def device_feedback(self):
        '''(start, size, scale, offset, clip) of the last_action term, or None: the engine
        fills those slots from the arena's last action inside the step.'''
        t = self._last_action_term
        if t is None:
            return None
        return t.start, t.size, t.scale, t.offset, t.clip

    def assemble(self, step, joint_state=None, imu=None, command=None, raw=None):
        '''float32 [obs_dim] for the step with counter `step` (the engine's step index).

        joint_state: (names, position, velocity); imu: (orientation x, y, z, w, angular
        velocity xyz); command: (vx, vy, yaw rate); raw: {term name: vector}. The last_action
        slots are left 0 for the engine to fill. Raises InvalidObservation naming what is
        missing or malformed; nothing is defaulted.
        '''
        out = np.zeros(self.obs_dim, dtype=np.float32)
        joints = self._joint_index(joint_state) if 'joint_state' in self.needs else None
        for t in self.terms:
            if t.type == 'last_action':
                continue
            x = self._reading(t, step, joints, joint_state, imu, command, raw)
            if not np.isfinite(x).all():
                # before any clip: a clipped Inf would pass as a finite, wrong observation
                raise InvalidObservation(
                    f'observation term {t.name!r}: the reading holds NaN/Inf at elements '
                    f'{np.flatnonzero(~np.isfinite(x)).tolist()}; refused')
            out[t.start:t.start + t.size] = self._arithmetic(t, x)
        return out

    def _arithmetic(self, t, x):
        if self.numerics == 'isaaclab':     # float32 throughout, clip before scale
            v = x.astype(np.float32) - t.offset
            if t.clip is not None:
                v = np.clip(v, t.clip[0], t.clip[1])
            return v * t.scale
        if self.numerics == 'unitree_rl_gym' and t.type == 'command':
            x = x.astype(np.float32)        # cmd = np.array(cmd_init, dtype=np.float32)
        v = (x - t.offset) * t.scale
        return v if t.clip is None else np.clip(v, t.clip[0], t.clip[1])

    def _joint_index(self, joint_state):
        if joint_state is None:
            raise InvalidObservation('no joint state received yet')
        names, pos, vel = joint_state
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if list(names).count(n) > 1})
            raise InvalidObservation(f'joint state names joints twice: {dup}')
        index = {n: i for i, n in enumerate(names)}
        missing = [n for n in self.joint_names if n not in index]
        if missing:
            raise InvalidObservation(f'joint state lacks joints {missing}')
        if len(pos) != len(names) or (self._uses('joint_vel') and len(vel) != len(names)):
            raise InvalidObservation('joint state position/velocity length differs from name '
                                     f'({len(pos)}/{len(vel)} values, {len(names)} names)')
        return index

    def _uses(self, kind):
        return any(t.type == kind for t in self.terms)

    def _reading(self, t, step, joints, joint_state, imu, command, raw):
        if t.type in ('joint_pos', 'joint_vel'):
            row = joint_state[1] if t.type == 'joint_pos' else joint_state[2]
            return np.array([row[joints[j]] for j in t.joints], dtype=np.float64)
        if t.type in ('base_ang_vel', 'projected_gravity'):
            if imu is None:
                raise InvalidObservation('no IMU reading received yet')
            if t.type == 'base_ang_vel':
                return np.asarray(imu[1], dtype=np.float64)
            x, y, z, w = imu[0]
            norm = math.sqrt(w * w + x * x + y * y + z * z)
            if not 0.9 < norm < 1.1:
                raise InvalidObservation(f'IMU orientation is not a unit quaternion (norm '
                                         f'{norm:.3g}); is the IMU publishing orientation?')
            return projected_gravity((w, x, y, z))
        if t.type == 'command':
            if command is None:
                raise InvalidObservation('no velocity command received yet (and no initial '
                                         'command configured)')
            return np.asarray(command, dtype=np.float64)
        if t.type == 'phase':
            # the origin's counter counts simulation steps: count = counter * simulation_dt
            phase = ((step + 1) * t.decimation * t.dt) % t.period / t.period
            if self.numerics == 'unitree_rl_gym':
                return np.array([np.sin(2 * np.pi * phase), np.cos(2 * np.pi * phase)])
            return np.array([math.sin(2 * math.pi * phase), math.cos(2 * math.pi * phase)])
        value = (raw or {}).get(t.name)
        if value is None:
            raise InvalidObservation(f'no input received yet for raw term {t.name!r}')
        value = np.asarray(value, dtype=np.float64).reshape(-1)
        if value.size != t.size:
            raise InvalidObservation(f'raw term {t.name!r}: {value.size} values, expected '
                                     f'{t.size}')
        return value


class JointTargets:
    '''Actions -> joint position targets: default + action_scale * action, clipped to limits
    (where given), in joint_names order, float64 for ros2_control's position controllers.

    numerics 'float64' computes in float64; 'unitree_rl_gym' and 'isaaclab' as their deploy
    loops do, in float32 (action * float32 scale + float32 default), then widen exactly.'''

    def __init__(self, joint_names, default_angles, action_scale, lower=(), upper=(),
                 numerics='float64'):
        n = len(joint_names)
        self.joint_names = list(joint_names)
        self.numerics = _numerics(numerics)
        self.default = _vector(default_angles, n, 'default_angles', 0.0)
        self.scale = _vector(action_scale, n, 'action_scale', 1.0)
        if self.numerics != 'float64':
            self.default = self.default.astype(np.float32)
            self.scale = self.scale.astype(np.float32)
        self.lower = _vector(lower, n, 'joint_lower_limits', -np.inf)
        self.upper = _vector(upper, n, 'joint_upper_limits', np.inf)
        if np.any(self.lower > self.upper):
            raise InvalidConfig('joint_lower_limits exceed joint_upper_limits')

    def __call__(self, action):
        a = np.asarray(action, dtype=self.default.dtype)
        if a.shape != self.default.shape:
            raise InvalidConfig(f'{a.size} actions for {self.default.size} joints: act_dim '
                                'must equal len(joint_names)')
        if self.numerics != 'float64':      # target_dof_pos = action * scale + default
            return np.clip((a * self.scale + self.default).astype(np.float64), self.lower,
                           self.upper)
        return np.clip(self.default + self.scale * a, self.lower, self.upper)
