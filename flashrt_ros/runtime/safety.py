'''The safety supervisor: detectors on every step of a robot policy (observation_type terms),
and what it does when one trips. No ROS; the node's control loop calls it (node/control_loop.py).

Detectors (the parameter `safety`: entries 'detector:response'):
  tilt            the base's tilt from the IMU orientation (angle between the base's z axis
                  and the world's) above safety_max_tilt (rad)
  joint_position  a joint reading outside joint_lower_limits / joint_upper_limits (or, where
                  those are not set, the joint ranges of safety_model_file: MJCF or URDF, read
                  by MuJoCo) by more than safety_joint_margin (rad)
  joint_velocity  a joint speed above safety_max_joint_velocity (one value or one per joint)
  action_rate     the policy's action changing by more than safety_max_action_rate in a step
  stale           control_mode timer: a reading older than max_input_age at a tick (the step
                  is refused as without the supervisor; hold or ramp then act on the robot)
NaN/Inf is the node's own check (poison_check / on_poison: recover to the newest finite
checkpoint, or hold).

Responses:
  hold      publish the last safe joint targets from then on; the policy is not stepped
  ramp      move the targets from the last safe ones to default_angles over safety_ramp_time,
            then hold there
  rollback  restore the policy to a safe capsule and go on: the newest for the first trip, the
            next older one for each trip in a row (a run of trips ends after safety_safe_every
            steps without one past the step that tripped: the replay of steps that tripped
            once neither ends it nor takes safe capsules); after safety_max_rollbacks in a row
            it holds
  damp      refused at configure: none of the command outputs (float64_array, joint_trajectory)
            carries gains, so a zero-gain command cannot be sent
A hold or ramp lasts until ~/reset_episode, ~/restore or ~/recover (the node calls clear()).
After a rollback no command answers the tripping readings: the controller keeps the last one
for that period, and a simulated world that follows rollbacks (flashrt_sim follow_rollbacks)
restores its own state of the restored capsule's moment, so world and policy go back together.

Safe capsules ('safe-<session>-<n>', host tier) are taken every safety_safe_every steps while
no detector trips; safety_safe_keep of them are kept. Every trip keeps the state before the
tripping step as 'trip-<session>-<n>-<detector>' (pinned): restore it and feed the same
readings, and the same action comes out, bit for bit. Start-up: for safety_startup_ramp seconds
after the first step the published targets fade from the joints' first reading to the
policy's (alpha from 0 to 1).
'''
from collections import deque
from typing import NamedTuple

import numpy as np

from .enums import Tier
from .errors import FlashRTError, InvalidConfig

DETECTORS = ('tilt', 'joint_position', 'joint_velocity', 'action_rate', 'stale')
RESPONSES = ('hold', 'ramp', 'rollback', 'damp')


class Trip(NamedTuple):
    detector: str
    detail: str
    response: str           # what was done: hold, ramp or rollback
    trip_capsule: str       # the state before the tripping step ('' if it could not be kept)
    restored: str           # rollback: the safe capsule restored
    restored_tag: int       # rollback: the engine input tag its state answered last (0: none)


def parse(entries, cfg, n_joints):
    '''{detector: response} from the `safety` entries; InvalidConfig names what is wrong.'''
    responses = {}
    for entry in entries:
        detector, _, response = str(entry).partition(':')
        if detector not in DETECTORS:
            raise InvalidConfig(f'parameter \'safety\': {entry!r}: unknown detector '
                                f'{detector!r} (one of {", ".join(DETECTORS)}; stale inputs '
                                'and NaN/Inf are max_input_age and on_poison)')
        if response not in RESPONSES:
            raise InvalidConfig(f'parameter \'safety\': {entry!r}: response must be one of '
                                f'{", ".join(RESPONSES)}')
        if response == 'damp':
            raise InvalidConfig(f'parameter \'safety\': {entry!r}: damp needs a command output '
                                'with gains; float64_array and joint_trajectory carry none '
                                '(use hold or ramp)')
        if detector == 'stale' and response == 'rollback':
            raise InvalidConfig(f"parameter 'safety': {entry!r}: a stale input is no fault of "
                                "the policy's state: use hold or ramp")
        responses[detector] = response
    if 'stale' in responses and cfg.control_mode != 'timer':
        raise InvalidConfig("parameter 'safety': stale needs control_mode 'timer' (lock-step "
                            'waits for its readings)')
    if 'joint_position' in responses and not (cfg.joint_lower_limits or cfg.joint_upper_limits
                                              or cfg.safety_model_file):
        raise InvalidConfig("parameter 'safety': joint_position needs joint_lower_limits "
                            'and joint_upper_limits, or safety_model_file')
    if 'joint_velocity' in responses and len(cfg.safety_max_joint_velocity) not in (1, n_joints):
        raise InvalidConfig("parameter 'safety_max_joint_velocity': one value or one per "
                            f'joint ({n_joints}), got {list(cfg.safety_max_joint_velocity)}')
    if 'action_rate' in responses and not cfg.safety_max_action_rate > 0:
        raise InvalidConfig("parameter 'safety_max_action_rate' must be > 0 for the "
                            'action_rate detector')
    return responses


