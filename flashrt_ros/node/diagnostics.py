"""What the policy node counts and reports: refused steps, readings lost before the node saw
them, callbacks that failed, poisoned steps; ~/status and /diagnostics built from those
counts, the engine and each session's guard.

/diagnostics follows diagnostic_updater's conventions: one DiagnosticStatus per node, named
'flashrt_ros: <fully qualified node name>' (two robots' nodes of one name in two namespaces
stay two entries in diagnostic_aggregator and rqt_robot_monitor), and in a fleet one more per
session ('<that name>/session <session name>'); hardware_id names the node and its device;
the message is a short summary, the values the detail. Levels say what holds now, not what
happened since the last report:
- ERROR while a session is held (poisoned, not recovered): nothing is published for it;
- WARN while something needs a person: steps refused, readings lost, callbacks failed or
  steps poisoned within the last `window` seconds (RECENT_S; at least since the last report,
  so every event is on one report), checkpoint writes failing (until one succeeds), a step
  that is not reproducible;
- OK otherwise.
"""
from collections import deque
import time

from diagnostic_msgs.msg import DiagnosticStatus, KeyValue

from flashrt_ros import msg as fmsg

# s: how long a refusal, a lost reading, a failed callback or a poisoned step keeps the status
# WARN. Several status periods (1 s by default), so a monitor shows a steady WARN while
# refusals keep coming instead of one flicker per refusal.
RECENT_S = 5.0

_STATUS_FIELDS = ('policy', 'cuda_graph', 'step', 'episode', 'position', 'rollback_available',
                  'step_latency_p50_us', 'step_latency_p99_us', 'capsules', 'device_bytes_used',
                  'device_bytes_budget', 'host_bytes_used', 'rejected_observations',
                  'dropped_observations', 'sessions')
_HOLD_WAYS_OUT = '~/recover, ~/restore or ~/reset_episode'


def _session_of_reason(reason):
    # a fleet's refusals start with their session's label, 'session <name>: '
    return reason[8:].split(':', 1)[0] if reason.startswith('session ') else None


def _topic_of(topic, session):
    # a fleet session's topics are under '~/<name>/' (its own API) or '<name>/' (its robot's)
    return topic.startswith((f'~/{session}/', f'{session}/'))


def _of_session(event, session):
    return event[1] == session or (event[2] == 'lost' and _topic_of(event[4], session))


