"""Recovery in the policy node, in-process: checkpoints, poisoned states, held sessions and
restarts on a full disk. (SIGKILL + restore_on_start, and capsule files that a crash mid-write
can never leave loadable: test/system/test_recovery_sigkill.py.)"""
import math
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytestmark = pytest.mark.ros

from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from support.common import obs_range, wait_for  # noqa: E402
from support.filesystems import fill, tmpfs  # noqa: E402
from support.nodes import Harness, RECURRENT  # noqa: E402

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
    time.sleep(wait)        # a check for absence: no action arrives within `wait` seconds
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
    # a single-session node reports its hold like a fleet: in ~/status and as an ERROR
    wait_for(lambda: h.client.last_status is not None
             and list(h.client.last_status.held_sessions) == ['0'], what='held in ~/status')
    diag = h.node.diagnostic(h.node.status_message())
    assert diag.level == DiagnosticStatus.ERROR and 'held' in diag.message, diag.message
    r = h.call('recover')
    assert r.success and 'checkpoint-00000001' in r.message, r.message
    assert h.steps(observations[5:12]) == ref[5:12]
    wait_for(lambda: list(h.client.last_status.held_sessions) == [], what='hold ended')


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
