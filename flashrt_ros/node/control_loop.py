"""The policy node's one control path: every observation, reading or timer tick ends in
ControlLoop.tick(), which steps the sessions that have input in one graph replay, asks each
session's guard about the result and publishes. A single-session node is a fleet of one.

How a tick is triggered depends on the observation type and control mode:
- float32_array / joint_state: each observation message is a tick of its session (and a
  farm's ~/observations message a tick of every session);
- terms, cameras, lockstep (simulation): a tick once every session that has had readings
  has the next joint state (with the IMU reading of the same stamp when the terms read one;
  each camera's newest frame, or with camera_sync stamp its frame of that stamp, held until
  each has sent one since the state was replaced); a session that stops is left behind;
- terms, cameras, timer (robot): control_rate ticks over the newest readings; stale or missing
  ones refuse that session's step.

Ticks run under the node's lock, which capsule services and transitions also take: a capsule
operation never interleaves with a tick. They run on the control thread (ControlThread), never
behind service calls; one that a frame or an instruction completes (lock-step), on its thread.
"""
import time

from builtin_interfaces.msg import Time
import numpy as np
import torch

from flashrt_ros.node.camera_readings import CameraReadings
from flashrt_ros.runtime.errors import FlashRTError, InvalidObservation
from flashrt_ros.runtime.inputs import checked_row


def input_tag(stamp):
    """A lock-step reading's stamp as the engine's step tag: nanoseconds + 1 (0: none)."""
    sec, nanosec = stamp
    return sec * 1_000_000_000 + nanosec + 1


def _tag_stamp(tag):
    """The inverse of input_tag: (sec, nanosec)."""
    return divmod(tag - 1, 1_000_000_000)


def _stamp_msg(stamp):
    sec, nanosec = stamp
    return Time(sec=int(sec), nanosec=int(nanosec))


def _same_values(a, b):
    """Two readings' values equal (tuples of names, arrays or numbers)."""
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