class Report:
    """Counters since configure (reset()), recent events, and the messages that publish them.

    name: the node's fully qualified name; window: RECENT_S; clock: time.monotonic (seconds).
    """

    def __init__(self, logger, name, window=RECENT_S, clock=time.monotonic):
        self.log, self.name = logger, name
        self.window, self.clock = window, clock
        self.reset()

    def reset(self):
        self.rejected = 0           # refused before reaching the engine
        self._poisoned = 0          # steps whose action or state held NaN/Inf
        self.refusals = {}          # reason -> count
        self.session_refusals = {}  # a fleet's session name -> count
        self.last_refusal = ''
        self.lost = {}              # input topic -> readings lost before the node saw them
        self.callback_failures = 0
        self.safety_trips = 0       # safety supervisor trips (runtime/safety.py)
        self.last_safety_trip = ''
        # (time, session name or None, kind, count, detail), oldest first; kept while recent
        self._events = deque()
        self._last_report = self.clock()
        self._checkpoints = {}      # session name -> (taken, failed, failing) at last report

    @property
    def poisoned(self):
        return self._poisoned

    @poisoned.setter
    def poisoned(self, count):
        # the control loop counts a poisoned step with `report.poisoned += 1`: an event too
        if count > self._poisoned:
            self._event(None, 'poisoned', count - self._poisoned, '')
        self._poisoned = count

    def refuse(self, reason, level='warning', key=None):
        """Counts a refused step under `key` (default: the reason's text before a colon, after
        the session's name in a fleet) and logs it, throttled."""
        self.rejected += 1
        parts = reason.split(':')
        key = key or ':'.join(parts[:2 if reason.startswith('session ') else 1])[:60]
        self.refusals[key] = self.refusals.get(key, 0) + 1
        self.last_refusal = reason
        session = _session_of_reason(reason)
        self.session_refusals[session] = self.session_refusals.get(session, 0) + 1
        self._event(session, 'refused', 1, reason)
        getattr(self.log, level)(f'step refused: {reason}', throttle_duration_sec=1.0)

    def readings_lost(self, topic, count):
        self.lost[topic] = self.lost.get(topic, 0) + count
        self._event(None, 'lost', count, topic)     # its session: by the topic, _of_session
        self.log.warning(f'{count} readings on {topic} lost before the node saw them '
                         f'({sum(self.lost.values())} since configure): raise qos_depth or '
                         'lower the rate', throttle_duration_sec=1.0)

    def safety_trip(self, label, detail):
        """A detector tripped (the supervisor logged it with its response)."""
        self.safety_trips += 1
        self.last_safety_trip = label + detail
        self._event(_session_of_reason(label) if label else None, 'safety', 1, detail)

    def determinism(self, engine):
        """The engine's probe at construction (it replays its captured step(s) from one
        state): a kernel that is not reproducible would make restores and replays diverge."""
        verdict = engine.determinism
        if verdict.get('deterministic') is False:
            self.log.warning(
                f'the policy step is NOT reproducible run to run on {engine.device}: '
                f'{verdict}; restored capsules may not replay the original actions bit for bit')
        elif verdict.get('probed'):
            self.log.info(f'determinism probe: {verdict["replays"]} replays of '
                          f'{verdict["graphs"]} step graph(s) identical')

    def callback_failed(self, what, exc):
        self.callback_failures += 1
        self._event(None, 'failed', 1, what)
        self.log.error(f'{what} callback failed and was dropped ({self.callback_failures} '
                       f'since configure): {exc!r}', throttle_duration_sec=1.0)

    def rejected_observations(self, engine):
        return self.rejected + self.poisoned + (engine.rejected_observations if engine else 0)

    # -- recent events -----------------------------------------------------------------------

    def _event(self, session, kind, count, detail):
        now = self.clock()
        self._events.append((now, session, kind, count, detail))
        self._forget(now)

    def _cutoff(self, now):
        # recent: within the window, and anything since the last report, so that an event
        # between two reports further apart than the window is still on the next one
        return min(now - self.window, self._last_report)

    def _forget(self, now):
        cutoff, events = self._cutoff(now), self._events
        while events and events[0][0] < cutoff:
            events.popleft()

    def _checkpoints_failing(self, guard):
        """Whether the guard's checkpoint writes are failing: one failed since the last report,
        or they were and none was taken since."""
        taken, failed = guard.checkpoints_taken, guard.failed_checkpoints
        was_taken, was_failed, was_failing = self._checkpoints.get(guard.name, (0, 0, False))
        failing = failed > was_failed or (was_failing and taken == was_taken)
        self._checkpoints[guard.name] = (taken, failed, failing)
        return failing

    # -- messages ----------------------------------------------------------------------------

    def status(self, state, stamp, engine=None, settings=None, guards=()):
        """~/status; only the state while unconfigured."""
        status = fmsg.PolicyStatus()
        status.header.stamp = stamp
        status.state = state
        if engine is None:
            return status
        policy = settings.policy
        status.policy = settings.node.policy_type + (
            f' ({policy.policy_file})' if policy.policy_file else ' (seeded demo)')
        status.device = str(engine.device)
        status.cuda_graph = bool(engine.graph_captured)
        status.step, status.episode = engine.step_index, engine.episode
        status.position = engine.position
        status.rollback_available = engine.rollback_available
        status.step_latency_p50_us, status.step_latency_p99_us = engine.step_latency_us()
        store = engine.store
        status.capsules = len(store.list())
        status.device_bytes_used = store.device_bytes_used
        status.device_bytes_budget = store.device_budget
        status.host_bytes_used = store.host_bytes_used
        status.rejected_observations = self.rejected_observations(engine)
        status.dropped_observations = sum(self.lost.values())
        sessions = [engine.session(i) for i in range(engine.sessions)]
        status.sessions = engine.sessions
        status.session_names = [s.name for s in sessions]
        status.session_steps = [s.step_index for s in sessions]
        status.session_episodes = [s.episode for s in sessions]
        status.held_sessions = [g.name for g in guards if g.held]
        status.safety_trips = self.safety_trips
        status.safety_holding = [g.name for g in guards
                                 if g.supervisor is not None and g.supervisor.holding]
        return status

    def diagnostic(self, status, engine=None, guards=(), readings=()):
        """The node's /diagnostics entry for `status` (see the module docstring)."""
        return self.diagnostics(status, engine, guards, readings)[0]

    def diagnostics(self, status, engine=None, guards=(), readings=()):
        """The /diagnostics entries for `status`: the node's, then one per session of a fleet
        (see the module docstring); readings: (name, seconds since the newest one arrived)
        of an assembled observation's inputs (RobotIO.reading_ages)."""
        now = self.clock()
        self._forget(now)
        events, span = list(self._events), max(self.window, now - self._last_report)
        self._last_report = now
        failing = {g.name: self._checkpoints_failing(g) for g in guards}
        determinism = engine.determinism if engine is not None else {}
        errors = []
        if status.held_sessions:
            which = f'sessions {list(status.held_sessions)}' if len(guards) > 1 else 'the state'
            errors.append(f'{which} held after a poisoned step: steps refused until '
                          f'{_HOLD_WAYS_OUT}')
        if status.safety_holding:
            which = f'sessions {list(status.safety_holding)}' if len(guards) > 1 else 'the robot'
            errors.append(f'safety supervisor holds {which} after a trip ('
                          f'{self.last_safety_trip}): until {_HOLD_WAYS_OUT}')
        recent_trips = [e for e in events if e[2] == 'safety']
        if recent_trips:
            errors.append(f'{sum(e[3] for e in recent_trips)} safety trips recently; last: '
                          f'{self.last_safety_trip}')
        warnings = _recent_problems(events, span)
        for g in guards:
            if failing[g.name]:
                warnings.append(f'{g.label}{g.failed_checkpoints} checkpoint writes failed; '
                                f'last: {g.last_checkpoint_failure}')
        if determinism.get('deterministic') is False:
            warnings.append('the policy step is not reproducible run to run (replays '
                            f'differed by up to {determinism.get("max_abs_diff")})')
        values = [('node', self.name), ('state', status.state), ('device', status.device)]
        values += [(f, getattr(status, f)) for f in _STATUS_FIELDS]
        values.append(('held_sessions', list(status.held_sessions)))
        if guards:
            values.append(('failed_checkpoints', sum(g.failed_checkpoints for g in guards)))
        values += [('safety_trips', self.safety_trips),
                   ('last_safety_trip', self.last_safety_trip),
                   ('callback_failures', self.callback_failures),
                   ('deterministic', determinism.get('deterministic')),
                   ('recent_window_s', self.window),
                   ('refused_recently', _count(events, 'refused')),
                   ('lost_recently', _count(events, 'lost')),
                   ('last_refusal', self.last_refusal)]
        if len(guards) > 1:
            for g, step, episode in zip(guards, status.session_steps, status.session_episodes):
                values.append((f'session {g.name}', f'step {step}, episode {episode}, ' + (
                    'held' if g.held else 'running') + f', {g.checkpoints_taken} checkpoints '
                    f'({g.failed_checkpoints} failed)'))
        values += [(f'refused: {reason}', count)
                   for reason, count in sorted(self.refusals.items())]
        values += [(f'lost: {topic}', count) for topic, count in sorted(self.lost.items())]
        values += [(f'input age: {name}', f'{1e3 * age:.0f} ms') for name, age in readings]
        node = self._entry('', status, status.step, errors, warnings, values)
        if len(guards) < 2:
            return [node]
        return [node] + [self._session_entry(g, step, episode, status, events, span,
                                             failing[g.name])
                         for g, step, episode in zip(guards, status.session_steps,
                                                     status.session_episodes)]

    def _session_entry(self, guard, step, episode, status, events, span, failing):
        """A fleet session's entry: its hold, its refusals, its topics' losses, its
        checkpoints."""
        mine = [e for e in events if _of_session(e, guard.name)]
        errors = ['held after a poisoned step: steps refused until ~/recover, ~/restore or '
                  '~/reset_session'] if guard.held else []
        warnings = _recent_problems(mine, span)
        if failing:
            warnings.append(f'{guard.failed_checkpoints} checkpoint writes failed; last: '
                            f'{guard.last_checkpoint_failure}')
        prefix = f'session {guard.name}:'
        values = [('session', guard.name), ('step', step), ('episode', episode),
                  ('held', guard.held), ('checkpoints_taken', guard.checkpoints_taken),
                  ('failed_checkpoints', guard.failed_checkpoints),
                  ('last_checkpoint_failure', guard.last_checkpoint_failure),
                  ('refused', self.session_refusals.get(guard.name, 0)),
                  ('refused_recently', _count(mine, 'refused')),
                  ('lost_recently', _count(mine, 'lost'))]
        values += [(f'refused: {reason}', count) for reason, count
                   in sorted(self.refusals.items()) if reason.startswith(prefix)]
        values += [(f'lost: {topic}', count) for topic, count in sorted(self.lost.items())
                   if _topic_of(topic, guard.name)]
        return self._entry(f'/session {guard.name}', status, step, errors, warnings, values)

    def _entry(self, suffix, status, step, errors, warnings, values):
        level = DiagnosticStatus.ERROR if errors else (
            DiagnosticStatus.WARN if warnings else DiagnosticStatus.OK)
        diag = DiagnosticStatus(
            level=level, name=f'flashrt_ros: {self.name}{suffix}',
            hardware_id=f'{self.name}@{status.device}',
            message='; '.join(errors + warnings) or f'{status.state}, step {step}')
        diag.values = [KeyValue(key=k, value=str(v)) for k, v in values]
        return diag


