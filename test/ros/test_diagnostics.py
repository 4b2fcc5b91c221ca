"""The policy node's /diagnostics over real rclpy and Fast DDS, as diagnostic_aggregator and
rqt_robot_monitor see it: one entry per node by its fully qualified name (and per session of
a fleet), levels that say what holds now (ERROR while held, WARN while refusals are recent,
OK otherwise), and drop counts that an inactive period does not inflate."""
import math
import os
import threading
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytestmark = pytest.mark.ros

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from flashrt_ros.client import PolicyClient, spin_in_thread  # noqa: E402
from flashrt_ros.node.policy_node import PolicyNode  # noqa: E402
from support.common import obs, obs_range, wait_for  # noqa: E402
from support.nodes import RECURRENT, SUCCESS  # noqa: E402

OK, WARN, ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR
BAD = [0.0] * 5                 # obs_dim is 6: refused, counted under 'observation'
NAMES = ['alpha', 'beta', 'gamma']


class Monitor:
    """Every /diagnostics array a node receives: (arrival time, {status name: status})."""

    def __init__(self, node):
        self.reports, self._lock = [], threading.Lock()
        node.create_subscription(DiagnosticArray, '/diagnostics', self._got, 100)

    def _got(self, msg):
        with self._lock:
            self.reports.append((time.monotonic(), {s.name: s for s in msg.status}))

    def of(self, name, since=0.0):
        """[(arrival time, status)] of the entry `name` that arrived after `since`."""
        with self._lock:
            return [(t, r[name]) for t, r in self.reports if name in r and t > since]

    def wait(self, name, level, since=0.0, what=''):
        """The first entry `name` at `level` that arrived after `since`: (time, status)."""
        wait_for(lambda: any(d.level == level for _, d in self.of(name, since)),
                 what=what or f'{name} at level {level!r}')
        return next((t, d) for t, d in self.of(name, since) if d.level == level)


def _levels(entries):
    return [d.level for _, d in entries]


def _poison(engine, session=0):
    """NaN into a session's recurrent state, between two steps (the engine's lock)."""
    with engine._lock:
        views = engine.arena.session_views[session] if engine.sessions > 1 else engine.arena
        views['hidden_state'].fill_(math.nan)


class Nodes:
    """Policy nodes made here (each on its own executor) and a client node: closed by the
    `ros` fixture like a Harness."""

    def __init__(self, tmp_path):
        self.tmp_path, self.nodes, self.spinners = tmp_path, [], []
        self.client = rclpy.create_node(f'flashrt_diag_client_{os.getpid()}_{id(self)}')
        self.monitor = Monitor(self.client)
        self.spinners.append(spin_in_thread(self.client))

    def policy(self, name, namespace='/', **params):
        params = dict(device='cpu', status_period=0.1, capsule_dir=str(
            self.tmp_path / f'capsules{len(self.nodes)}'), **params)
        node = PolicyNode(name, namespace=namespace, parameter_overrides=[
            Parameter(k, value=v) for k, v in params.items()])
        self.nodes.append(node)
        self.spinners.append(spin_in_thread(node))
        assert node.trigger_configure() == SUCCESS
        assert node.trigger_activate() == SUCCESS
        wait_for(lambda: node.diagnostics_pub.get_subscription_count() > 0,
                 what='diagnostics match')
        return node

    def policy_client(self, node, session=''):
        client = PolicyClient(self.client, node.get_fully_qualified_name(), timeout=30.0,
                              session=session)
        client.wait_ready()
        return client

    def close(self):
        for spinner in self.spinners:
            spinner.shutdown()
        for node in self.nodes:
            node.destroy_node()
        self.client.destroy_node()


@pytest.fixture
def nodes(ros, tmp_path):
    made = Nodes(tmp_path)
    ros.append(made)
    return made


def test_same_name_in_two_namespaces_reports_two_entries(nodes):
    name = f'flashrt_policy_diag_{os.getpid()}'
    robot1 = nodes.policy(name, '/robot1', **RECURRENT)
    nodes.policy(name, '/robot2', **RECURRENT)
    one, two = f'flashrt_ros: /robot1/{name}', f'flashrt_ros: /robot2/{name}'
    _, first = nodes.monitor.wait(one, OK)
    _, second = nodes.monitor.wait(two, OK)
    assert first.hardware_id != second.hardware_id
    for ns, entry in (('/robot1', first), ('/robot2', second)):
        assert f'{ns}/{name}' in entry.hardware_id and 'cpu' in entry.hardware_id, entry
        values = {kv.key: kv.value for kv in entry.values}
        assert values['node'] == f'{ns}/{name}' and values['device'] == 'cpu', values
    # one robot's refusal is that robot's WARN alone
    since = time.monotonic()
    nodes.policy_client(robot1).publish_only(BAD)
    warned_at, warn = nodes.monitor.wait(one, WARN, since)
    assert 'refused' in warn.message and 'shape' in warn.message, warn.message
    nodes.monitor.wait(two, OK, warned_at, what='robot2 reporting after robot1 warned')
    assert set(_levels(nodes.monitor.of(two))) == {OK}


