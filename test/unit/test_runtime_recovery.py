"""runtime.recovery.Recovery without ROS, against a real PolicyEngine on the CPU and real files:
checkpoint sequence and retention, the poison verdict, recover() by sequence number, resume
from a directory with stray files, and checkpoint writes on a full or read-only file system."""
import logging
import math
import os
import shutil

import pytest
import torch

from flashrt_ros.runtime.capsule_file import load_signing_key, write_file
from flashrt_ros.runtime.engine import EPISODE_START, PolicyEngine
from flashrt_ros.runtime.errors import (FlashRTError, InvalidConfig, ReservedName,
                                        StorageError)
from flashrt_ros.runtime.policies import make_policy
from flashrt_ros.runtime.recovery import checkpoint_name, checkpoint_sequence, Recovery
from support.filesystems import fill, remount_read_only, tmpfs, without_dac

OBS = 8


def engine(directory, **kw):
    policy = make_policy('recurrent', OBS, 4, seed=0, rnn_hidden_dim=16)
    return PolicyEngine(policy, device='cpu', capsule_dir=str(directory), **kw)


def observations(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, OBS, generator=g)


def reference(obs, tmp_path):
    e = engine(tmp_path / 'reference')
    return [e.step(o) for o in obs]


def run(e, recovery, obs):
    """Steps with a checkpoint whenever one is due, as the node does."""
    actions = []
    for o in obs:
        actions.append(e.step(o))
        if recovery.due():
            recovery.checkpoint()
    return actions


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def names(e):
    return [m.name for m in e.store.list()]


def files(directory):
    return sorted(f for f in os.listdir(directory) if f.startswith('checkpoint-'))


def poison(e):
    with e._lock:       # between two steps
        e.arena['hidden_state'].fill_(math.nan)


def test_sequence_names():
    assert checkpoint_name(42) == 'checkpoint-00000042'
    assert checkpoint_sequence('checkpoint-100000000') == 100000000
    assert checkpoint_sequence('checkpoint-00000007.capsule') == 7
    for other in ('checkpoint-abc', 'checkpoint-', 'checkpoint-1x', 'snap-1', 'checkpoint-1.bak'):
        assert checkpoint_sequence(other) is None
    with pytest.raises(InvalidConfig):
        Recovery(None, every=-1)
    with pytest.raises(InvalidConfig):
        Recovery(None, keep=0)


def test_checkpoints_sequence_retention_and_tier(tmp_path):
    e = engine(tmp_path / 'c')
    r = Recovery(e, every=2, keep=2, to_disk=True)
    obs = observations(10)
    assert same(run(e, r, obs), reference(obs, tmp_path))     # checkpoints do not disturb
    assert (r.taken, r.failed_checkpoints, r.sequence) == (5, 0, 5)
    assert names(e) == ['checkpoint-00000004', 'checkpoint-00000005']
    assert files(e.store.directory) == ['checkpoint-00000004.capsule',
                                        'checkpoint-00000005.capsule']
    assert {m.tier for m in e.store.list()} == {'host'}
    assert e.store.placement()['checkpoint-00000005'] == 'host'
    r.configure(2, 1, True)          # live change of checkpoint_keep
    r.checkpoint()
    assert names(e) == ['checkpoint-00000006']
    assert files(e.store.directory) == ['checkpoint-00000006.capsule']


def test_recover_picks_the_highest_sequence_not_the_name_sort(tmp_path):
    e = engine(tmp_path / 'c')
    r = Recovery(e, every=5, keep=2)
    r.sequence = 99999998            # the next two: 99999999, then 100000000 (9 digits)
    obs = observations(20)
    ref = reference(obs, tmp_path)
    assert same(run(e, r, obs[:12]), ref[:12])
    assert sorted(names(e)) == ['checkpoint-100000000', 'checkpoint-99999999']
    # by name, 'checkpoint-99999999' sorts last; by sequence, 100000000 (step 10) is newest
    r.checkpoint()                    # 100000001 at step 12: pruning keeps the two newest
    assert sorted(names(e)) == ['checkpoint-100000000', 'checkpoint-100000001']
    poison(e)
    assert r.verdict(e.step(obs[12])) == ['action', 'hidden_state', 'cell_state']
    result = r.recover()
    assert "'checkpoint-100000001'" in result.message and e.step_index == 12
    assert same([e.step(o) for o in obs[12:20]], ref[12:20])


