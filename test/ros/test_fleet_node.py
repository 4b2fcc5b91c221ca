"""A fleet node: sessions > 1 over real rclpy and Fast DDS.

Per-session topics (~/<name>/observation -> ~/<name>/action), the batched farm topic
(~/observations -> ~/actions), and the capsule services addressed by their session field;
every action compared bit for bit with a single-session engine of the same policy.
"""
import array
import itertools
import math
import os
import threading

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytestmark = pytest.mark.ros

from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402
from std_msgs.msg import Float32MultiArray  # noqa: E402
from flashrt_ros import msg as fmsg  # noqa: E402
from flashrt_ros.client import call_service, spin_in_thread  # noqa: E402
from flashrt_ros.interfaces import SERVICE_TYPES  # noqa: E402
from flashrt_ros.node.policy_node import PolicyNode  # noqa: E402
from support.common import obs, wait_for  # noqa: E402
from support.nodes import reference_actions, SUCCESS  # noqa: E402

NAMES = ['alpha', 'beta', 'gamma']
PARAMS = dict(policy_type='recurrent', obs_dim=6, act_dim=3, rnn_hidden_dim=16,
              sessions=3, session_names=NAMES)


class Fleet:
    """A fleet PolicyNode and a client node with a publisher/subscriber per session."""

    def __init__(self, tmp_path, params):
        self.name = f'flashrt_fleet_{os.getpid()}_{id(self)}'
        self.params = dict(device='cpu', capsule_dir=str(tmp_path / 'capsules'),
                           status_period=0.1, **params)
        self.node = PolicyNode(self.name, parameter_overrides=[
            Parameter(k, value=v) for k, v in self.params.items()])
        self.client = rclpy.create_node(self.name + '_client')
        qos = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        base = '/' + self.name
        self.cond = threading.Condition()
        self.actions = {n: [] for n in NAMES + ['*']}
        self.pubs = {n: self.client.create_publisher(Float32MultiArray,
                                                     f'{base}/{n}/observation', qos)
                     for n in NAMES}
        self.pubs['*'] = self.client.create_publisher(Float32MultiArray, f'{base}/observations',
                                                      qos)
        for n in NAMES + ['*']:
            topic = f'{base}/actions' if n == '*' else f'{base}/{n}/action'
            self.client.create_subscription(Float32MultiArray, topic,
                                            lambda m, n=n: self._got(n, m), qos)
        self.status = None
        self.client.create_subscription(fmsg.PolicyStatus, f'{base}/status',
                                        lambda m: setattr(self, 'status', m), 10)
        self.services = {k: self.client.create_client(t, f'{base}/{k}')
                         for k, t in SERVICE_TYPES.items()}
        self.spinners = [spin_in_thread(self.node), spin_in_thread(self.client)]
        assert self.node.trigger_configure() == SUCCESS
        assert self.node.trigger_activate() == SUCCESS
        for client in self.services.values():
            assert client.wait_for_service(timeout_sec=30)
        wait_for(lambda: all(p.get_subscription_count() for p in self.pubs.values())
                 and all(s.action_pub.get_subscription_count()
                         for s in self.node.parts.robot.sessions),
                 what='fleet topics')

    def _got(self, name, msg):
        with self.cond:
            self.actions[name].append(list(msg.data))
            self.cond.notify_all()

    def send(self, name, values):
        """Publishes on a session's (or '*': the batched) topic; waits for the answer."""
        with self.cond:
            seen = len(self.actions[name])
        msg = Float32MultiArray()
        msg.data = array.array('f', np.asarray(values, np.float32).reshape(-1))
        self.pubs[name].publish(msg)
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.actions[name]) > seen, 30), name
            return self.actions[name][seen]

    def call(self, service, **fields):
        request = SERVICE_TYPES[service].Request()
        for key, value in fields.items():
            setattr(request, key, value)
        return call_service(self.services[service], request, 30)[0]

    def close(self):
        for spinner in self.spinners:
            spinner.shutdown()
        self.node.destroy_node()
        self.client.destroy_node()