def test_held_node_reports_error_on_every_status_until_recovered(make):
    h = make(dict(RECURRENT, on_poison='hold', checkpoint_every=5))
    h.node.report.window = 0.5      # s: the WARN of the refusals while held ends soon after
    monitor, mine = Monitor(h.client_node), f'flashrt_ros: /{h.name}'
    wait_for(lambda: h.node.diagnostics_pub.get_subscription_count() > 0, what='match')
    observations = obs_range(0, 12)
    ref = h.reference(observations)
    assert h.steps(observations[:7]) == ref[:7]             # checkpoint after step 5
    _poison(h.node.engine)
    h.client.publish_only(observations[7])                  # poisoned: held, no action
    held_at, error = monitor.wait(mine, ERROR, what='ERROR while held')
    assert 'held' in error.message and 'recover' in error.message, error.message
    h.client.publish_only(observations[7])                  # refused while held: still ERROR
    # held for several windows: the level is the hold's, not a refusal's or poison's
    wait_for(lambda: monitor.of(mine, held_at)
             and monitor.of(mine, held_at)[-1][0] - held_at > 4 * h.node.report.window,
             what='statuses over four windows of the hold')
    recovering = time.monotonic()
    r = h.call('recover')
    assert r.success and 'checkpoint-00000001' in r.message, r.message
    while_held = monitor.of(mine, held_at - 1e-9)
    while_held = [e for e in while_held if e[0] < recovering]
    assert len(while_held) >= 10 and set(_levels(while_held)) == {ERROR}, _levels(while_held)
    ok_at, ok = monitor.wait(mine, OK, recovering, what='OK after the recovery')
    assert ERROR not in _levels([e for e in monitor.of(mine, recovering) if e[0] > ok_at])
    assert h.steps(observations[5:12]) == ref[5:12]


def test_refusal_warns_for_the_window_then_ok(make):
    h = make()
    window = h.node.report.window = 1.0
    monitor, mine = Monitor(h.client_node), f'flashrt_ros: /{h.name}'
    wait_for(lambda: h.node.diagnostics_pub.get_subscription_count() > 0, what='match')
    assert h.steps(obs_range(0, 3))
    monitor.wait(mine, OK, what='OK before the refusal')
    sent = time.monotonic()
    h.client.publish_only(BAD)
    warned_at, warn = monitor.wait(mine, WARN, sent)
    ok_at, ok = monitor.wait(mine, OK, warned_at, what='OK after the window')
    run = _levels([e for e in monitor.of(mine, sent) if e[0] < ok_at])
    assert run and set(run) == {WARN} and len(run) >= 3, run     # steady, not one flicker
    assert ok_at - sent >= window, 'OK before the window had passed'
    assert '1 step refused' in warn.message and 'shape' in warn.message, warn.message
    values = {kv.key: kv.value for kv in warn.values}
    assert values['refused: observation'] == '1' and values['refused_recently'] == '1', values
    assert ok.message.startswith('active'), ok.message
    values = {kv.key: kv.value for kv in ok.values}
    assert values['refused: observation'] == '1' and values['refused_recently'] == '0', values


def test_fleet_reports_each_session(nodes):
    name = f'flashrt_fleet_diag_{os.getpid()}'
    node = nodes.policy(name, policy_type='recurrent', obs_dim=6, act_dim=3,
                        rnn_hidden_dim=16, sessions=3, session_names=NAMES, on_poison='hold')
    node.report.window = 0.5
    monitor, base = nodes.monitor, f'flashrt_ros: /{name}'
    entries = [base] + [f'{base}/session {n}' for n in NAMES]
    clients = {n: nodes.policy_client(node, n) for n in NAMES}
    for n in NAMES:
        clients[n].step(obs(0))

    def report(since, **levels):
        """The first report after `since` with these levels ({session: level, node=...})."""
        want = {(base if k == 'node' else f'{base}/session {k}'): v for k, v in levels.items()}

        def found():
            with monitor._lock:
                return next(((t, r) for t, r in monitor.reports if t > since and all(
                    k in r and r[k].level == v for k, v in want.items())), None)
        wait_for(lambda: found() is not None, what=f'a report with {levels}')
        return found()

    t, r = report(0.0, node=OK, alpha=OK, beta=OK, gamma=OK)
    assert all(r[e].hardware_id == f'/{name}@cpu' for e in entries), r
    values = {kv.key: kv.value for kv in r[f'{base}/session beta'].values}
    assert values['session'] == 'beta' and values['held'] == 'False', values

    since = time.monotonic()
    clients['beta'].publish_only(BAD)       # beta's refusal: beta and the node WARN, only
    t, r = report(since, node=WARN, beta=WARN)
    assert r[f'{base}/session alpha'].level == OK and r[f'{base}/session gamma'].level == OK
    assert 'session beta: observation has shape' in r[f'{base}/session beta'].message
    values = {kv.key: kv.value for kv in r[f'{base}/session beta'].values}
    assert values['refused'] == '1' and values['refused_recently'] == '1', values

    t, _ = report(t, node=OK, beta=OK)     # after the window
    _poison(node.engine, 2)
    clients['gamma'].publish_only(obs(1))   # gamma poisoned: held, no action
    t, r = report(t, node=ERROR, gamma=ERROR)
    assert "['gamma']" in r[base].message, r[base].message
    assert 'held' in r[f'{base}/session gamma'].message
    assert r[f'{base}/session alpha'].level == OK and r[f'{base}/session beta'].level == OK
    assert clients['alpha'].step(obs(1))    # the others run on; gamma stays ERROR
    t, r = report(time.monotonic() + 2 * node.report.window, gamma=ERROR, alpha=OK)
    recovering = time.monotonic()
    response = clients['alpha'].call('recover')[0]
    assert response.success and 'session gamma: recovered' in response.message
    report(recovering, node=OK, alpha=OK, beta=OK, gamma=OK)


def test_readings_published_while_inactive_are_not_lost(make):
    h = make()
    assert h.steps(obs_range(0, 3))
    h.deactivate()
    for i in range(3, 6):       # nobody subscribes: not readings the node lost
        h.client.publish_only(obs(i))
    h.activate()
    assert h.steps(obs_range(6, 2))
    wait_for(lambda: h.client.last_status is not None and h.client.last_status.step == 5,
             what='status after the fifth step')
    assert h.client.last_status.dropped_observations == 0
    assert h.node.report.lost == {}