def test_user_capsules_cannot_take_checkpoint_names(tmp_path):
    e = engine(tmp_path / 'c')
    r = Recovery(e, every=1, keep=2, to_disk=True)
    e.step(observations(1)[0])
    e.snapshot('mine')
    path = e.save('mine').path
    for refused in (lambda: e.snapshot('checkpoint-zzz'),
                    lambda: e.snapshot('checkpoint-00000001', overwrite=True),
                    lambda: e.fork('', 'checkpoint-00000002'),
                    lambda: e.fork('mine', 'checkpoint-00000003'),
                    lambda: e.load(path, name='checkpoint-00000004'),
                    lambda: e.save('mine', 'checkpoint-00000005.capsule')):
        with pytest.raises(ReservedName, match='reserved'):
            refused()
    assert names(e) == ['mine']
    for o in observations(4):
        e.step(o)
        r.checkpoint()
    # the user's capsule and file survive pruning; recover only ever picks a checkpoint
    assert names(e) == ['checkpoint-00000003', 'checkpoint-00000004', 'mine']
    assert os.path.exists(path)
    assert "'checkpoint-00000004'" in r.recover().message


def test_verdict_scrub_and_recover_fallbacks(tmp_path):
    e = engine(tmp_path / 'c')
    r = Recovery(e, every=1, keep=3)
    e.snapshot(EPISODE_START, pin=True)
    obs = observations(10)
    run(e, r, obs[:3])
    assert r.verdict(e.step(obs[3])) == [] and not r.scrub
    # a NaN in the newest checkpoint's bytes: skipped, named in the message
    with e._lock:
        c = e.store.get('checkpoint-00000003')
        e.arena.unpack(c.data, c.manifest.position)['hidden_state'].fill_(math.nan)
    poison(e)
    assert 'hidden_state' in r.verdict(e.step(obs[4])) and r.scrub
    calls = []
    clear = e.clear_beyond_position
    e.clear_beyond_position = lambda **session: calls.append(1) or clear(**session)
    result = r.recover()
    assert "'checkpoint-00000002'" in result.message and 'skipped: checkpoint-00000003' in \
        result.message
    assert calls == [1] and not r.scrub            # the scrub ran once, with the restore
    with pytest.raises(FlashRTError, match='NaN/Inf'):
        poison(e)
        r.checkpoint()                             # never checkpoints a poisoned state
    assert r.failed_checkpoints == 1 and 'NaN/Inf' in r.last_failure
    for name in ('checkpoint-00000001', 'checkpoint-00000002', 'checkpoint-00000003'):
        e.delete(name)
    assert 'episode_start' in r.recover().message and e.step_index == 0
    e.delete(EPISODE_START)
    with pytest.raises(FlashRTError, match='no valid checkpoint'):
        r.recover()


def _spoil(path):
    raw = bytearray(open(path, 'rb').read())
    raw[-1] ^= 0xFF
    open(path, 'wb').write(bytes(raw))


