"""Recovery in the policy node: checkpoints, poisoned states, SIGKILL + restore_on_start, and
capsule files that a crash mid-write can never leave loadable."""
import math
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytestmark = pytest.mark.ros

from test_policy_node import (Harness, obs_range, RECURRENT, reference_actions,  # noqa: E402
                              wait_for)

from test_capsule import fill, tmpfs  # noqa: E402

from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from flashrt_ros.client import PolicyClient, spin_in_thread  # noqa: E402
from flashrt_ros.runtime.capsule_file import read_file  # noqa: E402

CHECKPOINTS = dict(RECURRENT, checkpoint_every=5, checkpoint_keep=2)


@pytest.fixture
def harness(tmp_path):
    rclpy.init()
    made = []

    def factory(params):
        h = Harness(tmp_path, params)
        made.append(h)
        return h
    yield factory
    for h in made:
        h.close()
    rclpy.shutdown()


def poison(h):
    """NaN into the recurrent state, between two steps (the engine's lock)."""
    with h.node.engine._lock:
        h.node.engine.arena['hidden_state'].fill_(math.nan)


def no_action_for(h, observation, wait=0.5):
    seen = h.client.actions_received()
    h.client.publish_only(observation)
    time.sleep(wait)
    return h.client.actions_received() == seen


def test_poisoned_state_is_not_published_and_recovers_to_last_checkpoint(harness):
    h = harness(CHECKPOINTS)
    observations = obs_range(0, 30)
    ref = h.reference(observations)
    assert h.steps(observations[:12]) == ref[:12]       # checkpoints after steps 5 and 10
    assert [n for n in h.names() if n.startswith('checkpoint-')] == [
        'checkpoint-00000001', 'checkpoint-00000002']
    tiers = {c.name: c.tier for c in h.call('list_capsules').capsules}
    assert tiers['checkpoint-00000002'] == 'host'

    poison(h)
    assert no_action_for(h, observations[12]), 'an action computed from NaN was published'
    # Recovered to the checkpoint after step 10: the uninterrupted run continues from there.
    wait_for(lambda: h.node.engine.step_index == 10, what='recovery to step 10')
    assert h.steps(observations[10:20]) == ref[10:20]
    wait_for(lambda: h.client.last_status is not None
             and h.client.last_status.rejected_observations >= 1, what='poison counted')


def test_hold_policy_refuses_until_recover_service(harness):
    h = harness(dict(CHECKPOINTS, on_poison='hold'))
    observations = obs_range(0, 20)
    ref = h.reference(observations)
    assert h.steps(observations[:7]) == ref[:7]          # checkpoint after step 5
    poison(h)
    assert no_action_for(h, observations[7])
    assert no_action_for(h, observations[7], wait=0.2), 'held node still publishes'
    # a rollback is not one of the ways out of a hold (recover, restore, reset_episode)
    assert h.call('rollback', steps=1).success
    assert h.node.parts.guards[0].held, 'a rollback ended the hold'
    assert no_action_for(h, observations[7], wait=0.2)
    r = h.call('recover')
    assert r.success and 'checkpoint-00000001' in r.message, r.message
    assert h.steps(observations[5:12]) == ref[5:12]


def test_recover_skips_a_poisoned_checkpoint(harness):
    h = harness(CHECKPOINTS)
    observations = obs_range(0, 20)
    ref = h.reference(observations)
    assert h.steps(observations[:11]) == ref[:11]        # checkpoints 1 (step 5), 2 (step 10)
    engine = h.node.engine
    with engine._lock:   # spoil the newest checkpoint's bytes (a NaN in its recurrent state)
        capsule = engine.store.get('checkpoint-00000002')
        views = engine.arena.unpack(capsule.data, capsule.manifest.position)
        views['hidden_state'].fill_(math.nan)
    r = h.call('recover')
    assert r.success and 'checkpoint-00000001' in r.message, r.message
    assert h.steps(observations[5:10]) == ref[5:10]


