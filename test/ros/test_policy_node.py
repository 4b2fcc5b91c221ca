"""The flashrt_policy lifecycle node over real rclpy and Fast DDS, driven by a PolicyClient.

Each test creates a PolicyNode in-process and a PolicyClient on a second node, each spun by its
own executor in a thread; lifecycle transitions go through the node's ~/change_state service,
so they run on the node's executor as they do under `ros2 lifecycle` or a lifecycle manager.
Actions are compared, bit for bit, with a reference engine (the same policy, built in-process
without ROS) that never saw the refused inputs or calls.
"""
import os
import random
import shutil
import threading
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytestmark = pytest.mark.ros

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from sensor_msgs.msg import JointState  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from flashrt_ros.runtime.capsule import Capsule  # noqa: E402
from flashrt_ros.client import spin_in_thread  # noqa: E402
from flashrt_ros.node import parameters as node_params  # noqa: E402
from flashrt_ros.node.policy_node import PolicyNode  # noqa: E402
from support.common import obs, obs_range, wait_for  # noqa: E402
from support.nodes import RECURRENT, reference_actions, SUCCESS  # noqa: E402

HISTORY = dict(policy_type='history', obs_dim=6, act_dim=3, d_model=32, n_layers=2, heads=2,
               history_capacity=256, chunk=4)


def refused(response, *words):
    assert response.success is False, response.message
    for word in words:
        assert word in response.message, (word, response.message)
    assert 'internal error' not in response.message


# -- success paths ----------------------------------------------------------------------------

def test_every_service_success_path(make):
    h = make()
    observations = obs_range(0, 30)
    ref = h.reference(observations)
    assert h.steps(observations[:10]) == ref[:10]

    r = h.call('snapshot', name='s10', pin=True)
    assert r.success, r.message
    assert (r.capsule.name, r.capsule.step, r.capsule.pinned) == ('s10', 10, True)
    assert r.capsule.nbytes > 0 and len(r.capsule.schema_digest) == 64
    assert r.latency_us > 0

    r = h.call('snapshot')          # generated name
    assert r.success and r.capsule.name, r.message

    lst = h.call('list_capsules')
    assert [c.name for c in lst.capsules] == sorted(['episode_start', 's10', r.capsule.name])
    assert lst.device_bytes_used == sum(c.nbytes for c in lst.capsules)
    assert lst.device_bytes_budget == h.params.get('device_budget_mb', 1024) << 20
    assert lst.host_bytes_budget == h.params.get('host_budget_mb', 4096) << 20

    r = h.call('fork', source='', target='live10')
    assert r.success and r.capsule.step == 10, r.message
    r = h.call('fork', source='s10', target='copy10')
    assert r.success and r.capsule.parent == 's10' and not r.capsule.pinned, r.message
    r = h.call('delete_capsule', name='live10')
    assert r.success, r.message
    assert 'live10' not in h.names()

    assert h.steps(observations[10:15]) == ref[10:15]
    r = h.call('rollback', steps=5)
    assert r.success and r.step == 10, r.message
    assert h.steps(observations[10:20]) == ref[10:20]

    r = h.call('save_capsule', name='copy10')
    assert r.success, r.message
    assert r.path == os.path.join(h.params['capsule_dir'], 'copy10.capsule')
    assert os.path.isfile(r.path) and r.nbytes > 0
    r = h.call('save_capsule', name='s10', path='sub/s10.file')
    assert r.success and r.path.endswith('sub/s10.file'), r.message
    r = h.call('load_capsule', path='copy10.capsule', name='loaded10')
    assert r.success and r.capsule.name == 'loaded10' and r.capsule.step == 10, r.message

    r = h.call('restore', name='loaded10')
    assert r.success and r.capsule.step == 10, r.message
    assert h.steps(observations[10:30]) == ref[10:30]

    r = h.call('reset_episode')
    assert r.success and 'episode 1' in r.message, r.message
    assert h.steps(observations[:5]) == ref[:5]


# -- refusals ---------------------------------------------------------------------------------