@pytest.fixture
def fleet(ros, tmp_path):
    f = Fleet(tmp_path, PARAMS)
    yield f
    f.close()


def _streams(t0, count):
    # session k sees its own stream: obs(t + 1000 k)
    return [[obs(t + 1000 * k) for t in range(t0, t0 + count)] for k in range(3)]


@pytest.mark.parametrize('kernels', ['default', 'batch_invariant'])
def test_per_session_topics_and_the_batched_topic_equal_single_engines(ros, tmp_path, kernels):
    # batch_invariant: the fleet steps as one batch (engine.program.batched), and is still
    # bit for bit a single-session node on the same kernels
    fleet = Fleet(tmp_path, PARAMS | {'kernels': kernels})
    try:
        assert fleet.node.engine.program.batched == (kernels == 'batch_invariant')
        _topics_equal_single_engines(fleet, tmp_path, kernels)
    finally:
        fleet.close()


def _topics_equal_single_engines(fleet, tmp_path, kernels):
    streams = _streams(0, 8)
    got = {k: [] for k in range(3)}
    for t in range(4):           # one session at a time on its own topic
        for k, name in enumerate(NAMES):
            got[k].append(fleet.send(name, streams[k][t]))
    for t in range(4, 8):        # then the whole fleet in one message per tick
        tick = fleet.send('*', [streams[k][t] for k in range(3)])
        for k in range(3):
            got[k].append(tick[3 * k:3 * k + 3])
    for k in range(3):
        _, expected = reference_actions(PARAMS | {'sessions': 1, 'session_names': [],
                                                  'kernels': kernels},
                                        streams[k], tmp_path / f'ref{k}')
        assert got[k] == expected, k          # float32 both ways: bit for bit
    # a NaN row skips that session this tick; its state is kept
    before = list(fleet.node.engine.arena.blocks[1].clone())
    tick = fleet.send('*', [obs(50), [float('nan')] * 6, obs(51)])
    assert all(np.isnan(tick[3:6])) and not any(np.isnan(tick[:3]))
    assert list(fleet.node.engine.arena.blocks[1]) == before
    wait_for(lambda: fleet.status is not None and fleet.status.sessions == 3
             and list(fleet.status.session_steps) == [9, 8, 9], what='status of the fleet')
    assert list(fleet.status.session_names) == NAMES


def test_services_address_sessions_and_clone_one_robot_onto_another(fleet):
    for t in range(5):
        fleet.send('*', [obs(t + 1000 * k) for k in range(3)])
    refusal = fleet.call('snapshot', name='x')
    assert not refusal.success and 'name one' in refusal.message
    assert not fleet.call('restore', name='x', session='delta').success
    assert fleet.call('snapshot', name='alpha5', session='alpha').success
    # indices are ASCII digits only: other scripts' digits (Arabic-Indic one, fullwidth one)
    # and a superscript two are refused by name, on every service with a session field
    for key in ('\u0661', '\uff11', '\u00b2'):
        for service, fields in (('restore', dict(name='alpha5')), ('rollback', dict(steps=1)),
                                ('reset_session', {}), ('snapshot', dict(name='u'))):
            r = fleet.call(service, session=key, **fields)
            assert not r.success and 'ASCII digits' in r.message, (service, key, r.message)
            assert repr(key) in r.message and 'internal error' not in r.message, r.message
    assert [fleet.node.engine.session(i).step_index for i in range(3)] == [5, 5, 5]
    assert fleet.call('restore', name='alpha5', session='2').success       # by index
    same = [obs(77)] * 3
    tick = fleet.send('*', same)
    assert tick[0:3] == tick[6:9] != tick[3:6]      # gamma now runs alpha's state
    # rollback and reset of one session leave the others' counters alone
    assert fleet.call('rollback', steps=1, session='beta').success
    reset = fleet.call('reset_session', session='gamma')
    assert reset.success and "session 'gamma'" in reset.message
    engine = fleet.node.engine
    assert [engine.session(i).step_index for i in range(3)] == [6, 5, 0]
    assert [engine.session(i).episode for i in range(3)] == [0, 0, 1]
    assert fleet.call('reset_episode').success
    assert [engine.session(i).episode for i in range(3)] == [1, 1, 2]
    # ~/recover (std_srvs/Trigger: no session field) with no session held: every session
    # goes back to its newest valid checkpoint, here episode_start (no periodic checkpoints)
    r = fleet.call('recover')
    assert r.success and all(f'session {n}: recovered' in r.message for n in NAMES), r.message
    assert [engine.session(i).step_index for i in range(3)] == [0, 0, 0]