def test_resume_latest_skips_strays_and_continues_the_sequence(tmp_path, caplog):
    directory = tmp_path / 'c'
    obs = observations(30)
    ref = reference(obs, tmp_path)
    first = engine(directory)
    r1 = Recovery(first, every=5, keep=3, to_disk=True)
    run(first, r1, obs[:17])                      # checkpoints 1, 2, 3 at steps 5, 10, 15
    first.snapshot(EPISODE_START)
    first.save(EPISODE_START)
    good = directory / 'checkpoint-00000003.capsule'
    # strays: not a number, directories, an empty file, a damaged newest, another model
    (directory / 'checkpoint-abc.capsule').write_bytes(b'x')
    (directory / 'checkpoint-00000090.capsule').mkdir()
    (directory / 'x.capsule').mkdir()
    (directory / 'checkpoint-00000091.capsule').write_bytes(b'')
    shutil.copy(good, directory / 'checkpoint-00000093.capsule')
    _spoil(directory / 'checkpoint-00000093.capsule')
    other = PolicyEngine(make_policy('recurrent', OBS, 4, seed=1, rnn_hidden_dim=16),
                         capsule_dir=str(tmp_path / 'other'))
    other.snapshot('x')
    write_file(str(directory / 'checkpoint-00000092.capsule'),
               other.store.get('x').manifest, other.store.get('x').data)

    second = engine(directory)
    r2 = Recovery(second, every=5, keep=3, to_disk=True)
    with caplog.at_level(logging.INFO, logger='flashrt_ros.runtime.recovery'):
        assert r2.resume('latest') == 'checkpoint-00000003.capsule'
    log = caplog.text
    assert 'checkpoint-abc.capsule: not a checkpoint file name' in log
    assert 'checkpoint-00000090.capsule: is a directory' in log
    assert 'checkpoint-00000091.capsule: is empty' in log
    assert 'checkpoint-00000093.capsule' in log and 'failed its checksum' in log
    assert 'checkpoint-00000092.capsule' in log and 'model digest' in log
    assert 'x.capsule' not in log.replace('checkpoint-abc.capsule', '')   # not our namespace
    assert second.step_index == 15 and r2.sequence == 93
    assert EPISODE_START in second.store                          # came back from its file
    assert same([second.step(o) for o in obs[15:20]], ref[15:20])
    r2.checkpoint()                                               # continues after 93
    assert 'checkpoint-00000094' in names(second)
    assert (directory / 'checkpoint-00000094.capsule').exists()
    # '' only continues the sequence; a named file that cannot be restored raises
    third = engine(directory)
    r3 = Recovery(third)
    assert r3.resume('') == '' and r3.sequence == 94 and third.step_index == 0
    with pytest.raises(FlashRTError):
        r3.resume('checkpoint-00000093.capsule')
    with pytest.raises(FlashRTError):
        r3.resume('absent.capsule')
    assert r3.resume('checkpoint-00000003.capsule') == 'checkpoint-00000003.capsule'
    # a resumed process prunes the files of the one before it too (keep 3)
    r2.checkpoint()
    r2.checkpoint()
    assert [f for f in files(directory) if checkpoint_sequence(f) and
            os.path.isfile(directory / f) and os.path.getsize(directory / f)] == [
        'checkpoint-00000094.capsule', 'checkpoint-00000095.capsule',
        'checkpoint-00000096.capsule']
    assert (directory / 'checkpoint-00000090.capsule').is_dir()    # strays are left alone


def test_resume_from_a_directory_of_nothing(tmp_path):
    e = engine(tmp_path / 'never-created')
    r = Recovery(e)
    assert r.resume('latest') == '' and r.sequence == 0


def test_failed_writes_are_counted_and_memory_stays_bounded(tmp_path):
    directory = tmp_path / 'c'
    obs = observations(40)
    ref = reference(obs, tmp_path)
    with tmpfs(directory, size='64k'):
        e = engine(directory)
        r = Recovery(e, every=2, keep=2, to_disk=True)
        assert same(run(e, r, obs[:4]), ref[:4])               # two good checkpoints
        fill(directory)
        actions, errors = [], []
        for o in obs[4:24]:                                    # ten checkpoints, all failing
            actions.append(e.step(o))
            if r.due():
                try:
                    r.checkpoint()
                except StorageError as exc:
                    errors.append(str(exc))
        assert same(actions, ref[4:24])                        # control went on
        assert r.failed_checkpoints == 10 and len(errors) == 10
        assert 'kept in memory but not written' in errors[0] and 'no space left' in errors[0]
        assert r.last_failure == errors[-1]
        # memory holds the newest `keep`, disk keeps the last two files that were written
        assert names(e) == ['checkpoint-00000011', 'checkpoint-00000012']
        assert files(directory) == ['checkpoint-00000001.capsule', 'checkpoint-00000002.capsule']
        assert not [f for f in os.listdir(directory) if f.startswith('.tmp')]
        assert "'checkpoint-00000012'" in r.recover().message and e.step_index == 24
        assert same([e.step(o) for o in obs[24:26]], ref[24:26])
        # a restart on the full disk resumes, and says why its checkpoints fail
        e2 = engine(directory)
        r2 = Recovery(e2, every=2, keep=2, to_disk=True)
        assert r2.resume('latest') == 'checkpoint-00000002.capsule' and e2.step_index == 4
        e2.step(obs[4])
        with pytest.raises(StorageError, match='no space left'):
            r2.checkpoint()
        assert r2.failed_checkpoints == 1
        os.unlink(directory / 'filler')
        r.checkpoint()                                         # space is back: 13 written
        assert files(directory) == ['checkpoint-00000002.capsule',
                                    'checkpoint-00000013.capsule']
        r.checkpoint()
        assert files(directory) == ['checkpoint-00000013.capsule',
                                    'checkpoint-00000014.capsule']


