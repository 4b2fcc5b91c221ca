"""State declared as data: BufferSpec, and the StateArena that holds every buffer in ONE slab.

Layout of the single uint8 allocation (offsets 256-byte aligned):

    [ static block: every static buffer, 256-aligned ][ append region: capacity rows ]
    0                                    static_nbytes = append_offset

Each append row holds one position of every append buffer, interleaved (position-major), so
the live prefix [0, position) of all append buffers is one contiguous byte range. Because the
static block is padded up to append_offset, the whole live state storage[:live_nbytes(position)]
is a single contiguous range: a snapshot or restore is ONE copy (the contract allows two).

Sessions (a fleet in one arena): `sessions` blocks of exactly that layout, one after another,
each `block_nbytes` long. A session's live state is then one range inside its block (still one
copy), its bytes are laid out as a single-session arena's (same schema digest, so capsules move
between single- and multi-session engines and between sessions), and `batched` views put a
leading session dimension over all blocks for a step that computes the whole fleet at once.
"""

from dataclasses import dataclass
import hashlib
import json
import math

import torch

from .enums import Growth
from .errors import InvalidConfig

KINDS = ('kv', 'recurrent', 'conv', 'chunk', 'history', 'rng', 'meta')
GROWTHS = tuple(Growth)
META_STEP, META_EPISODE, META_POSITION = 0, 1, 2   # indices into the engine's int64 'meta' buffer
META_TAG = 3     # the caller's tag of the input the latest step consumed (0: none)
ALIGN = 256


def _align(n, a=ALIGN):
    return (n + a - 1) // a * a


def _itemsize(dtype):
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple            # append growth: (capacity, *per_position_shape)
    dtype: torch.dtype
    kind: str               # one of KINDS
    growth: Growth = Growth.STATIC
    # False: left out of the step's finite flag (step.py), for a buffer whose NaN could never
    # reach an action, such as a cache key compared bit for bit with a checked observation
    # (lerobot_prefix's prefix_obs): on the CPU its pass costs as much as the step's copies
    finite_checked: bool = True

    def __post_init__(self):
        object.__setattr__(self, 'shape', tuple(int(s) for s in self.shape))
        if not self.name or not isinstance(self.name, str):
            raise InvalidConfig(f'buffer name must be a non-empty string, got {self.name!r}')
        if self.kind not in KINDS:
            raise InvalidConfig(f'buffer {self.name!r}: kind {self.kind!r} is not one of {KINDS}')
        if self.growth not in GROWTHS:
            raise InvalidConfig(
                f'buffer {self.name!r}: growth {self.growth!r} is not one of {GROWTHS}')
        object.__setattr__(self, 'growth', Growth(self.growth))
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidConfig(f'buffer {self.name!r}: dtype must be a torch.dtype')
        if any(s < 0 for s in self.shape):
            raise InvalidConfig(f'buffer {self.name!r}: negative size in shape {self.shape}')
        if self.growth == Growth.APPEND and len(self.shape) < 1:
            raise InvalidConfig(f'append buffer {self.name!r} needs shape (capacity, ...)')

    @property
    def nbytes(self):
        return math.prod(self.shape) * _itemsize(self.dtype)

    @property
    def row_nbytes(self):
        """Bytes of one position (append buffers only)."""
        return math.prod(self.shape[1:]) * _itemsize(self.dtype)


def _contiguous_strides(shape):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