def test_sessions_checkpoint_hold_recover_and_resume_alone(ros, tmp_path):
    """What a single-session node has, per session: periodic checkpoints, on_poison, a hold
    that only the poisoned session is in, ~/recover of that session alone, status and
    diagnostics naming it, and restore_on_start resuming every session from its own file."""
    params = PARAMS | dict(checkpoint_every=3, checkpoint_keep=2, checkpoint_to_disk=True,
                           on_poison='hold')
    streams = _streams(0, 12)
    refs = [reference_actions(PARAMS | {'sessions': 1, 'session_names': []}, streams[k],
                              tmp_path / f'ref{k}')[1] for k in range(3)]
    fleet = Fleet(tmp_path, params)
    try:
        engine = fleet.node.engine
        for t in range(7):                      # checkpoints after steps 3 and 6
            tick = fleet.send('*', [streams[k][t] for k in range(3)])
            assert [tick[3 * k:3 * k + 3] for k in range(3)] == [refs[k][t] for k in range(3)]
        names = sorted(c.name for c in fleet.call('list_capsules').capsules
                       if c.name.startswith('checkpoint-'))
        assert names == [f'checkpoint-{n}-0000000{i}' for n in NAMES for i in (1, 2)], names
        with engine._lock:                       # NaN into beta's recurrent state only
            engine.arena.session_views[1]['hidden_state'].fill_(math.nan)
        tick = fleet.send('*', [streams[k][7] for k in range(3)])
        assert all(np.isnan(tick[3:6])), 'a NaN action of beta was published'
        assert tick[0:3] == refs[0][7] and tick[6:9] == refs[2][7]
        wait_for(lambda: fleet.status is not None and list(fleet.status.held_sessions) == [
            'beta'], what='beta held in ~/status')
        diag = fleet.node.diagnostic(fleet.node.status_message())
        values = {kv.key: kv.value for kv in diag.values}
        assert "['beta']" in diag.message and values['session beta'].count('held') == 1
        assert 'running' in values['session alpha'], values
        tick = fleet.send('*', [streams[k][8] for k in range(3)])     # beta refused, held
        assert all(np.isnan(tick[3:6])) and tick[0:3] == refs[0][8]
        r = fleet.call('recover')                # only the held session goes back
        assert r.success and 'session beta: recovered' in r.message, r.message
        assert 'checkpoint-beta-00000002' in r.message and 'alpha' not in r.message
        assert [engine.session(i).step_index for i in range(3)] == [9, 6, 9]
        beta = [fleet.send('beta', streams[1][t]) for t in range(6, 9)]
        assert beta == refs[1][6:9]               # beta continues as if never poisoned
        steps = [engine.session(i).step_index for i in range(3)]
    finally:
        fleet.close()
    files = sorted(p.name for p in (tmp_path / 'capsules').glob('checkpoint-*'))
    assert files == sorted(f'checkpoint-{n}-0000000{i}.capsule' for n in NAMES for i in (2, 3))
    resumed = Fleet(tmp_path, params | dict(restore_on_start='latest'))
    try:                                         # each session from its own newest file
        engine = resumed.node.engine
        assert [engine.session(i).step_index for i in range(3)] == [9, 9, 9] == steps
        tick = resumed.send('*', [streams[k][9] for k in range(3)])
        assert [tick[3 * k:3 * k + 3] for k in range(3)] == [refs[k][9] for k in range(3)]
    finally:
        resumed.close()