def test_user_capsules_cannot_take_checkpoint_names(harness):
    h = harness(CHECKPOINTS)
    observations = obs_range(0, 12)
    h.steps(observations[:11])                          # checkpoints 1 and 2
    assert h.call('snapshot', name='mine').success
    assert h.call('save_capsule', name='mine').success
    for service, fields in (('snapshot', dict(name='checkpoint-00000099')),
                            ('snapshot', dict(name='checkpoint-00000002', overwrite=True)),
                            ('fork', dict(source='mine', target='checkpoint-x')),
                            ('load_capsule', dict(path='mine.capsule',
                                                  name='checkpoint-00000003')),
                            ('save_capsule', dict(name='mine',
                                                  path='checkpoint-00000009.capsule'))):
        r = h.call(service, **fields)
        assert not r.success and 'reserved' in r.message, (service, r.message)
    assert sorted(n for n in h.names() if n.startswith('checkpoint-')) == [
        'checkpoint-00000001', 'checkpoint-00000002']
    r = h.call('recover')
    assert r.success and 'checkpoint-00000002' in r.message, r.message


def test_stray_files_do_not_break_configure(harness, tmp_path, capfd):
    capsules = tmp_path / 'capsules'
    capsules.mkdir()
    (capsules / 'checkpoint-abc.capsule').write_bytes(b'x')
    (capsules / 'checkpoint-00000007.capsule').mkdir()
    (capsules / 'x.capsule').mkdir()
    (capsules / 'checkpoint-00000008.capsule').write_bytes(b'')
    h = harness(dict(CHECKPOINTS, restore_on_start='latest', checkpoint_to_disk=True))
    observations = obs_range(0, 6)
    assert h.steps(observations) == h.reference(observations)
    err = capfd.readouterr().err
    assert 'skipping checkpoint-abc.capsule: not a checkpoint file name' in err, err
    assert 'skipping checkpoint-00000007.capsule: is a directory' in err, err
    # the sequence continues after the highest number in the directory
    assert (capsules / 'checkpoint-00000009.capsule').is_file()


def test_full_disk_restart_logs_the_cause_and_keeps_controlling(harness, tmp_path, capfd):
    capsules = tmp_path / 'capsules'
    params = dict(CHECKPOINTS, checkpoint_to_disk=True)
    observations = obs_range(0, 40)
    with tmpfs(capsules, size='256k'):
        first = harness(params)
        ref = first.reference(observations)
        assert first.steps(observations[:11]) == ref[:11]     # files 1 and 2, episode_start
        first.close()
        fill(capsules)
        capfd.readouterr()
        # restart on the full disk: configure and activate succeed, the cause is logged
        h = harness(dict(params, restore_on_start='latest'))
        assert h.node.engine.step_index == 10
        assert h.steps(observations[10:40]) == ref[10:40]      # six failing checkpoints
        # the checkpoint runs after the action is published
        recovery = h.node.parts.guards[0].recovery
        wait_for(lambda: recovery.failed_checkpoints == 6, what='six failed checkpoints')
        assert 'no space left' in recovery.last_failure
        diag = h.node.diagnostic(h.node.status_message())     # what /diagnostics carries
        assert diag.level == DiagnosticStatus.WARN, diag
        assert '6 checkpoint writes failed' in diag.message and 'no space left' in diag.message
        assert {kv.key: kv.value for kv in diag.values}['failed_checkpoints'] == '6'
        assert sorted(n for n in h.names() if n.startswith('checkpoint-')) == [
            'checkpoint-00000007', 'checkpoint-00000008']      # memory bounded by keep
        assert sorted(p.name for p in capsules.glob('checkpoint-*')) == [
            'checkpoint-00000001.capsule', 'checkpoint-00000002.capsule']
        err = capfd.readouterr().err
        assert 'resumed from checkpoint-00000002.capsule' in err, err
        assert 'no space left on its file system' in err and str(capsules) in err, err


def _node_process(params, domain):
    prefix = next(p for p in os.environ['AMENT_PREFIX_PATH'].split(os.pathsep)
                  if (pathlib.Path(p) / 'lib' / 'flashrt_ros' / 'policy_node').exists())
    args = [str(pathlib.Path(prefix) / 'lib' / 'flashrt_ros' / 'policy_node'), '--ros-args']
    for key, value in params.items():
        args += ['-p', f'{key}:={value}']
    env = dict(os.environ, ROS_DOMAIN_ID=domain)
    log = open(os.environ.get('FLASHRT_TEST_NODE_LOG', os.devnull), 'a')
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)