class StateArena:
    """Every state buffer as a typed view into one contiguous uint8 allocation.

    Invariant: `storage` is allocated once; views never move (their data_ptr() is fixed), so a
    captured CUDA graph and the policy's bound views stay valid across every capsule operation.
    """

    def __init__(self, specs, device, sessions=1):
        self.device = torch.device(device)
        if isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 1:
            raise InvalidConfig(f'sessions must be a whole number >= 1, got {sessions!r}')
        self.sessions = sessions
        self.specs = {}
        for spec in specs:
            if spec.name in self.specs:
                raise InvalidConfig(f'buffer name {spec.name!r} is declared twice')
            self.specs[spec.name] = spec
        static = [s for s in specs if s.growth == Growth.STATIC]
        append = [s for s in specs if s.growth == Growth.APPEND]
        capacities = {s.shape[0] for s in append}
        if len(capacities) > 1:
            raise InvalidConfig(
                f'append buffers must share one capacity, got {sorted(capacities)}')
        self.capacity = capacities.pop() if capacities else 0

        self._offsets = {}   # name -> byte offset (static) or column offset in a row (append)
        off = 0
        for s in static:
            off = _align(off)
            self._offsets[s.name] = off
            off += s.nbytes
        # Padding the static block to the append offset makes the live state one range.
        self.static_nbytes = _align(off)
        self.append_offset = self.static_nbytes
        col, widest = 0, 1
        for s in append:
            isz = _itemsize(s.dtype)
            widest = max(widest, isz)
            col = _align(col, isz)   # typed as_strided views need element-aligned columns
            self._offsets[s.name] = col
            col += s.row_nbytes
        self.row_nbytes = _align(col, widest) if append else 0
        # one session's block; the digest covers it alone, never the number of sessions
        self.block_nbytes = _align(self.append_offset + self.capacity * self.row_nbytes)
        self.total_nbytes = self.block_nbytes * sessions

        self.storage = torch.zeros(self.total_nbytes, dtype=torch.uint8, device=self.device)
        self.blocks = [self.storage[i * self.block_nbytes:(i + 1) * self.block_nbytes]
                       for i in range(sessions)]
        # per-session typed views (a single-session policy binds these); views = session 0's
        self.session_views = [self._views_over(b, self.capacity) for b in self.blocks]
        self.views = self.session_views[0]
        # [sessions, *shape] views over every block at once (a batched step binds these)
        self.batched = {name: self._batched_view(name) for name in self.specs}
        self.schema_digest = self._digest()

    # -- layout --------------------------------------------------------------------------------

    def _views_over(self, data, position):
        """Typed views with this arena's layout over `data` (append views cover [:position])."""
        views = {}
        for name, spec in self.specs.items():
            off = self._offsets[name]
            if spec.growth == Growth.STATIC:
                views[name] = data[off:off + spec.nbytes].view(spec.dtype).view(spec.shape)
                continue
            isz = _itemsize(spec.dtype)
            typed = data.view(spec.dtype)   # [len(data) / isz]; len is a multiple of 256
            per = spec.shape[1:]
            stride = (self.row_nbytes // isz,) + _contiguous_strides(per)
            start = typed.storage_offset() + (self.append_offset + off) // isz
            views[name] = typed.as_strided((position,) + per, stride, start)
        return views

    def _batched_view(self, name):
        spec, off = self.specs[name], self._offsets[name]
        isz = _itemsize(spec.dtype)
        typed = self.storage.view(spec.dtype)      # block_nbytes is a multiple of 256
        if spec.growth == Growth.STATIC:
            shape, inner, start = spec.shape, _contiguous_strides(spec.shape), off
        else:
            shape = spec.shape
            inner = (self.row_nbytes // isz,) + _contiguous_strides(spec.shape[1:])
            start = self.append_offset + off
        return typed.as_strided((self.sessions,) + shape,
                                (self.block_nbytes // isz,) + inner, start // isz)

    def _digest(self):
        layout = {
            'buffers': [[n, list(s.shape), str(s.dtype), s.kind, s.growth, self._offsets[n]]
                        for n, s in self.specs.items()],
            'static_nbytes': self.static_nbytes,
            'row_nbytes': self.row_nbytes,
            'capacity': self.capacity,
        }
        return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()

    def __getitem__(self, name):
        return self.views[name]

    # -- live ranges ---------------------------------------------------------------------------

    def static_blocks(self):
        """uint8 [sessions, static_nbytes]: every session's static buffers (what the rollback
        ring records each step)."""
        return self.storage.as_strided((self.sessions, self.static_nbytes),
                                       (self.block_nbytes, 1))

    def live_nbytes(self, position):
        """Bytes of the live state at `position`: grows with position, not with capacity."""
        return self.static_nbytes + int(position) * self.row_nbytes

    def _check_position(self, position):
        if not 0 <= int(position) <= self.capacity:
            raise InvalidConfig(f'position {position} is outside [0, {self.capacity}]')

    def read_live(self, position, out, transfer, session=0):
        """Copy a session's live bytes into out[:live_nbytes(position)]: one contiguous copy,
        issued through `transfer` (runtime/transfer.py; asynchronous until its sync())."""
        self._check_position(position)
        transfer.copy(out, self.storage, self.live_nbytes(position),
                      src_offset=session * self.block_nbytes)

    def write_live(self, position, src, transfer, session=0):
        """Copy src[:live_nbytes(position)] over a session's live bytes: one copy, no
        reallocation.

        `src` may sit on the device or in host memory (transfer copies from where it is).
        Append rows at or beyond `position` keep whatever they held; policies read only
        the live prefix.
        """
        self._check_position(position)
        n = self.live_nbytes(position)
        if src.numel() < n:
            raise InvalidConfig(f'source holds {src.numel()} bytes, live state needs {n}')
        transfer.copy(self.storage, src, n, dst_offset=session * self.block_nbytes)

    def unpack(self, data, position):
        """Typed views (same layout) over a capsule's live bytes; append views are [:position].

        `data` must be a uint8 tensor of at least live_nbytes(position) bytes; the views alias
        it (nothing is copied).
        """
        self._check_position(position)
        n = self.live_nbytes(position)
        if data.dtype != torch.uint8 or data.numel() < n:
            raise InvalidConfig(
                f'capsule bytes ({data.numel()}, {data.dtype}) do not cover {n} live bytes')
        # n is a multiple of every itemsize (rows are padded to the widest), so dtype views of
        # data[:n] are legal without copying.
        return self._views_over(data[:n], position)

    def zero_(self, session=None):
        """Zero every session's block, or only `session`'s."""
        (self.storage if session is None else self.blocks[session]).zero_()