def test_fleet_parameters_are_checked(ros, tmp_path):
    for bad, word in [(dict(session_names=['a', 'a', 'b']), 'distinct'),
                      (dict(session_names=['1a', 'b', 'c']), 'ROS name tokens')]:
        node = PolicyNode(f'flashrt_fleet_bad_{os.getpid()}', parameter_overrides=[
            Parameter(k, value=v) for k, v in dict(PARAMS, device='cpu', **bad).items()])
        try:
            assert node.trigger_configure() != SUCCESS, bad
        finally:
            node.destroy_node()


TERMS = dict(policy_type='recurrent', obs_dim=2, act_dim=2, rnn_hidden_dim=16,
             observation_type='terms', observation_terms=['joint_pos'], joint_names=['j0', 'j1'],
             default_angles=[0.0, 0.0], action_scale=[1.0], sessions=2,
             session_names=['a', 'b'])


class _Robots:
    """Joint-state publishers and joint-command subscribers of sessions a and b (or of the
    one session of a single-session node: sessions=[''])."""

    def __init__(self, fleet_name, client, sessions='ab', listen=True):
        from sensor_msgs.msg import JointState
        self.JointState, self.client = JointState, client
        self.qos = qos = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        # the readings on the node's relative names (it runs in the root namespace), the
        # commands on its own topics
        self.base = {s: f'/{fleet_name}/{s}/' if s else f'/{fleet_name}/' for s in sessions}
        self.pubs = {s: client.create_publisher(JointState, f'/{s}/joint_states' if s else
                                                '/joint_states', qos) for s in sessions}
        self.commands = {s: [] for s in sessions}
        if listen:
            self.listen()

    def listen(self):
        """Subscribes to the sessions' joint commands."""
        from std_msgs.msg import Float64MultiArray
        for s in self.commands:
            self.client.create_subscription(
                Float64MultiArray, self.base[s] + 'joint_commands',
                lambda m, s=s: self.commands[s].append(list(m.data)), self.qos)

    def publish(self, session, sec, q):
        msg = self.JointState(name=['j0', 'j1'], position=list(q), velocity=[0.0, 0.0])
        msg.header.stamp.sec = sec
        self.pubs[session].publish(msg)


_terms_nodes = itertools.count()


def _terms_fleet(tmp_path, listen=True, **extra):
    name = f'flashrt_fleet_terms_{os.getpid()}_{next(_terms_nodes)}'   # never reused
    params = dict(TERMS, device='cpu', capsule_dir=str(tmp_path / 'caps'), **extra)
    node = PolicyNode(name, parameter_overrides=[Parameter(k, value=v)
                                                 for k, v in params.items()])
    client = rclpy.create_node(name + '_client')
    robots = _Robots(name, client, 'ab' if params['sessions'] > 1 else [''], listen)
    spinners = [spin_in_thread(node), spin_in_thread(client)]
    assert node.trigger_configure() == SUCCESS and node.trigger_activate() == SUCCESS
    wait_for(lambda: all(p.get_subscription_count() for p in robots.pubs.values())
             and all(p.get_subscription_count() or not listen
                     for s in node.parts.robot.sessions for p in s.command_pubs),
             what='robot topics')
    return node, client, robots, spinners


def _close(node, client, spinners):
    for spinner in spinners:
        spinner.shutdown()
    node.destroy_node()
    client.destroy_node()