def test_read_only_capsule_directory(tmp_path, caplog):
    directory = tmp_path / 'c'
    with tmpfs(directory, size='1m'):
        e = engine(directory)
        r = Recovery(e, every=1, keep=1, to_disk=True)
        e.step(observations(1)[0])
        r.checkpoint()
        remount_read_only(directory)
        with caplog.at_level(logging.WARNING, logger='flashrt_ros.runtime.recovery'):
            for o in observations(3):
                e.step(o)
                with pytest.raises(StorageError, match='read-only'):
                    r.checkpoint()
        assert r.failed_checkpoints == 3 and names(e) == ['checkpoint-00000004']
        assert files(directory) == ['checkpoint-00000001.capsule']   # the last good file stays
        e2 = engine(directory)                                 # a restart reads it back
        assert Recovery(e2).resume('latest') == 'checkpoint-00000001.capsule'


RESUME_UNREADABLE = '''
import logging
logging.basicConfig(level=logging.WARNING, format='%(message)s', stream=sys.stdout)
from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.policies import make_policy
from flashrt_ros.runtime.recovery import Recovery
e = PolicyEngine(make_policy('recurrent', 8, 4, seed=0, rnn_hidden_dim=16),
                 capsule_dir=sys.argv[1])
print('resumed', Recovery(e).resume('latest'))
'''


def test_resume_skips_an_unreadable_checkpoint_with_the_reason(tmp_path):
    directory = tmp_path / 'c'
    e = engine(directory)
    r = Recovery(e, every=1, keep=3, to_disk=True)
    for o in observations(2):
        e.step(o)
        r.checkpoint()
    os.chmod(directory / 'checkpoint-00000002.capsule', 0)
    out = without_dac(RESUME_UNREADABLE, str(directory))
    assert 'skipping checkpoint-00000002.capsule' in out and 'permission denied' in out, out
    assert 'resumed checkpoint-00000001.capsule' in out, out


def test_signed_checkpoints(tmp_path):
    key_file = tmp_path / 'key'
    key_file.write_bytes(os.urandom(32))
    key = load_signing_key(str(key_file))
    directory = tmp_path / 'c'
    obs = observations(10)
    ref = reference(obs, tmp_path)
    e = engine(directory, signing_key=key)
    r = Recovery(e, every=2, keep=3, to_disk=True)
    run(e, r, obs[:6])                                         # signed 1, 2, 3
    # someone with write access but no key drops in a newer, unsigned checkpoint
    forged = engine(tmp_path / 'forger')
    for o in obs[:1]:
        forged.step(o)
    forged.snapshot('x')
    write_file(str(directory / 'checkpoint-00000009.capsule'),
               forged.store.get('x').manifest, forged.store.get('x').data)
    e2 = engine(directory, signing_key=key)
    assert Recovery(e2).resume('latest') == 'checkpoint-00000003.capsule'
    assert same([e2.step(o) for o in obs[6:10]], ref[6:10])
    e3 = engine(directory)                     # without a key, signed files still load
    assert Recovery(e3).resume('checkpoint-00000002.capsule') == 'checkpoint-00000002.capsule'