def foreign_capsule(h, params, name):
    """A capsule file saved by another engine into the node's capsule directory."""
    engine, _ = reference_actions(dict(h.params, **params), obs_range(0, 3), h.tmp_path / 'f')
    engine.snapshot(name)
    os.makedirs(h.params['capsule_dir'], exist_ok=True)
    shutil.copy(engine.save(name).path, h.params['capsule_dir'])
    return engine


def test_refusals_change_nothing(make):
    h = make()
    observations = obs_range(0, 40)
    ref = h.reference(observations)
    got = h.steps(observations[:5])
    assert h.call('snapshot', name='keep').success
    r = h.call('save_capsule', name='keep')
    assert r.success, r.message
    saved = r.path
    with open(saved, 'rb') as f:
        good = f.read()
    with open(os.path.join(h.params['capsule_dir'], 'flipped.capsule'), 'wb') as f:
        f.write(good[:-7] + bytes([good[-7] ^ 0x01]) + good[-6:])
    with open(os.path.join(h.params['capsule_dir'], 'short.capsule'), 'wb') as f:
        f.write(good[:len(good) // 2])
    other_model = foreign_capsule(h, dict(seed=1), 'other_model')
    other_schema = foreign_capsule(h, dict(rnn_hidden_dim=32), 'other_schema')
    digest = h.node.engine.model_digest
    schema = h.node.engine.arena.schema_digest
    before = h.call('list_capsules').capsules

    calls = [
        ('restore', dict(name='nope'), ['nope']),
        ('delete_capsule', dict(name='nope'), ['nope']),
        ('save_capsule', dict(name='nope'), ['nope']),
        ('fork', dict(source='nope', target='x'), ['nope']),
        ('restore', dict(name='a/b'), ['a/b', 'not allowed']),
        ('snapshot', dict(name='a/b'), ['a/b', 'not allowed']),
        ('snapshot', dict(name='..'), ['not allowed']),
        ('fork', dict(source='', target='..'), ['not allowed']),
        ('fork', dict(source='keep', target='a/b'), ['not allowed']),
        ('load_capsule', dict(path='keep.capsule', name='a/b'), ['not allowed']),
        ('snapshot', dict(name='keep'), ['exists']),
        ('save_capsule', dict(name='keep', path='../escape.capsule'),
         ['outside the capsule directory']),
        ('save_capsule', dict(name='keep', path=str(h.tmp_path / 'abs.capsule')),
         ['outside the capsule directory']),
        ('load_capsule', dict(path='../../etc/passwd'), ['outside the capsule directory']),
        ('load_capsule', dict(path='missing.capsule'), ['no capsule file']),
        ('load_capsule', dict(path='flipped.capsule', name='flipped'), ['checksum']),
        ('load_capsule', dict(path='short.capsule', name='short'), ['truncated']),
        ('load_capsule', dict(path='other_model.capsule'),
         ['model digest', digest[:12], other_model.model_digest[:12]]),
        ('load_capsule', dict(path='other_schema.capsule'),
         ['schema digest', schema[:12], other_schema.arena.schema_digest[:12]]),
        ('load_capsule', dict(path='keep.capsule'), ['exists']),
        ('rollback', dict(steps=0), ['>= 1']),
        ('rollback', dict(steps=33), ['cannot roll back 33 steps', 'ring depth 32']),
        ('rollback', dict(steps=10 ** 6), ['available']),
    ]
    t = 5
    for service, fields, words in calls:
        refused(h.call(service, **fields), *words)
        assert h.call('list_capsules').capsules == before, (service, fields)
        got.append(h.client.step(observations[t]))
        t += 1
    assert not os.path.exists(h.tmp_path / 'escape.capsule')
    assert not os.path.exists(h.tmp_path / 'abs.capsule')
    with open(saved, 'rb') as f:
        assert f.read() == good
    assert got == ref[:t]


def test_budget_full_refuses_and_keeps_state(make):
    # A pinned episode_start capsule of this policy is a few hundred bytes; 1 MiB of host
    # budget holds it, and a zero device budget leaves no room for anything else but demotion.
    h = make(dict(RECURRENT, device_budget_mb=0, host_budget_mb=0))
    observations = obs_range(0, 8)
    ref = h.reference(observations)
    got = h.steps(observations[:2])
    before = h.call('list_capsules').capsules
    for service, fields in (('snapshot', dict(name='big')), ('fork', dict(target='f')),
                            ('snapshot', dict(name='p', pin=True))):
        refused(h.call(service, **fields), 'budget')
        assert h.call('list_capsules').capsules == before
        got += h.steps(observations[len(got):len(got) + 2])
    assert got == ref[:len(got)]
    assert h.call('reset_episode').success
    assert h.steps(observations[:2]) == ref[:2]


def test_calls_while_inactive_are_refused(make):
    h = make()
    observations = obs_range(0, 10)
    ref = h.reference(observations)
    got = h.steps(observations[:3])
    assert h.call('snapshot', name='mid').success
    before = h.call('list_capsules').capsules
    h.deactivate()
    for service, fields in (('snapshot', dict(name='x')), ('restore', dict(name='mid')),
                            ('fork', dict(source='mid', target='y')), ('rollback', dict(steps=1)),
                            ('delete_capsule', dict(name='mid')),
                            ('save_capsule', dict(name='mid')),
                            ('load_capsule', dict(path='mid.capsule')), ('reset_episode', {})):
        refused(h.call(service, **fields), 'not active', 'inactive')
    assert h.call('list_capsules').capsules == before
    assert not os.path.exists(os.path.join(h.params['capsule_dir'], 'mid.capsule'))
    # Observations while inactive are not stepped: no action, no state change.
    n = h.client.actions_received()
    h.client.publish_only(observations[3])
    time.sleep(0.2)     # a check for absence: time to (wrongly) answer it, and none comes
    assert h.client.actions_received() == n
    h.activate()
    got += h.steps(observations[3:])
    assert got == ref


# -- bad observations -------------------------------------------------------------------------

def test_bad_observations_refused_counted_and_harmless(make):
    h = make()
    diagnostics = []
    h.client_node.create_subscription(DiagnosticArray, '/diagnostics',
                                      lambda m: diagnostics.extend(m.status), 10)
    observations = obs_range(0, 6)
    ref = h.reference(observations)
    got = h.steps(observations[:3])
    bad = [[0.0] * 5, [0.0] * 7, [], [float('nan')] + [0.0] * 5,
           [0.0] * 5 + [float('inf')], [float('-inf')] * 6]
    wait_for(lambda: h.node.diagnostics_pub.get_subscription_count() > 0, what='diagnostics match')
    n = h.client.actions_received()
    for b in bad:
        h.client.publish_only(b)
    got += h.steps(observations[3:])          # in order after the bad ones
    assert got == ref
    assert h.client.actions_received() == n + 3
    wait_for(lambda: h.client.last_status is not None
             and h.client.last_status.rejected_observations == len(bad)
             and h.client.last_status.step == 6, what='status with 6 refused observations')
    mine = f'flashrt_ros: /{h.name}'
    wait_for(lambda: any(d.name == mine and d.level == DiagnosticStatus.WARN
                         for d in list(diagnostics)), what='WARN diagnostics')
    warn = [d for d in list(diagnostics) if d.name == mine and d.level == DiagnosticStatus.WARN]
    assert 'refused' in warn[0].message
    values = {kv.key: kv.value for kv in warn[-1].values}
    assert values['rejected_observations'] == str(len(bad))
    # the configure-time determinism probe's verdict (the CPU step replays identically)
    assert values['deterministic'] == 'True'
    assert h.node.engine.determinism['replays'] >= 3


# -- action identity --------------------------------------------------------------------------

@pytest.mark.parametrize('params', [RECURRENT, HISTORY], ids=['recurrent', 'history'])
def test_restore_replays_bit_for_bit(make, params):
    h = make(params)
    first = h.steps(obs_range(0, 12))
    assert first == h.reference(obs_range(0, 12))
    r = h.call('snapshot', name='branch')
    assert r.success and r.capsule.step == 12, r.message
    if params is HISTORY:
        assert r.capsule.position == 12
    branch = obs_range(100, 10)
    original = h.steps(branch)
    other = h.steps(obs_range(500, 4))         # wander off, then come back
    assert other != original[:4]
    r = h.call('restore', name='branch')
    assert r.success, r.message
    replay = h.steps(branch)
    assert replay == original
    wait_for(lambda: h.client.last_status is not None and h.client.last_status.step == 22,
             what='status step 22')


def test_reset_episode_restores_first_steps_and_bumps_episode(make):
    h = make()
    observations = obs_range(0, 8)
    first = h.steps(observations)
    wait_for(lambda: h.client.last_status is not None and h.client.last_status.step == 8,
             what='status at step 8')
    assert h.client.last_status.episode == 0
    r = h.call('reset_episode')
    assert r.success and 'episode_start' in r.message, r.message
    wait_for(lambda: h.client.last_status.episode == 1 and h.client.last_status.step == 0,
             what='status episode 1, step 0')
    assert h.steps(observations) == first
    assert h.call('reset_episode').success
    wait_for(lambda: h.client.last_status.episode == 2, what='status episode 2')
    assert h.steps(observations[:3]) == first[:3]


# -- lifecycle --------------------------------------------------------------------------------

def test_lifecycle_cycle(make):
    h = make()
    observations = obs_range(0, 5)
    first = h.steps(observations)
    h.deactivate()
    h.transition('cleanup')
    assert h.node.engine is None
    refused(h.call('snapshot', name='x'), 'unconfigured')
    assert h.call('list_capsules').capsules == []
    h.transition('configure')
    h.activate()
    assert h.steps(observations) == first      # a fresh engine: the first-step behaviour
    assert h.call('snapshot', name='again').success


@pytest.mark.parametrize('spin', ['single', 'multi', 'trigger'])
def test_lifecycle_cycles_while_observations_stream(make, spin):
    """50 deactivate/cleanup/configure/activate cycles while a driver streams observations at
    500 Hz: the node never dies, no callback fails, and afterwards it answers services and
    steps as a fresh engine does. 'single': main()'s single-threaded executor, transitions
    through ~/change_state; 'multi': the node composed into a multi-threaded executor, where
    a transition (default callback group) and an observation (its own group) truly run at
    once; 'trigger': trigger_* called from another thread (as autostart does) while the
    executor steps."""
    from rclpy.executors import MultiThreadedExecutor
    h = make(executor=MultiThreadedExecutor(num_threads=4) if spin == 'multi' else None)
    stop, published = threading.Event(), [0]

    def stream():
        period, t0 = 1.0 / 500, time.perf_counter()
        while not stop.is_set():
            h.client.publish_only(obs(published[0]))
            published[0] += 1
            stop.wait(max(0.0, t0 + published[0] * period - time.perf_counter()))

    def transition(label):
        if spin == 'trigger':
            assert getattr(h.node, f'trigger_{label}')() == SUCCESS, label
        else:
            h.transition(label)

    streamer = threading.Thread(target=stream)
    streamer.start()
    t0 = time.monotonic()
    try:
        for cycle in range(50):
            # a step in every cycle: observations reach a configured, active node, so the
            # transitions below meet callbacks in flight
            answered = h.client.actions_received()
            wait_for(lambda: h.client.actions_received() > answered, timeout=10.0,
                     what=f'an action in cycle {cycle}')
            for label in ('deactivate', 'cleanup', 'configure', 'activate'):
                transition(label)
    finally:
        stop.set()
        streamer.join(10)
    took = time.monotonic() - t0
    node = h.node
    print(f'{spin}: 50 cycles in {took:.1f} s, {published[0]} observations streamed, '
          f'{h.client.actions_received()} answered, {h.node_spinner.wait_set_races} '
          'wait sets rebuilt after rclpy\'s destroy race')
    assert h.node_spinner.thread.is_alive() and not h.node_spinner.failures, \
        h.node_spinner.failures
    assert node.report.callback_failures == 0
    # still alive: a clean activation (the stream's queued messages go with the old
    # subscription), then services and steps as on a fresh engine
    h.deactivate()
    h.activate()
    assert h.call('reset_episode').success
    observations = obs_range(0, 5)
    assert h.steps(observations) == h.reference(observations)
    r = h.call('snapshot', name='after_cycles')
    assert r.success and r.capsule.step == 5, r.message


def test_out_of_range_parameters_are_refused_up_front(make):
    # ranges live in the parameter descriptors: a params file out of range fails at start,
    # naming the parameter; a set out of range or off its choices is refused and changes
    # nothing
    for name in ('obs_dim', 'rollback_depth'):
        with pytest.raises(rclpy.exceptions.InvalidParameterValueException, match=name):
            make(dict(RECURRENT, **{name: 0}), start=False)
    h = make(RECURRENT, start=False)
    for name, value, says in (('obs_dim', 0, 'obs_dim'), ('qos_reliability', 'bogus', 'one of'),
                              ('obs_history', 0, 'obs_history'), ('activation', 7, 'type')):
        result = h.node.set_parameters([Parameter(name, value=value)])[0]
        assert not result.successful and says in result.reason, result.reason
    assert h.node.get_parameter('qos_reliability').value == 'reliable'
    # configured: settings that shape the engine are refused with what to do instead; live
    # ones apply at once
    h.transition('configure')
    result = h.node.set_parameters([Parameter('obs_dim', value=7)])[0]
    assert not result.successful and 'cleanup' in result.reason
    assert h.node.set_parameters([Parameter('checkpoint_keep', value=5)])[0].successful
    assert h.node.settings.node.checkpoint_keep == 5


@pytest.mark.parametrize('name, value', [('policy_type', 'foo'), ('device', 'tpu'),
                                         ('policy_file', '/nonexistent/policy.pt')])
def test_invalid_parameter_fails_configure(make, capfd, name, value):
    h = make(dict(RECURRENT, **{name: value}), start=False)
    assert h.client.change_state('configure') is False
    assert h.node.engine is None
    err = ''
    deadline = time.monotonic() + 5
    while f"parameter '{name}'" not in err and time.monotonic() < deadline:
        err += capfd.readouterr().err
        time.sleep(0.01)        # the poll interval of a wait on the log line, 5 s at most
    assert 'configure failed' in err and f"parameter '{name}'" in err, err
    # Fixing the parameter makes the next configure work.
    good = dict({f.name: node_params._default(f) for f in node_params.ALL_FIELDS},
                device='cpu', **RECURRENT)[name]
    h.node.set_parameters([Parameter(name, value=good)])
    h.transition('configure')
    h.activate()
    assert len(h.client.step(obs(0))) == 3


# -- concurrency ------------------------------------------------------------------------------

def test_concurrent_calls_race_with_stream(make):
    # The node spins as main() spins it; the calls race from 3 client threads against a 4th
    # that streams. (Callbacks truly concurrent inside the engine: test_engine's race test.)
    h = make()
    stop = threading.Event()
    errors, taken, outcomes, streamed = [], [], [], [0]

    def stream():
        try:
            while not stop.is_set():
                h.client.step(obs(streamed[0]))
                streamed[0] += 1
        except Exception as exc:  # noqa: B902 - reported by the main thread
            errors.append(exc)

    def steps_pass(n):
        # Calls interleave with steps on any machine speed: each op waits for fresh steps
        # (a rollback needs some since the last restore), so the race is real everywhere.
        target = streamed[0] + n
        wait_for(lambda: streamed[0] >= target or errors or stop.is_set(), what='steps')

    def worker(seed):
        rnd = random.Random(seed)
        try:
            for i in range(40):
                op = rnd.choice(['snapshot', 'restore', 'rollback', 'list', 'fork', 'delete'])
                steps_pass(2 if op == 'rollback' else 1)
                if op == 'snapshot':
                    r = h.call('snapshot', name=f'race-{seed}-{i}')
                    if r.success:
                        taken.append(r.capsule.name)
                elif op == 'restore':
                    r = h.call('restore', name=rnd.choice(taken or ['episode_start']))
                elif op == 'rollback':
                    r = h.call('rollback', steps=rnd.randint(1, 2))
                elif op == 'fork':
                    r = h.call('fork', source='', target=f'fork-{seed}-{i}')
                elif op == 'delete':     # a fork of this worker, maybe never taken
                    r = h.call('delete_capsule', name=f'fork-{seed}-{rnd.randrange(i + 1)}')
                else:
                    assert h.call('list_capsules').capsules
                    continue
                assert r.success or (r.message and 'internal error' not in r.message), r.message
                outcomes.append((op, r.success))
        except Exception as exc:  # noqa: B902
            errors.append(exc)

    streamer = threading.Thread(target=stream)
    streamer.start()
    workers = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    stop.set()
    streamer.join(30)
    assert not errors, errors
    assert len(taken) >= 5
    # It was a race: steps ran while the calls did, and restores and rollbacks took effect.
    assert streamed[0] >= 20, streamed
    for op in ('restore', 'rollback'):
        assert (op, True) in outcomes, outcomes
    engine = h.node.engine
    names = h.names()
    continuation = obs_range(1000, 6)
    for name in taken[:: max(1, len(taken) // 4)]:
        assert name in names
        m = engine.store.get(name).manifest
        meta = engine.arena.unpack(engine.store.data_on(name, 'cpu'), m.position)['meta']
        assert meta[:3].tolist() == [m.step, m.episode, m.position], name  # not torn
        r = h.call('restore', name=name)
        assert r.success and r.capsule.step == m.step, r.message
        a = h.steps(continuation)
        assert h.call('restore', name=name).success
        assert h.steps(continuation) == a, name
        # The continuation equals that of the capsule's bytes on a fresh engine.
        ref, _ = reference_actions(h.params, [], h.tmp_path / f'ref-{name}')
        ref.store.put(Capsule(m._replace(tier='device', pinned=False),
                              engine.store.data_on(name, 'cpu')))
        ref.restore(name)
        assert [ref.step(o).tolist() for o in continuation] == a, name


# -- sensor_msgs/JointState topics ------------------------------------------------------------

def test_joint_state_topics_follow_the_configured_joint_order(ros, tmp_path):
    joints = ['hip', 'knee', 'ankle']
    params = dict(RECURRENT, device='cpu', capsule_dir=str(tmp_path / 'capsules'),
                  observation_type='joint_state', joint_names=joints,
                  action_joint_names=['m_hip', 'm_knee', 'm_ankle'])    # obs 6 = pos + vel
    name = f'flashrt_policy_js_{os.getpid()}'
    # No PolicyClient here: its Float32MultiArray endpoints would clash, in one process, with
    # the JointState topics of the same names.
    node = PolicyNode(name, parameter_overrides=[Parameter(k, value=v)
                                                 for k, v in params.items()])
    client = rclpy.create_node(name + '_client')
    spinners = [spin_in_thread(node), spin_in_thread(client)]
    try:
        _joint_state_round_trip(node, client, name, joints, params, tmp_path)
    finally:
        for spinner in spinners:
            spinner.shutdown()
        node.destroy_node()
        client.destroy_node()


def _joint_state_round_trip(node, client, name, joints, params, tmp_path):
    assert node.trigger_configure() == SUCCESS
    assert node.trigger_activate() == SUCCESS
    actions, got = [], threading.Event()

    def on_action(msg):
        actions.append(msg)
        got.set()
    client.create_subscription(JointState, f'/{name}/action', on_action, 10)
    pub = client.create_publisher(JointState, f'/{name}/observation', 10)
    wait_for(lambda: pub.get_subscription_count() > 0
             and node.parts.robot.sessions[0].action_pub.get_subscription_count() > 0,
             what='joint_state topics')

    observations = obs_range(0, 6)
    # the policy must see [positions, velocities] in the configured joint order
    _, ref = reference_actions(params, observations, tmp_path / 'reference')
    shuffled = [2, 0, 1]                     # the driver lists its joints in another order
    for o in observations:
        msg = JointState(name=[joints[i] for i in shuffled],
                         position=[o[i] for i in shuffled],
                         velocity=[o[3 + i] for i in shuffled])
        got.clear()
        pub.publish(msg)
        assert got.wait(30.0), 'no JointState action'
    assert [list(m.name) for m in actions] == [['m_hip', 'm_knee', 'm_ankle']] * 6
    assert [list(m.position) for m in actions] == ref      # float32 actions carried exactly

    pub.publish(JointState(name=['hip', 'knee'], position=[0.0, 0.0], velocity=[0.0, 0.0]))
    wait_for(lambda: node.rejected_observations() == 1, what='missing joint refused')
    assert len(actions) == 6


@pytest.mark.parametrize('stalled', [False, True], ids=['live', 'stalled'])
def test_500hz_burst_every_observation_answered_or_reported(make, stalled):
    """1,000 observations at 500 Hz: every one is answered (a committed step) or reported as
    lost (status.dropped_observations, from gaps in the publisher's sequence numbers) or
    refused. 'stalled' holds the engine's lock through the burst with a queue of 1, so the
    node cannot keep up and most observations must be lost, and reported. A gap is counted
    from the first reading the node saw (a baseline: what a publisher sent before that may
    predate the subscription), so one observation is answered before the burst: under load
    the burst's first reading can be overwritten in the queue of 1 before the node takes it
    (CI at 25ad913 lost 1 of 1,000 that way)."""
    h = make(dict(RECURRENT, qos_depth=1 if stalled else 100))
    diagnostics = []
    h.client_node.create_subscription(DiagnosticArray, '/diagnostics',
                                      lambda m: diagnostics.extend(m.status), 10)
    wait_for(lambda: h.node.diagnostics_pub.get_subscription_count() > 0, what='diagnostics match')
    h.client.publish_only(obs(0))
    wait_for(lambda: h.client.last_status is not None and h.client.last_status.step == 1,
             what='the baseline observation answered')
    sent, period = 1 + 1000, 1.0 / 500
    lock = h.node.engine._lock
    if stalled:
        lock.acquire()
    try:
        t0 = time.perf_counter()
        for i in range(1, sent):
            h.client.publish_only(obs(i))
            time.sleep(max(0.0, t0 + i * period - time.perf_counter()))     # 500 Hz
    finally:
        if stalled:
            lock.release()

    def accounted():
        s = h.client.last_status
        return s is not None and s.step + s.dropped_observations + s.rejected_observations \
            == sent
    wait_for(accounted, what='every observation answered or reported in ~/status')
    s = h.client.last_status
    print(f'{"stalled" if stalled else "live"}: {s.step} answered, {s.dropped_observations} '
          f'reported lost, {s.rejected_observations} refused of {sent}')
    if stalled:
        assert s.dropped_observations > sent // 2
        mine = f'flashrt_ros: /{h.name}'
        wait_for(lambda: any(d.name == mine and d.level == DiagnosticStatus.WARN
                             and 'lost before the node saw them' in d.message
                             for d in list(diagnostics)), what='WARN diagnostics of the loss')
    # a check for absence: nothing more arrives within 0.5 s, so the counts were final, not
    # a passing sum
    time.sleep(0.5)
    assert h.node.engine.step_index == s.step


def test_an_action_published_before_any_subscriber_matched_goes_out_once_one_does(make):
    """An observation answered while no subscriber of ~/action had matched on the node's side
    (a client still in discovery) is not lost: the action goes out again, once, when one
    matches (status timer), and it is the policy's answer to that observation."""
    import array

    from std_msgs.msg import Float32MultiArray
    h = make()
    h.client.close()                        # no subscriber of ~/action is left
    pub_node = h.client_node
    pub = pub_node.create_publisher(Float32MultiArray, f'/{h.name}/observation', 10)
    action_pub = h.node.parts.robot.sessions[0].action_pub
    wait_for(lambda: pub.get_subscription_count() > 0 and
             action_pub.get_subscription_count() == 0, what='only the observation matched')
    o = obs(1)
    pub.publish(Float32MultiArray(data=array.array('f', o)))
    wait_for(lambda: h.node.engine.step_index == 1, what='the node to step')
    assert h.node.parts.robot.sessions[0].unsent is not None
    got = []
    pub_node.create_subscription(Float32MultiArray, f'/{h.name}/action',
                                 lambda m: got.append(list(m.data)), 10)
    wait_for(lambda: got, what='the action, once a subscriber matched')
    time.sleep(0.5)                         # five status periods: sent once, not again
    assert got == h.reference([o]) and h.node.parts.robot.sessions[0].unsent is None