class ControlLoop:
    """Ticks for one configure: engine (PolicyEngine), robot (RobotIO), guards (one
    SessionGuard per session), report (diagnostics.Report), log (a logger)."""

    def __init__(self, engine, settings, robot, guards, report, log):
        self.engine, self.settings, self.robot = engine, settings, robot
        self.sessions, self.guards, self.report, self.log = robot.sessions, guards, report, log
        n, self.dim = len(self.sessions), engine.obs_dim
        self._obs = np.zeros((n, self.dim), dtype=np.float32)
        self._active = np.zeros(n, dtype=bool)
        self._pending_since = None      # lock-step: when the oldest waiting reading came
        layout, cameras = settings.layout, settings.cameras
        self._timer_keys = sorted(layout.needs - {'raw'}) + [
            'raw:' + t.name for t in layout.terms if t.type == 'raw'] if settings.terms else []
        self.cameras = None     # cameras: each session's CameraReadings, on its row of one
        if cameras is not None:     # device tensor that a tick steps on at once
            self._device_obs = torch.zeros(n, self.dim, device=engine.device)
            self.cameras = [CameraReadings(cameras, settings.node, engine.device, report, log,
                                           row) for row in self._device_obs]
            self._timer_keys = ['joint_state'] + ['camera:' + k for k in cameras.topics]

    # -- the tick ---------------------------------------------------------------------------------

    def tick(self, rows, tags=None):
        """Steps the sessions in rows {index: observation} together, with their lock-step tags
        {index: tag}; the others keep their state bit for bit. Returns {index: action} of
        the actions published. A held session or a bad row is refused alone; a poisoned
        session's action is never published (its guard recovers or holds it)."""
        obs, active, tags = self._obs, self._active, tags or {}
        active[:] = False
        for i, row in rows.items():
            s, problem = self.sessions[i], None
            supervisor = self.guards[i].supervisor
            if supervisor is not None and supervisor.holding:
                self._publish_held(s, supervisor)
            elif self.guards[i].held:
                self.report.refuse(f'{s.label}the state was poisoned (NaN/Inf); call ~/recover, '
                                   '~/restore or ~/reset_episode (~/reset_session for one '
                                   'session)', level='error')
            elif torch.is_tensor(row):  # a row of _device_obs (cameras): checked there
                obs, active[i] = self._device_obs, True
            else:   # checked alone: a bad row never enters obs, where it would refuse ticks
                try:
                    obs[i], active[i] = checked_row(row, self.dim, self.engine.policy), True
                except InvalidObservation as exc:
                    problem = str(exc)
            if problem:
                self.report.refuse(s.label + problem, key='observation')
        if not active.any():
            return {}
        engine = self.engine
        try:
            actions = engine.step_all(obs, active, [tags.get(i) if active[i] else None
                                                    for i in range(len(self.sessions))]).cpu()
        except FlashRTError as exc:
            self.report.refuse(str(exc))
            return {}
        published = {}
        for i in np.flatnonzero(active):
            s, guard = self.sessions[i], self.guards[i]
            if self.settings.node.poison_check and not engine.last_finite[i]:
                self.report.poisoned += 1
                guard.poisoned(actions[i])
                continue
            published[i] = action = actions[i].numpy()
            self.robot.publish_action(s, action)
            if s.chunk_pub is not None:     # a chunk policy: its chunk, when just computed
                self.robot.publish_chunk(s, engine.policy, engine.arena.session_views[i])
            if guard.supervisor is None:
                self.robot.publish_commands(s, action)
            else:
                self._supervised(s, guard.supervisor, action)
            if self.settings.lockstep or not self.settings.readings:  # one answer per input
                s.unsent = None if self.robot.reaches(s) else action
            guard.committed()
        return published

    def resend_unheard(self):
        """An event-driven session's last action (one answer per observation), published while
        no subscriber had matched on the node's side: a client still in discovery (its own
        side matched; seen under load, the demo driver waiting 30 s), for which a volatile
        topic keeps nothing. It goes out again once one has matched (on the status timer)."""
        if self.settings.readings:
            return      # lock-step re-sends on the world's re-sent readings; timer mode ticks
        for s in self.sessions:
            if s.unsent is not None and self.robot.reaches(s):
                self.robot.publish_action(s, s.unsent)  # (no command outputs here)
                s.unsent = None

    # -- the safety supervisor (runtime/safety.py) ----------------------------------------------

    def _supervised(self, s, supervisor, action):
        """The commands of a supervised step: the policy's (faded in at start-up), or, when a
        detector trips, the response's (the trip counted, diagnosed and its capsule kept)."""
        joint_state = s.inputs.get('joint_state', (None,))[0]
        imu = s.inputs.get('imu', (None,))[0]
        trips = supervisor.detect(joint_state, imu, action)
        if not trips:
            targets = self.settings.targets(action)
            self.robot.publish_targets(s, supervisor.passed(joint_state, action, targets))
            return
        targets, _, trip = supervisor.tripped(trips)
        self.report.safety_trip(s.label, supervisor.last_trip)
        joint = s.inputs.get('joint_state')
        self.robot.publish_safety_event(
            s, _stamp_msg(joint[1]) if joint else None, trip.detector, trip.detail,
            trip.response, trip.trip_capsule, trip.restored,
            _stamp_msg(_tag_stamp(trip.restored_tag)) if trip.restored_tag else None)
        if targets is not None:
            self.robot.publish_targets(s, targets)

    def _stale(self, s, seen):
        """A stale input under a supervisor watching for it: its response latches and acts at
        once (the held or ramping targets go out this tick)."""
        supervisor = self.guards[s.index].supervisor
        trip = supervisor.stale(seen) if supervisor is not None else None
        if trip is None:
            if supervisor is not None and supervisor.holding:
                self._publish_held(s, supervisor)
            return
        self.report.safety_trip(s.label, supervisor.last_trip)
        self.robot.publish_safety_event(s, None, trip.detector, trip.detail, trip.response, '')
        self._publish_held(s, supervisor)

    def _publish_held(self, s, supervisor):
        """A held or ramping session: the policy is not stepped; the response's targets go
        out (and ~/action repeats the last action, so a lock-step world gets its answer)."""
        last = self.engine.last_action(session=s.index)
        if last is not None:
            self.robot.publish_action(s, last)
        self.robot.publish_targets(s, supervisor.held_targets())

    # -- observations as messages -----------------------------------------------------------------

    def on_vector(self, s, obs):
        self.tick({s.index: obs})

    def on_joint_observation(self, s, msg):
        try:
            obs = self.settings.layout.assemble(0, joint_state=(list(msg.name), msg.position,
                                                                msg.velocity))
        except InvalidObservation as exc:
            self.report.refuse(s.label + str(exc))
            return
        self.tick({s.index: obs})

    def on_farm_tick(self, data):
        """A farm's tick: [sessions, obs_dim] (row-major) -> ~/actions [sessions, act_dim] and
        each session's ~/<name>/action; a row of NaN skips that session this tick (its state
        is kept; its row of ~/actions is NaN)."""
        n = len(self.sessions)
        if data.size != n * self.dim:
            self.report.refuse(f'~/observations holds {data.size} values, expected sessions x '
                               f'obs_dim = {n} x {self.dim}')
            return
        rows = data.reshape(n, self.dim)
        skip = np.isnan(rows).all(axis=1)
        published = self.tick({i: rows[i] for i in range(n) if not skip[i]})
        actions = np.full((n, self.engine.act_dim), np.nan, dtype=np.float32)
        for i, action in published.items():
            actions[i] = action
        self.robot.publish_farm_actions(actions)

    # -- terms and cameras: assembled from readings ----------------------------------------------

    def _tick_readings(self, sessions, tags):
        rows = {}
        for s in sessions:
            get, i = s.inputs.get, s.index
            try:
                if self.cameras is not None:
                    rows[i] = self.cameras[i].assemble(get('joint_state', (None,))[0])
                    continue
                raw = {t.name: get('raw:' + t.name, (None,))[0]
                       for t in self.settings.layout.terms if t.type == 'raw'}
                rows[s.index] = self.settings.layout.assemble(
                    self.engine.session(s.index).step_index,
                    joint_state=get('joint_state', (None,))[0], imu=get('imu', (None,))[0],
                    command=get('command', (None,))[0], raw=raw)
            except InvalidObservation as exc:
                self.report.refuse(s.label + str(exc))
        return self.tick(rows, tags) if rows else {}

    def timer_tick(self):
        """Robot: a step at control_rate over the newest readings; stale or missing ones refuse
        that session's step (counted, diagnosed) and nothing new is published for it."""
        now, limit = time.monotonic(), self.settings.node.max_input_age
        ready = []
        for s in self.sessions:
            for key in self._timer_keys:
                reading = s.inputs.get(key)
                if reading is None:
                    self.report.refuse(f'{s.label}missing input: no {key} received yet')
                    break
                if key != 'command' and now - reading[2] > limit:
                    seen = f'{key} is {1e3 * (now - reading[2]):.0f} ms old (max_input_age ' \
                           f'{1e3 * limit:.0f} ms)'
                    self.report.refuse(f'{s.label}stale input: {seen}')
                    self._stale(s, seen)
                    break
            else:
                ready.append(s)
        if ready:
            self._tick_readings(ready, {})

    def on_reading(self, s, key):
        """Lock-step (simulation): a session is ready on a new joint state, once the IMU reading
        of the same stamp (if the terms use one), or a frame from each camera since the state
        was replaced, has arrived too, whichever came last. The tick comes when every session
        that has had readings (and is not held) is ready."""
        joint = s.inputs.get('joint_state')
        if not self.settings.lockstep or joint is None:
            return
        tag = input_tag(joint[1])
        if tag == s.stepped_tag:
            if key in ('joint_state', 'imu'):   # (a frame, an instruction: no re-sent reading)
                self._answered_stamp(s, key, joint[1])
            return
        imu = s.inputs.get('imu', (None, None))
        if self.settings.terms and 'imu' in self.settings.layout.needs and imu[1] != joint[1]:
            return                  # wait for the matching IMU reading
        if self.cameras is not None and not self.cameras[s.index].ready(s, tag):
            return                  # held or refused until new frames come: on_reading again
        s.pending = tag
        waiting = [w for w in self.sessions if w.seen and not self.guards[w.index].held]
        if all(w.pending for w in waiting):
            self._tick_pending()
        elif self._pending_since is None:
            self._pending_since = time.monotonic()

    def _answered_stamp(self, s, key, stamp):
        """A reading under the stamp the state answered last: the same values are the world
        re-sending (it never got the command: re-sent if it surely never arrived, the state
        restored since or no subscriber then); new values are a stamping fault."""
        reading = s.inputs[key]
        if reading[1] != stamp:
            return                  # an IMU reading ahead of the joints: wait for them
        if key in s.answered and not _same_values(s.answered[key], reading[0]):
            # stepping would break the stamp = state rule, so refuse it, audibly
            sec, nanosec = stamp
            self.report.refuse(f'{s.label}stale stamp: a {key} reading with new values '
                               f'carries stamp {sec}.{nanosec:09d}, already answered; not '
                               'stepped (lock-step steps once per stamp: the driver must '
                               'stamp each reading, header.stamp)')
        elif s.resend or s.unsent is not None:
            s.answered[key] = reading[0]
            self._resend_commands(s)

    def _tick_pending(self):
        ready = [s for s in self.sessions if s.pending and not self.guards[s.index].held]
        self._pending_since = None
        if not ready:
            return
        tags = {s.index: s.pending for s in ready}
        for s in ready:
            s.stepped_tag, s.pending, s.resend, s.unsent = s.pending, 0, False, None
            s.answered = {k: s.inputs[k][0] for k in ('joint_state', 'imu') if k in s.inputs}
        published = self._tick_readings(ready, tags)
        for s in ready:     # not stepped (refused, held): the state's own tag is the answered
            if s.index not in published:    # one, so a re-send of these readings steps
                s.stepped_tag, s.answered = self.engine.input_tag(session=s.index), {}

    def lockstep_deadline(self):
        """A world that stopped publishing must not stall the others: after lockstep_wait the
        sessions that are ready step without it (the grouping of a tick changes no action:
        each session's row is computed as if alone)."""
        since = self._pending_since
        if since is not None and time.monotonic() - since >= self.settings.node.lockstep_wait:
            self._tick_pending()

    # -- after the state changed under the node ---------------------------------------------------

    def state_replaced(self, index=None):
        """After a restore, reset, rollback or recovery of session `index` (None: all): in
        lock-step its readings, camera frames too, answered the old state and are dropped; the
        readings the state answered last are its own (the engine's input tag, which capsules
        carry). A world that re-sends those (it never got their command: the node died or was
        restored in between) gets the command of the state's last action again, not a second
        step. In every mode its chunk is owed again (~/action_chunk)."""
        if index is None:
            self._pending_since = None
        for s in self.sessions:
            if index is not None and s.index != index:
                continue
            s.chunk_owed = True
            if self.settings.lockstep:
                s.forget_readings(self.cameras[s.index].observation if self.cameras else None)
                s.stepped_tag = self.engine.input_tag(session=s.index)
                s.resend, s.unsent, s.pending, s.answered = True, None, 0, {}

    def _resend_commands(self, s):
        if s.resend:
            s.resend, last = False, self.engine.last_action(session=s.index)
            why = "the restored state's last stamp"
            if last is None:
                self.log.warning(f'{s.label}readings of an answered stamp came after a restore,'
                                 ' and the state keeps no last action to re-send: waiting')
                return
        else:
            last, why = s.unsent, 'a stamp whose commands went out before any subscriber matched'
        self.log.info(f'{s.label}readings of {why} arrived again: re-sending the commands of '
                      'its last action')
        self.robot.publish_action(s, last)
        self.robot.publish_commands(s, last)
        if s.chunk_pub is not None:     # and the chunk, owed since a restore (publish_chunk)
            self.robot.publish_chunk(s, self.engine.policy,
                                     self.engine.arena.session_views[s.index])
        s.unsent = None if self.robot.reaches(s) else last
