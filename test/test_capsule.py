"""CapsuleStore: tiers, budgets, LRU demotion, pinning, names, paths and the disk format."""

import os
import time

import pytest
import torch

from flashrt_ros.runtime.capsule import Capsule, CapsuleStore, Manifest
from flashrt_ros.runtime.errors import (BudgetExceeded, CapsuleExists, CorruptCapsule,
                                        IncompatibleCapsule, InvalidName, PathOutsideDirectory,
                                        UnknownCapsule)

SCHEMA, MODEL = 'a' * 64, 'b' * 64


def capsule(name, nbytes=100, pinned=False, tier='device', fill=None):
    m = Manifest(name=name, parent='', tier=tier, pinned=pinned, step=3, episode=1, position=0,
                 nbytes=nbytes, schema_digest=SCHEMA, model_digest=MODEL, created=time.time())
    value = fill if fill is not None else sum(map(ord, name)) % 251
    return Capsule(m, torch.full((nbytes,), value, dtype=torch.uint8))


def tiers(store):
    return {m.name: m.tier for m in store.list()}


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
    assert m.name == 'a2' and m.tier == 'device' and m.step == 3
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