def _endpoints(node):
    """GIDs of the policy's observation subscriptions and action publishers in the graph."""
    subs = node.get_subscriptions_info_by_topic('/flashrt_policy/observation')
    pubs = node.get_publishers_info_by_topic('/flashrt_policy/action')
    return {bytes(e.endpoint_gid) for e in subs}, {bytes(e.endpoint_gid) for e in pubs}


def _wait_for_new_process(node, client, old):
    """A SIGKILLed participant stays in the DDS graph until its lease runs out, so
    wait_ready alone could be satisfied by the dead process: wait for new endpoints too."""
    def fresh():
        subs, pubs = _endpoints(node)
        return subs - old[0] and pubs - old[1]
    wait_for(fresh, timeout=60.0, what='the restarted node in the ROS graph')
    client.wait_ready(timeout=60.0)
    return tuple(a | b for a, b in zip(old, _endpoints(node)))


def test_sigkill_then_restore_on_start_resumes_the_same_actions(tmp_path):
    capsules = tmp_path / 'capsules'
    params = dict(RECURRENT, device='cpu', capsule_dir=str(capsules), checkpoint_every=10,
                  checkpoint_to_disk=True, status_period=0.2)
    observations = obs_range(0, 40)
    _, ref = reference_actions(params, observations, tmp_path / 'reference')
    rclpy.init()
    client_node = rclpy.create_node('recovery_client')
    client = PolicyClient(client_node, timeout=30.0)
    executor = spin_in_thread(client_node)
    domain = os.environ['ROS_DOMAIN_ID']
    procs = []
    try:
        seen = (set(), set())
        procs.append(_node_process(params, domain))
        seen = _wait_for_new_process(client_node, client, seen)
        assert [client.step(o) for o in observations[:25]] == ref[:25]
        files = sorted(p.name for p in capsules.glob('*.capsule'))
        assert files == ['checkpoint-00000001.capsule', 'checkpoint-00000002.capsule',
                         'episode_start.capsule'], files
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=10)

        # Restarted process: resumes after step 20, the newest checkpoint.
        procs.append(_node_process(dict(params, restore_on_start='latest'), domain))
        seen = _wait_for_new_process(client_node, client, seen)
        assert [client.step(o) for o in observations[20:30]] == ref[20:30]
        r, _ = client.call('reset_episode')       # episode_start came back from its file
        assert r.success and "'episode_start'" in r.message, r.message
        assert client.step(observations[0]) == ref[0]
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=10)

        # A newest checkpoint that fails its checksum is skipped for the one before it. The
        # second process took checkpoint 3 (after step 30); spoil it.
        newest = sorted(capsules.glob('checkpoint-*.capsule'))[-1]
        raw = bytearray(newest.read_bytes())
        raw[-1] ^= 0xFF
        newest.write_bytes(bytes(raw))
        procs.append(_node_process(dict(params, restore_on_start='latest'), domain))
        _wait_for_new_process(client_node, client, seen)
        assert [client.step(o) for o in observations[20:25]] == ref[20:25]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        executor.shutdown()
        client_node.destroy_node()
        rclpy.shutdown()


WRITER = '''
import sys, time, torch
from flashrt_ros.runtime.capsule import Manifest
from flashrt_ros.runtime.capsule_file import write_file
data = torch.arange(8 << 20, dtype=torch.int64).to(torch.uint8)   # 8 MB
i = 0
while True:
    i += 1
    m = Manifest(name='c', parent='', tier='device', pinned=False, step=i, episode=0,
                 position=0, nbytes=data.numel(), schema_digest='s' * 64, model_digest='m' * 64,
                 created=time.time())
    write_file(sys.argv[1] + '/c%d.capsule' % (i % 3), m, data)
    print(i, flush=True)
'''


def test_crash_during_write_never_leaves_a_loadable_partial_file(tmp_path):
    rng = random.Random(7)
    kills = 0
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, '-c', WRITER, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)
        for _ in range(rng.randint(1, 4)):       # let it write a few files first
            assert proc.stdout.readline(), 'writer died'
        time.sleep(rng.uniform(0.0, 0.05))       # then kill it somewhere inside a write
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        kills += 1
        for path in tmp_path.glob('*.capsule'):
            manifest, data = read_file(str(path))   # every visible file is complete
            assert data.numel() == 8 << 20 and manifest.step >= 1
        for path in tmp_path.glob('.tmp-*'):    # leftovers keep a temp name, never *.capsule
            path.unlink()
    assert kills == 6
