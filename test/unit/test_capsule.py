"""CapsuleStore: tiers, budgets, LRU demotion, pinning, names, paths and the disk format; file-
system faults on real mounts (full, read-only), permissions with CAP_DAC_OVERRIDE dropped,
reserved checkpoint names and signed files."""

import errno
import json
import os
import struct
import threading
import time

import pytest
from safetensors.torch import load_file
import torch

from flashrt_ros.runtime.capsule import Capsule, CapsuleStore, Manifest
from flashrt_ros.runtime.capsule_file import load_signing_key, read_file, write_file
from flashrt_ros.runtime.errors import (BudgetExceeded, CapsuleExists, CorruptCapsule,
                                        IncompatibleCapsule, InvalidConfig, InvalidName,
                                        PathOutsideDirectory, ReservedName, StorageError,
                                        UnknownCapsule, UntrustedCapsule)
from support.filesystems import fill, remount_read_only, tmpfs, without_dac

SCHEMA, MODEL = 'a' * 64, 'b' * 64
KEY = bytes(range(32))


def capsule(name, nbytes=100, pinned=False, tier='device', fill=None):
    m = Manifest(name=name, parent='', tier=tier, pinned=pinned, step=3, episode=1, position=0,
                 nbytes=nbytes, schema_digest=SCHEMA, model_digest=MODEL, created=time.time())
    value = fill if fill is not None else sum(map(ord, name)) % 251
    return Capsule(m, torch.full((nbytes,), value, dtype=torch.uint8))


def tiers(store):
    """Budget tiers (a CPU store reports its device tier as 'host': see test_cpu_tier_...)."""
    return store.placement()


@pytest.fixture
def store(tmp_path):
    return CapsuleStore('cpu', device_budget=300, host_budget=300, directory=str(tmp_path))


def test_put_get_list_delete(store):
    store.put(capsule('b'))
    store.put(capsule('a'))
    assert [m.name for m in store.list()] == ['a', 'b']
    assert store.device_bytes_used == 200
    with pytest.raises(CapsuleExists):
        store.put(capsule('a'))
    store.put(capsule('a', fill=7), overwrite=True)
    assert int(store.get('a').data[0]) == 7 and store.device_bytes_used == 200
    store.delete('a')
    with pytest.raises(UnknownCapsule, match="no capsule named 'a'"):
        store.get('a')
    with pytest.raises(UnknownCapsule):
        store.delete('a')


@pytest.mark.parametrize('bad', ['', '.', '..', 'a/b', '../x', 'a b', 'x' * 129, 'é', 'a\\b', 7])
def test_bad_names_refused(store, bad):
    with pytest.raises(InvalidName):
        store.validate_name(bad)
    with pytest.raises(InvalidName):
        store.get(bad)


def test_lru_demotion_order(store):
    for n in 'abc':
        store.put(capsule(n))
    store.get('a')                      # a is now most recent: b is the LRU
    store.put(capsule('d'))
    assert tiers(store) == {'a': 'device', 'b': 'host', 'c': 'device', 'd': 'device'}
    store.put(capsule('e'))
    store.put(capsule('f'))
    assert tiers(store)['c'] == 'host' and tiers(store)['a'] == 'host'
    store.put(capsule('g'))             # host full: its LRU (b) goes to disk
    t = tiers(store)
    assert t['b'] == 'disk' and t['d'] == 'host'
    assert store.device_bytes_used <= 300 and store.host_bytes_used <= 300
    # nothing was dropped, bytes survive every move
    assert sorted(t) == list('abcdefg')
    assert torch.equal(store.data_on('b', 'cpu'), capsule('b').data)
    assert os.path.isfile(store.get('b').path)


def test_pinned_never_demoted_nor_dropped(store):
    store.put(capsule('p1', pinned=True))
    store.put(capsule('p2', pinned=True))
    store.put(capsule('u'))
    store.put(capsule('v'))             # u demoted; pinned stay on device
    assert tiers(store) == {'p1': 'device', 'p2': 'device', 'u': 'host', 'v': 'device'}
    store.put(capsule('hp', pinned=True, tier='host'))
    store.put(capsule('hq', pinned=True, tier='host'))
    store.put(capsule('hr', pinned=True, tier='host'))   # u goes to disk to make room
    assert tiers(store)['u'] == 'disk'
    before = store.list()
    with pytest.raises(BudgetExceeded, match='host tier'):
        store.put(capsule('w'))         # v would have to move to a host full of pinned
    assert store.list() == before               # refused put changed nothing
    with pytest.raises(BudgetExceeded):
        store.put(capsule('p3', pinned=True, tier='disk'))
    for m in store.list():
        if m.pinned:
            assert m.tier in ('device', 'host')


