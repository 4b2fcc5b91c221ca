"""StateArena: one allocation, aligned typed views, contiguous live prefix, unpack; the
runtime's names (enums.py) travel as their strings."""

import json

import pytest
import torch

from flashrt_ros.runtime.enums import Growth, PolicyKind, Tier
from flashrt_ros.runtime.errors import InvalidConfig
from flashrt_ros.runtime.state import BufferSpec, StateArena
from flashrt_ros.runtime.transfer import Transfer


def make_arena(capacity=64):
    return StateArena([
        BufferSpec('h', (3, 5), torch.float32, 'recurrent'),
        BufferSpec('meta', (4,), torch.int64, 'meta'),
        BufferSpec('conv', (2, 7), torch.float16, 'conv'),
        BufferSpec('k', (capacity, 2, 3), torch.float16, 'kv', 'append'),
        BufferSpec('v', (capacity, 2, 3), torch.float32, 'kv', 'append'),
        BufferSpec('tok', (capacity,), torch.int64, 'history', 'append'),
    ], 'cpu')


def test_one_allocation_aligned_views():
    a = make_arena()
    base = a.storage.data_ptr()
    end = base + a.storage.numel()
    for name, view in a.views.items():
        assert view.untyped_storage().data_ptr() == a.storage.untyped_storage().data_ptr()
        assert base <= view.data_ptr() < end
        if a.specs[name].growth == 'static':
            assert (view.data_ptr() - base) % 256 == 0
            assert view.data_ptr() + view.numel() * view.element_size() <= base + a.static_nbytes
        else:
            assert view.data_ptr() - base >= a.append_offset
    assert a.static_nbytes % 256 == 0 and a.append_offset % 256 == 0
    assert a.total_nbytes == a.storage.numel()
    assert a.capacity == 64
    assert a.views['k'].shape == (64, 2, 3) and a['tok'].dtype == torch.int64


def test_views_do_not_overlap():
    a = make_arena()
    for name, view in a.views.items():
        view.fill_(1)
        other = sum(int(v.ne(0).sum()) for n, v in a.views.items() if n != name)
        assert other == 0, f'writing {name} touched another buffer'
        a.zero_()


def test_append_prefix_is_contiguous_row_range():
    a = make_arena()
    p = 5
    a['k'][p] = 1
    a['v'][p] = 2
    a['tok'][p] = 3
    nz = a.storage.nonzero().flatten()
    lo, hi = a.append_offset + p * a.row_nbytes, a.append_offset + (p + 1) * a.row_nbytes
    assert int(nz.min()) >= lo and int(nz.max()) < hi
    assert a.live_nbytes(p + 1) == hi


def test_read_write_live_and_unpack_round_trip():
    a = make_arena()
    torch.manual_seed(0)
    a['h'].normal_()
    a['conv'].normal_()
    a['k'][:10].normal_()
    a['v'][:10].normal_()
    a['tok'][:10] = torch.arange(10)
    out = torch.empty(a.live_nbytes(10), dtype=torch.uint8)
    a.read_live(10, out, Transfer('cpu'))
    views = a.unpack(out, 10)
    for name in ('h', 'conv'):
        assert torch.equal(views[name], a[name])
    for name in ('k', 'v', 'tok'):
        assert views[name].shape[0] == 10
        assert torch.equal(views[name], a[name][:10])
    saved = a.storage.clone()
    a.zero_()
    ptr = a.storage.data_ptr()
    a.write_live(10, out, Transfer('cpu'))
    assert a.storage.data_ptr() == ptr
    assert torch.equal(a.storage[:a.live_nbytes(10)], saved[:a.live_nbytes(10)])


def test_live_bytes_grow_with_position_not_capacity():
    small, big = make_arena(2048), make_arena(16384)
    assert small.live_nbytes(2048) == big.live_nbytes(2048)
    assert big.live_nbytes(2048) < big.total_nbytes // 4


def test_schema_digest_tracks_layout():
    assert make_arena().schema_digest == make_arena().schema_digest
    assert make_arena(64).schema_digest != make_arena(65).schema_digest


def test_names_are_their_strings():
    """ROS messages, parameters, manifests and capsule files carry plain strings, and digests
    hash reprs: a member must be its string in every way a caller can look at it."""
    for member in (*PolicyKind, *Tier, *Growth):
        value = member.value
        assert isinstance(member, str) and member == value and {value: 1}[member] == 1
        assert (str(member), f'{member}', repr(member)) == (value, value, repr(value))
        assert json.dumps([member]) == json.dumps([value])
    spec = BufferSpec('k', (4, 2), torch.float32, 'kv', 'append')
    assert spec.growth is Growth.APPEND and spec == BufferSpec('k', (4, 2), torch.float32,
                                                               'kv', Growth.APPEND)


def test_bad_specs_refused():
    with pytest.raises(InvalidConfig, match='kind'):
        BufferSpec('x', (1,), torch.float32, 'weights')
    with pytest.raises(InvalidConfig, match='growth'):
        BufferSpec('x', (1,), torch.float32, 'kv', 'grow')
    with pytest.raises(InvalidConfig, match='twice'):
        StateArena([BufferSpec('x', (1,), torch.float32, 'kv')] * 2, 'cpu')
    with pytest.raises(InvalidConfig, match='one capacity'):
        StateArena([BufferSpec('k', (4, 2), torch.float32, 'kv', 'append'),
                    BufferSpec('v', (8, 2), torch.float32, 'kv', 'append')], 'cpu')
    a = make_arena()
    with pytest.raises(InvalidConfig, match='outside'):
        a.read_live(65, torch.empty(a.total_nbytes, dtype=torch.uint8), Transfer('cpu'))


def test_transfer_copies_byte_ranges():
    t = Transfer('cpu')
    src = torch.arange(64, dtype=torch.uint8).view(4, 16)      # a 2-D source, as the ring's
    dst = torch.zeros(8, dtype=torch.float32)                    # 32 bytes, typed
    t.copy(dst, src, 16, dst_offset=8, src_offset=32)
    t.sync()
    got = dst.view(torch.uint8)
    assert got[8:24].tolist() == list(range(32, 48))
    assert not got[:8].any() and not got[24:].any()