def test_lockstep_fleet_ticks_once_for_all_robots_and_does_not_wait_forever(ros, tmp_path):  # noqa: E501
    node, client, robots, spinners = _terms_fleet(tmp_path, lockstep_wait=0.2)
    try:
        engine = node.engine
        robots.publish('a', 1, [0.1, 0.2])      # the first readings introduce the robots
        robots.publish('b', 1, [0.3, 0.4])
        wait_for(lambda: all(robots.commands[s] for s in 'ab'), what='both commands')
        replays = len(engine._latencies)
        robots.publish('a', 2, [0.5, 0.6])
        robots.publish('b', 2, [0.7, 0.8])
        wait_for(lambda: all(len(robots.commands[s]) == 2 for s in 'ab'), what='2nd commands')
        # both robots answered by ONE replay of the fleet's graph
        assert len(engine._latencies) == replays + 1
        assert [engine.session(i).step_index for i in range(2)] == [2, 2]
        # robot b stalls: after lockstep_wait, a steps without it
        robots.publish('a', 3, [0.9, 1.0])
        wait_for(lambda: len(robots.commands['a']) == 3, what="a's third command")
        assert [engine.session(i).step_index for i in range(2)] == [3, 2]
        assert len(robots.commands['b']) == 2
        # b comes back: both tick together again
        robots.publish('b', 3, [1.1, 1.2])
        robots.publish('a', 4, [1.3, 1.4])
        wait_for(lambda: len(robots.commands['b']) == 3 and len(robots.commands['a']) == 4,
                 what='b back')
        assert [engine.session(i).step_index for i in range(2)] == [4, 3]
    finally:
        _close(node, client, spinners)


@pytest.mark.parametrize('sessions', [1, 2], ids=['single', 'fleet'])
def test_lockstep_new_values_of_an_answered_stamp_are_counted(ros, tmp_path, sessions):  # noqa: E501
    # a driver that leaves header.stamp at 0: its first reading steps; later ones with new
    # values cannot (one step per stamp) and must be counted and reported, not lost in silence
    from diagnostic_msgs.msg import DiagnosticArray
    from rcl_interfaces.msg import Log
    extra = {} if sessions > 1 else dict(sessions=1, session_names=[])
    node, client, robots, spinners = _terms_fleet(tmp_path, lockstep_wait=0.2, **extra)
    s = 'a' if sessions > 1 else ''
    logs, diagnostics, status = [], [], []
    client.create_subscription(Log, '/rosout', logs.append, 100)
    client.create_subscription(DiagnosticArray, '/diagnostics',
                               lambda m: diagnostics.extend(m.status), 10)
    client.create_subscription(fmsg.PolicyStatus, f'/{node.get_name()}/status',
                               status.append, 10)
    try:
        wait_for(lambda: node.diagnostics_pub.get_subscription_count() > 0
                 and node.status_pub.get_subscription_count() > 0, what='status match')
        robots.publish(s, 0, [0.1, 0.2])
        wait_for(lambda: len(robots.commands[s]) == 1, what='the first command')
        robots.publish(s, 0, [0.1, 0.2])            # the same reading again: nothing to count
        for q in ([0.3, 0.4], [0.5, 0.6], [0.7, 0.8]):
            robots.publish(s, 0, q)                  # new values, answered stamp: 3 dropped
        robots.publish(s, 1, [0.9, 1.0])            # a new stamp steps (after those, in order)
        wait_for(lambda: len(robots.commands[s]) == 2, what='the second command')
        assert node.engine.step_index == 2
        key = 'session a: stale stamp' if sessions > 1 else 'stale stamp'
        assert node.report.refusals == {key: 3}
        wait_for(lambda: status and status[-1].rejected_observations == 3,
                 what='3 refused readings in ~/status')
        mine = f'flashrt_ros: {node.get_fully_qualified_name()}'
        wait_for(lambda: any(d.name == mine and any(kv.key == f'refused: {key}'
                                                    and kv.value == '3' for kv in d.values)
                             for d in list(diagnostics)), what='the count in /diagnostics')
        wait_for(lambda: any(m.name == node.get_name() and 'stale stamp' in m.msg
                             and 'header.stamp' in m.msg for m in list(logs)),
                 what='a log naming the cause on /rosout')
    finally:
        _close(node, client, spinners)


