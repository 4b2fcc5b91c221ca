"""What the policy node counts and reports: refused steps, readings lost before the node saw
them, callbacks that failed, poisoned steps; ~/status and /diagnostics built from those
counts, the engine and each session's guard.

/diagnostics is WARN while something needs a person: steps refused or readings lost since the
last report, failing checkpoint writes, held sessions, failed callbacks, a step that is not
reproducible. Each session of a fleet gets its own values ('session <name>: ...').
"""
from diagnostic_msgs.msg import DiagnosticStatus, KeyValue

from flashrt_ros import msg as fmsg

_STATUS_FIELDS = ('policy', 'cuda_graph', 'step', 'episode', 'position', 'rollback_available',
                  'step_latency_p50_us', 'step_latency_p99_us', 'capsules', 'device_bytes_used',
                  'device_bytes_budget', 'host_bytes_used', 'rejected_observations',
                  'dropped_observations', 'sessions')


class Report:
    """Counters since configure (reset()), and the messages that publish them."""

    def __init__(self, logger, name):
        self.log, self.name = logger, name
        self.reset()

    def reset(self):
        self.rejected = 0           # refused before reaching the engine
        self.poisoned = 0           # steps whose action or state held NaN/Inf
        self.refusals = {}          # reason -> count
        self.last_refusal = ''
        self.lost = {}              # input topic -> readings lost before the node saw them
        self.callback_failures = 0
        self._reported = {'rejected': 0, 'lost': 0, 'failures': 0}

    def refuse(self, reason, level='warning', key=None):
        """Counts a refused step under `key` (default: the reason's text before a colon, after
        the session's name in a fleet) and logs it, throttled."""
        self.rejected += 1
        parts = reason.split(':')
        key = key or ':'.join(parts[:2 if reason.startswith('session ') else 1])[:60]
        self.refusals[key] = self.refusals.get(key, 0) + 1
        self.last_refusal = reason
        getattr(self.log, level)(f'step refused: {reason}', throttle_duration_sec=1.0)

    def readings_lost(self, topic, count):
        self.lost[topic] = self.lost.get(topic, 0) + count
        self.log.warning(f'{count} readings on {topic} lost before the node saw them '
                         f'({sum(self.lost.values())} since configure): raise qos_depth or '
                         'lower the rate', throttle_duration_sec=1.0)

    def callback_failed(self, what, exc):
        self.callback_failures += 1
        self.log.error(f'{what} callback failed and was dropped ({self.callback_failures} '
                       f'since configure): {exc!r}', throttle_duration_sec=1.0)

    def rejected_observations(self, engine):
        return self.rejected + self.poisoned + (engine.rejected_observations if engine else 0)

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
        return status

    def diagnostic(self, status, engine=None, guards=()):
        """The /diagnostics entry for `status` (see the module docstring)."""
        problems = []
        reported = self._reported
        rejected, lost = status.rejected_observations, status.dropped_observations
        if rejected > reported['rejected']:
            problems.append(f'{rejected - reported["rejected"]} steps refused since last '
                            f'report; last: {self.last_refusal}')
        if lost > reported['lost']:
            problems.append(f'{lost - reported["lost"]} input readings lost before the node '
                            'saw them since last report (' + ', '.join(
                                f'{t}: {n}' for t, n in sorted(self.lost.items())) + ')')
        failed = [g for g in guards if g.failed_checkpoints]
        for g in failed:
            problems.append(f'{g.label}{g.failed_checkpoints} checkpoint writes failed; last: '
                            f'{g.last_checkpoint_failure}')
        if status.held_sessions:
            problems.append(f'sessions held after a poisoned step: {list(status.held_sessions)}')
        failures = self.callback_failures
        if failures > reported['failures']:
            problems.append(f'{failures - reported["failures"]} callbacks failed and were '
                            'dropped since last report (the error log names them)')
        self._reported = {'rejected': rejected, 'lost': lost, 'failures': failures}
        determinism = engine.determinism if engine is not None else {}
        if determinism.get('deterministic') is False:
            problems.append('the policy step is not reproducible run to run (replays '
                            f'differed by up to {determinism.get("max_abs_diff")})')
        diag = DiagnosticStatus(
            level=DiagnosticStatus.WARN if problems else DiagnosticStatus.OK,
            name=f'flashrt_ros: {self.name}', hardware_id=status.device,
            message='; '.join(problems) or f'{status.state}, step {status.step}')
        values = [(f, getattr(status, f)) for f in _STATUS_FIELDS]
        if guards:
            values.append(('failed_checkpoints', sum(g.failed_checkpoints for g in guards)))
        values += [('callback_failures', failures),
                   ('deterministic', determinism.get('deterministic'))]
        if len(guards) > 1:
            for g, step, episode in zip(guards, status.session_steps, status.session_episodes):
                values.append((f'session {g.name}', f'step {step}, episode {episode}, ' + (
                    'held' if g.held else 'running') + f', {g.checkpoints_taken} checkpoints '
                    f'({g.failed_checkpoints} failed)'))
        values += [(f'refused: {reason}', count)
                   for reason, count in sorted(self.refusals.items())]
        diag.values = [KeyValue(key=k, value=str(v)) for k, v in values]
        return diag