def test_capsule_larger_than_budget_refused(store):
    store.put(capsule('a'))
    with pytest.raises(BudgetExceeded, match='device tier cannot take 400 bytes'):
        store.put(capsule('huge', nbytes=400))
    assert tiers(store) == {'a': 'device'}


def test_save_load_round_trip(store):
    store.put(capsule('a'))
    path, size = store.save('a')
    assert path == os.path.join(store.directory, 'a.capsule') and size > 100
    assert store.get('a').manifest.checksum
    assert not [f for f in os.listdir(store.directory) if f.startswith('.tmp')]
    m = store.load('a.capsule', name='a2', schema_digest=SCHEMA, model_digest=MODEL)
    assert m.name == 'a2' and m.tier == 'host' and m.step == 3    # CPU device tier: host memory
    assert tiers(store)['a2'] == 'device'
    assert torch.equal(store.get('a2').data, store.get('a').data)
    with pytest.raises(CapsuleExists):
        store.load('a.capsule')


def test_paths_outside_directory_refused(store, tmp_path):
    store.put(capsule('a'))
    for bad in ('/tmp/x.safetensors', '../x.safetensors', 'sub/../../x'):
        with pytest.raises(PathOutsideDirectory, match='outside the capsule directory'):
            store.save('a', bad)
    outside = tmp_path.parent / 'elsewhere.safetensors'
    outside.write_bytes(b'x')
    os.symlink(outside, tmp_path / 'link.safetensors')
    with pytest.raises(PathOutsideDirectory):
        store.load('link.safetensors')
    with pytest.raises(PathOutsideDirectory):
        store.load('/etc/hostname')
    with pytest.raises(UnknownCapsule):
        store.load('missing.safetensors')


def test_corrupt_files_refused_store_unchanged(store):
    store.put(capsule('a'))
    path, _ = store.save('a')
    good = open(path, 'rb').read()
    before = store.list()
    flipped = bytearray(good)
    flipped[-7] ^= 0x01
    open(path, 'wb').write(flipped)
    with pytest.raises(CorruptCapsule, match='failed its checksum'):
        store.load('a.capsule', name='x')
    open(path, 'wb').write(good[:-20])
    with pytest.raises(CorruptCapsule, match='truncated or unreadable'):
        store.load('a.capsule', name='x')
    open(path, 'wb').write(good[:6])
    with pytest.raises(CorruptCapsule):
        store.load('a.capsule', name='x')
    assert store.list() == before


def test_other_model_or_schema_refused_with_both_digests(store):
    store.put(capsule('a'))
    store.save('a')
    with pytest.raises(IncompatibleCapsule) as e:
        store.load('a.capsule', name='x', schema_digest=SCHEMA, model_digest='c' * 64)
    assert str(e.value) == ("capsule 'a' was taken with model digest bbbbbbbbbbbb "
                            'but the loaded policy is cccccccccccc')
    with pytest.raises(IncompatibleCapsule, match='schema digest aaaaaaaaaaaa .* dddddddddddd'):
        store.load('a.capsule', name='x', schema_digest='d' * 64, model_digest=MODEL)
    assert [m.name for m in store.list()] == ['a']


def test_corrupt_spill_file_detected(store):
    for n in 'abcdefg':
        store.put(capsule(n))
    disk = [m.name for m in store.list() if m.tier == 'disk']
    assert disk == ['a']
    assert torch.equal(store.data_on('a', 'cpu'), capsule('a').data)
    path = store.get('a').path
    raw = bytearray(open(path, 'rb').read())
    raw[-1] ^= 0xFF
    open(path, 'wb').write(raw)
    with pytest.raises(CorruptCapsule, match='failed its checksum'):
        store.data_on('a', 'cpu')
    store.delete('a')
    assert not os.path.exists(path)


# -- tiers on the CPU ---------------------------------------------------------------------------

def test_cpu_store_reports_device_tier_as_host_and_budgets_stay(tmp_path):
    store = CapsuleStore('cpu', device_budget=300, host_budget=300, directory=str(tmp_path))
    assert store.reported_tier('device') == 'host'
    store.put(capsule('a'))
    store.put(capsule('b', tier='host'))
    assert {m.name: m.tier for m in store.list()} == {'a': 'host', 'b': 'host'}
    assert store.placement() == {'a': 'device', 'b': 'host'}
    # budgets still count per budget tier: a is charged to device_budget
    assert (store.device_bytes_used, store.host_bytes_used) == (100, 100)
    # the device tier of a CPU store already is host memory: demotion moves no bytes
    data = store.get('a').data
    for n in 'cde':
        store.put(capsule(n))
    assert store.placement()['a'] == 'host' and store.get('a').data is data
    if torch.cuda.is_available():
        gpu = CapsuleStore('cuda', 1 << 20, 1 << 20, str(tmp_path / 'gpu'))
        assert gpu.reported_tier('device') == 'device'