def _count(events, kind):
    return sum(e[3] for e in events if e[2] == kind)


def _n(count, thing):
    return f'{count} {thing}' + ('' if count == 1 else 's')


def _recent_problems(events, span):
    """One short phrase per kind of recent event (events: Report._events entries)."""
    within = f'in the last {round(span, 1):g} s'
    problems = []
    refused = [e for e in events if e[2] == 'refused']
    if refused:
        problems.append(f'{_n(len(refused), "step")} refused {within}; last: {refused[-1][4]}')
    lost = {}
    for _, _, kind, count, topic in events:
        if kind == 'lost':
            lost[topic] = lost.get(topic, 0) + count
    if lost:
        topics = ', '.join(f'{t}: {n}' for t, n in sorted(lost.items()))
        problems.append(f'{_n(sum(lost.values()), "input reading")} lost before the node saw '
                        f'them {within} ({topics}): raise qos_depth or lower the rate')
    poisoned = _count(events, 'poisoned')
    if poisoned:
        problems.append(f'{_n(poisoned, "poisoned step")} (NaN/Inf) {within}')
    failed = [e for e in events if e[2] == 'failed']
    if failed:
        problems.append(f'{_n(len(failed), "callback")} failed and dropped {within} (last: '
                        f'{failed[-1][4]}; the error log names the error)')
    return problems