def test_lockstep_command_that_reached_nobody_is_sent_again_once(ros, tmp_path):
    # a world that subscribes late (or a node still in discovery after a restart): the
    # command answering readings 0 goes out to no subscriber. The world's re-send of readings
    # 0 must get it (else lock-step stalls for good), but once it has reached the world, a
    # further re-send must not (a world steps on every command it receives).
    node, client, robots, spinners = _terms_fleet(tmp_path, listen=False, lockstep_wait=0.2,
                                                  sessions=1, session_names=[])
    try:
        [session] = node.parts.robot.sessions
        robots.publish('', 0, [0.1, 0.2])
        wait_for(lambda: node.engine.step_index == 1 and session.unsent is not None,
                 what='the first step, its command to nobody')
        robots.listen()
        wait_for(lambda: session.command_pubs[0].get_subscription_count() > 0,
                 what="the node's command publisher matched")
        robots.publish('', 0, [0.1, 0.2])           # the world re-sends readings 0
        wait_for(lambda: len(robots.commands['']) == 1, what='the command of readings 0')
        robots.publish('', 0, [0.1, 0.2])           # again, now delivered: no command
        robots.publish('', 1, [0.3, 0.4])
        wait_for(lambda: len(robots.commands['']) == 2, what='the command of readings 1')
        assert node.engine.step_index == 2          # readings 0 stepped once
        cfg = dict(PARAMS, **{k: v for k, v in TERMS.items() if k in ('obs_dim', 'act_dim')})
        _, expected = reference_actions(dict(cfg, sessions=1, session_names=[]),
                                        [[0.1, 0.2], [0.3, 0.4]], tmp_path / 'ref')
        assert robots.commands[''] == expected      # one command per readings, in order
    finally:
        _close(node, client, spinners)


def test_commands_reach_a_reliable_controller_with_best_effort_observations(ros, tmp_path):
    # ros2_controllers subscribe to commands reliably (SystemDefaultsQoS): a best-effort
    # command publisher (it followed qos_reliability) never matched them
    node, client, robots, spinners = _terms_fleet(tmp_path, qos_reliability='best_effort',
                                                  sessions=1, session_names=[])
    try:
        robots.publish('', 0, [0.1, 0.2])
        wait_for(lambda: len(robots.commands['']) == 1, what='the command')
    finally:
        _close(node, client, spinners)


def test_timer_fleet_steps_the_robots_with_fresh_readings(ros, tmp_path):
    node, client, robots, spinners = _terms_fleet(tmp_path, control_mode='timer',
                                                  control_rate=50.0, max_input_age=5.0)
    try:
        engine = node.engine
        robots.publish('a', 1, [0.1, 0.2])
        wait_for(lambda: len(robots.commands['a']) >= 3, what="a's commands")
        assert engine.session(1).step_index == 0 and not robots.commands['b']
        assert any(k.startswith('session b: missing input') for k in node.report.refusals)
        robots.publish('b', 1, [0.3, 0.4])
        wait_for(lambda: len(robots.commands['b']) >= 3, what="b's commands")
        # a reference engine stepping the same reading gives a's first actions (targets =
        # default 0 + 1.0 * action, float64 of the float32 action)
        cfg = dict(PARAMS, **{k: v for k, v in TERMS.items() if k in ('obs_dim', 'act_dim')})
        _, expected = reference_actions(dict(cfg, sessions=1, session_names=[]),
                                        [[0.1, 0.2]] * 3, tmp_path / 'ref')
        assert robots.commands['a'][:3] == expected
    finally:
        _close(node, client, spinners)