# -- reserved checkpoint names -----------------------------------------------------------------

def test_checkpoint_names_are_reserved(store):
    with pytest.raises(ReservedName, match="'checkpoint-00000001' is reserved"):
        store.put(capsule('checkpoint-00000001'))
    with pytest.raises(ReservedName):
        store.validate_name('checkpoint-mine')
    with store.allow_reserved():
        store.put(capsule('checkpoint-00000001'))
        # another thread (a service on another executor thread) does not share the grant
        seen = []
        t = threading.Thread(target=lambda: seen.append(pytest.raises(
            ReservedName, store.validate_name, 'checkpoint-2')))
        t.start()
        t.join()
    assert seen
    assert 'checkpoint-00000001' in store
    store.get('checkpoint-00000001')            # reading, saving and deleting one is fine
    path, _ = store.save('checkpoint-00000001')
    # loading a checkpoint file under its own name is refused; under a user name it is fine
    with pytest.raises(ReservedName):
        store.load(path, overwrite=True)
    assert store.load(path, name='mine').name == 'mine'
    # a user capsule may not be written where resume would take it for a checkpoint
    with pytest.raises(ReservedName, match='file name .* is reserved'):
        store.save('mine', 'checkpoint-99999999.capsule')
    assert not os.path.exists(os.path.join(store.directory, 'checkpoint-99999999.capsule'))
    store.save('mine', 'sub/checkpoint-1.capsule')     # not in the directory resume scans
    store.delete('checkpoint-00000001')


# -- file-system faults --------------------------------------------------------------------------

def test_disk_full_is_a_storage_error_and_leaves_no_temp_file(tmp_path):
    directory = tmp_path / 'capsules'
    with tmpfs(directory):
        store = CapsuleStore('cpu', 1 << 20, 1 << 20, str(directory))
        store.put(capsule('a', nbytes=16 << 10))
        fill(directory)
        before = sorted(os.listdir(directory))
        with pytest.raises(StorageError, match='no space left') as e:
            store.save('a')
        assert e.value.errno == errno.ENOSPC and str(directory) in str(e.value)
        assert 'free space' in str(e.value)
        assert sorted(os.listdir(directory)) == before      # no .tmp-* left behind
        assert 'a' in store and store.get('a').manifest.checksum == ''
        os.unlink(directory / 'filler')
        path, _ = store.save('a')                           # works again once space is back
        assert read_file(path)[0].name == 'a'


def test_read_only_file_system_is_a_storage_error(tmp_path):
    directory = tmp_path / 'capsules'
    with tmpfs(directory, size='1m'):
        store = CapsuleStore('cpu', 1 << 20, 1 << 20, str(directory))
        store.put(capsule('a'))
        store.save('a')
        remount_read_only(directory)
        with pytest.raises(StorageError, match='read-only') as e:
            store.save('a', 'b.capsule')
        assert e.value.errno == errno.EROFS and 'remount it read-write' in str(e.value)
        assert store.load('a.capsule', name='a2').name == 'a2'    # reading still works


def test_directory_and_long_names_are_storage_errors(store):
    store.put(capsule('a'))
    os.mkdir(os.path.join(store.directory, 'x.capsule'))
    with pytest.raises(StorageError, match='is a directory'):
        store.load('x.capsule')
    with pytest.raises(StorageError, match='is a directory'):
        store.save('a', 'x.capsule')
    long = 'x' * 300 + '.capsule'
    with pytest.raises(StorageError, match='too long') as e:
        store.save('a', long)
    assert e.value.errno == errno.ENAMETOOLONG
    with pytest.raises(StorageError, match='too long'):
        store.load(long)
    open(os.path.join(store.directory, 'empty.capsule'), 'wb').close()
    with pytest.raises(CorruptCapsule, match='empty'):
        store.load('empty.capsule')
    assert [m.name for m in store.list()] == ['a']
    assert not [f for f in os.listdir(store.directory) if f.startswith('.tmp')]


READ = '''
from flashrt_ros.runtime.capsule import CapsuleStore
from flashrt_ros.runtime.errors import FlashRTError
store = CapsuleStore('cpu', 1 << 20, 1 << 20, sys.argv[1])
try:
    print(type(store.load(sys.argv[2], name='b')).__name__)
except FlashRTError as e:
    print(type(e).__name__, e)
'''