def tilt(orientation):
    '''The angle (rad) between the base's z axis and the world's, from a unit quaternion
    (x, y, z, w): the base z axis's world z component is 1 - 2 (x^2 + y^2).'''
    x, y = orientation[0], orientation[1]
    return float(np.arccos(np.clip(1.0 - 2.0 * (x * x + y * y), -1.0, 1.0)))


class Supervisor:
    '''One session's supervisor (see the module docstring). engine: the PolicyEngine; session:
    its index (None on a single-session node); period: seconds per control step.'''

    def __init__(self, engine, session, cfg, responses, period, log, name=''):
        self.engine, self.session, self.cfg, self.log = engine, session, cfg, log
        self.responses, self.period = responses, period
        self.tag = name or 'main'
        self.joints = list(cfg.joint_names)
        self.default = np.asarray(cfg.default_angles, dtype=np.float64)
        n = len(self.joints)
        low, high = cfg.joint_lower_limits, cfg.joint_upper_limits
        if cfg.safety_model_file and not (low or high):
            low, high = model_limits(cfg.safety_model_file, self.joints)
        self.lower = _limits(low, n, -np.inf) - cfg.safety_joint_margin
        self.upper = _limits(high, n, np.inf) + cfg.safety_joint_margin
        self.max_speed = _limits(cfg.safety_max_joint_velocity, n, np.inf)
        self.trips = 0
        self.last_trip = ''
        self.trip_capsules = []
        self._safe = deque()
        self._sequence = 0
        self.clear()

    def clear(self):
        '''After a reset, restore or recover: no hold, no run of trips, a new start-up fade.'''
        self.latched = None         # (response, from targets, steps into it) while holding
        self.consecutive = 0
        self.clean_steps = 0
        self.probation = 0          # steps to replay after a rollback before it counts as safe
        self.last_targets = None
        self.last_action = None
        self.steps = 0
        self.start_pose = None

    @property
    def holding(self):
        return self.latched is not None

    # -- detection --------------------------------------------------------------------------

    def _positions(self, joint_state):
        names, q, dq = joint_state
        index = {n: i for i, n in enumerate(names)}
        q, dq = np.asarray(q, np.float64), np.asarray(dq, np.float64)
        return (np.array([q[index[j]] for j in self.joints]),
                np.array([dq[index[j]] if len(dq) else 0.0 for j in self.joints]))

    def detect(self, joint_state, imu, action):
        '''[(detector, what was seen)] of those that trip on this step's readings and action.'''
        trips, r = [], self.responses
        if 'tilt' in r and imu is not None:
            angle = tilt(imu[0])
            if angle > self.cfg.safety_max_tilt:
                trips.append(('tilt', f'base tilt {angle:.3f} rad > {self.cfg.safety_max_tilt}'))
        if joint_state is not None and ('joint_position' in r or 'joint_velocity' in r):
            q, dq = self._positions(joint_state)
            if 'joint_position' in r:
                out = np.maximum(self.lower - q, q - self.upper)
                j = int(np.argmax(out))
                if out[j] > 0:
                    trips.append(('joint_position', f'{self.joints[j]} at {q[j]:.3f} rad, '
                                  f'limits [{self.lower[j]:.3f}, {self.upper[j]:.3f}]'))
            if 'joint_velocity' in r:
                over = np.abs(dq) - self.max_speed
                j = int(np.argmax(over))
                if over[j] > 0:
                    trips.append(('joint_velocity', f'{self.joints[j]} at {dq[j]:.3f} rad/s > '
                                  f'{self.max_speed[j]:.3f}'))
        if 'action_rate' in r and self.last_action is not None:
            change = np.abs(np.asarray(action, np.float64) - self.last_action)
            j = int(np.argmax(change))
            if change[j] > self.cfg.safety_max_action_rate:
                trips.append(('action_rate', f'action {j} changed by {change[j]:.3f} > '
                              f'{self.cfg.safety_max_action_rate} in one step'))
        return trips

    # -- the step's outcome -----------------------------------------------------------------

    def held_targets(self):
        '''The targets to publish while holding or ramping (advances a ramp by one step).'''
        response, start, k = self.latched
        if response == 'ramp':
            steps = max(1, round(self.cfg.safety_ramp_time / self.period))
            alpha = min(1.0, (k + 1) / steps)
            self.latched = (response, start, k + 1)
            return start + alpha * (self.default - start)
        return start

    def passed(self, joint_state, action, targets):
        '''A step no detector tripped on: the targets to publish (faded in at start-up); a safe
        capsule when one is due.'''
        if self.start_pose is None and joint_state is not None:
            self.start_pose = self._positions(joint_state)[0]
        self.steps += 1
        fade = max(0, round(self.cfg.safety_startup_ramp / self.period))
        if fade and self.start_pose is not None and self.steps <= fade:
            alpha = self.steps / fade
            targets = self.start_pose + alpha * (np.asarray(targets) - self.start_pose)
        self.last_action = np.asarray(action, np.float64)
        self.last_targets = np.asarray(targets, np.float64)
        if self.probation > 0:
            # replaying, after a rollback, steps that led to the trip once: not safe yet, and
            # not the end of the run of trips (in a deterministic world they trip again)
            self.probation -= 1
            return targets
        self.clean_steps += 1
        if self.clean_steps % max(1, self.cfg.safety_safe_every) == 0:
            self.consecutive = 0        # a run of trips ends
            self._take_safe()
        return targets

    def _take_safe(self):
        self._sequence += 1
        name = f'safe-{self.tag}-{self._sequence}'
        try:
            self.engine.snapshot(name, tier=Tier.HOST, session=self.session)
        except FlashRTError as exc:
            self.log.error(f'safety: safe capsule {name!r} not taken: {exc}')
            return
        self._safe.append(name)
        while len(self._safe) > max(1, self.cfg.safety_safe_keep):
            old = self._safe.popleft()
            try:
                self.engine.delete(old)
            except FlashRTError:
                pass

    def stale(self, seen):
        '''A stale input at a timer tick (no step ran): the stale response latches. Returns the
        Trip, or None when the supervisor does not watch for stale inputs or already holds.'''
        if 'stale' not in self.responses or self.holding:
            return None
        self.trips += 1
        response = self.responses['stale']
        start = self.last_targets if self.last_targets is not None else self.default.copy()
        self.latched = (response, start, 0)
        self.last_trip = f'stale: {seen} -> {response}'
        self.log.error(f'safety trip {self.trips}: {self.last_trip}')
        return Trip('stale', seen, response, '', '', 0)

    def tripped(self, trips):
        '''Acts on a step that tripped (its action not published): keeps the trip capsule, then
        the response of the first detector that tripped. Returns (targets to publish: None
        after a rollback, what was done, Trip).'''
        detector, seen = trips[0]
        self.trips += 1
        response = self.responses[detector]
        name = f'trip-{self.tag}-{self.trips}-{detector}'
        kept, trip_capsule, restored = '', '', ''
        try:        # the state before the tripping step: replays the trip bit for bit
            self.engine.rollback(1, session=self.session)
            self.engine.snapshot(name, overwrite=True, pin=True, tier=Tier.HOST,
                                 session=self.session)
            self.trip_capsules.append(name)
            trip_capsule, kept = name, f'; state before it kept as {name!r}'
        except FlashRTError as exc:
            kept = f'; no trip capsule ({exc})'
        done = response
        if response == 'rollback':
            self.consecutive += 1
            back = len(self._safe) - self.consecutive
            if self.consecutive > self.cfg.safety_max_rollbacks or back < 0:
                response = 'hold'
                done = (f'hold ({self.consecutive - 1} rollbacks in a row'
                        + (', no older safe capsule' if back < 0 else '') + ')')
            else:
                restored = self._safe[back]
                tripped_at = self.engine.session(self.session).step_index
                self.engine.restore(restored, session=self.session)
                self.probation = tripped_at - self.engine.session(self.session).step_index
                self.clean_steps = 0
                self.last_action = None
                done = f'rollback to {restored!r}'
        start = self.last_targets if self.last_targets is not None else self.default.copy()
        if response in ('hold', 'ramp'):
            self.latched = (response, start, 0)
        self.last_trip = f'{detector}: {seen} -> {done}'
        self.log.error(f'safety trip {self.trips}: {self.last_trip}{kept}')
        trip = Trip(detector, seen, response, trip_capsule, restored,
                    self.engine.input_tag(session=self.session) if restored else 0)
        return (None if restored else self.held_targets() if self.latched else start), done, \
            trip


def model_limits(path, joints):
    '''(lower, upper) of `joints` from a model file's joint ranges (MJCF or URDF, read by
    MuJoCo); a joint without a range is unlimited. InvalidConfig for a joint it lacks.'''
    import mujoco
    try:
        model = mujoco.MjModel.from_xml_path(str(path))
    except ValueError as exc:
        raise InvalidConfig(f'parameter \'safety_model_file\' = {path!r}: {exc}') from None
    lower, upper = [], []
    for name in joints:
        j = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_JOINT, name)
        if j < 0:
            raise InvalidConfig(f'parameter \'safety_model_file\' = {path!r}: no joint '
                                f'{name!r} (joint_names)')
        limited = bool(model.jnt_limited[j])
        lower.append(float(model.jnt_range[j, 0]) if limited else -np.inf)
        upper.append(float(model.jnt_range[j, 1]) if limited else np.inf)
    return lower, upper


def _limits(values, n, fill):
    values = list(values)
    if not values:
        return np.full(n, fill)
    return np.asarray(values * n if len(values) == 1 else values, dtype=np.float64)