WRITE = '''
import torch, time
from flashrt_ros.runtime.capsule import Capsule, CapsuleStore, Manifest
from flashrt_ros.runtime.errors import FlashRTError
store = CapsuleStore('cpu', 1 << 20, 1 << 20, sys.argv[1])
store.put(Capsule(Manifest('a', '', 'device', False, 0, 0, 0, 4, 's', 'm', time.time()),
                  torch.zeros(4, dtype=torch.uint8)))
try:
    store.save('a')
    print('saved')
except FlashRTError as e:
    print(type(e).__name__, e)
'''


def test_permission_denied_is_a_storage_error_not_missing(store):
    store.put(capsule('a'))
    path, _ = store.save('a')
    os.chmod(path, 0)
    out = without_dac(READ, store.directory, 'a.capsule')
    assert out.startswith('StorageError') and 'permission denied' in out, out
    assert 'missing' not in out and path in out and 'chmod' in out
    locked = os.path.join(store.directory, 'locked')
    os.mkdir(locked, 0o555)
    out = without_dac(WRITE, locked)
    assert out.startswith('StorageError') and 'permission denied' in out, out


# -- the writer and signed files -----------------------------------------------------------------

def test_written_file_is_plain_safetensors(tmp_path):
    m = capsule('a', nbytes=13).manifest
    data = torch.arange(13, dtype=torch.uint8)
    path = str(tmp_path / 'a.capsule')
    digest = write_file(path, m, data, KEY)
    assert torch.equal(load_file(path)['state'], data)       # safetensors' own reader
    raw = open(path, 'rb').read()
    (n,) = struct.unpack('<Q', raw[:8])
    meta = json.loads(raw[8:8 + n])['__metadata__']
    assert n % 8 == 0 and meta['checksum'] == digest and len(meta['hmac_sha256']) == 64
    manifest, back = read_file(path, KEY)
    assert manifest.checksum == digest and torch.equal(back, data)


def test_signed_files(tmp_path):
    signed = CapsuleStore('cpu', 1 << 20, 1 << 20, str(tmp_path), signing_key=KEY)
    plain = CapsuleStore('cpu', 1 << 20, 1 << 20, str(tmp_path))
    other = CapsuleStore('cpu', 1 << 20, 1 << 20, str(tmp_path), signing_key=KEY[::-1])
    assert signed.signs_files and not plain.signs_files
    signed.put(capsule('a'))
    signed.save('a')
    plain.put(capsule('u'))
    plain.save('u')
    assert signed.load('a.capsule', name='a2').name == 'a2'
    assert plain.load('a.capsule').name == 'a'             # no key: the checksum still checks
    with pytest.raises(UntrustedCapsule, match='not signed'):
        signed.load('u.capsule')
    with pytest.raises(UntrustedCapsule, match='another key'):
        other.load('a.capsule')
    # Someone who can write the directory but lacks the key rewrites a file with a state of
    # their choosing and a valid checksum: refused.
    forged = capsule('a', fill=99)
    write_file(os.path.join(str(tmp_path), 'a.capsule'), forged.manifest, forged.data)
    with pytest.raises(UntrustedCapsule, match='not signed'):
        signed.load('a.capsule', name='a3')
    write_file(str(tmp_path / 'b.capsule'), forged.manifest, forged.data, key=b'guess' * 4)
    with pytest.raises(UntrustedCapsule, match='another key'):
        signed.load('b.capsule', name='a3')
    assert sorted(m.name for m in signed.list()) == ['a', 'a2']     # refusals changed nothing
    # spill files are signed and checked too
    small = CapsuleStore('cpu', 100, 100, str(tmp_path / 'small'), signing_key=KEY)
    for n in 'abc':
        small.put(capsule(n))
    assert small.placement()['a'] == 'disk'
    assert torch.equal(small.data_on('a', 'cpu'), capsule('a').data)


def test_signing_key_file(tmp_path):
    key = tmp_path / 'key'
    key.write_bytes(KEY)
    assert load_signing_key(str(key)) == KEY
    key.write_bytes(b'short')
    with pytest.raises(InvalidConfig, match='at least 16'):
        load_signing_key(str(key))
    with pytest.raises(StorageError, match='no such file'):
        load_signing_key(str(tmp_path / 'absent'))
    with pytest.raises(InvalidConfig):
        CapsuleStore('cpu', 1, 1, str(tmp_path), signing_key=b'short')
