"""RollbackRing: each session's static block before each of its recent steps, on the device.

The step program records into it inside the captured step (no host sync); PolicyEngine.rollback
restores from it with one copy.
"""

import torch

from .errors import InvalidConfig
from .state import META_STEP


class RollbackRing:
    """depth slots per session of its static block; a session's slot (its meta step % depth)
    holds its PRE-step block.

    Invariant: the pre-step state of a session's step s lives in its slot s % depth until step
    s + depth overwrites it. Append buffers need no copy: a step only writes row `position`, so
    the prefix before an older position is unchanged, and the position itself is in the static
    block. A session left out of a tick has its slot rewritten with its unchanged state, which
    costs it the oldest entry (the engine then offers depth - 1).
    """

    def __init__(self, arena, depth, transfer):
        if depth < 1:
            raise InvalidConfig(f'rollback_depth must be >= 1, got {depth}')
        self.depth = int(depth)
        self.arena = arena
        self.static = arena.static_blocks()                 # uint8 [sessions, static_nbytes]
        sessions, self.nbytes = self.static.shape
        self.slots = torch.zeros(sessions, self.depth, self.nbytes, dtype=torch.uint8,
                                 device=arena.storage.device)
        self.step_view = arena.batched['meta'][:, META_STEP]        # int64 [sessions]
        self._rows = torch.arange(sessions, device=arena.storage.device)
        self._slot = torch.zeros(sessions, dtype=torch.int64, device=arena.storage.device)
        self._transfer = transfer
        # The per-step copies move the widest words the layout allows: an indexed copy runs
        # one thread per element, so int64 words copy 8x fewer elements than bytes (measured
        # on the H200: 23 us per uint8 copy of 4,096 sessions' blocks).
        self.words = _widest_view(self.static, arena.block_nbytes)
        self._slot_words = self.slots.view(self.words.dtype)

    def record(self):
        # Device-side slot indices: no host sync, so it rides inside the graph.
        if len(self._rows) == 1:    # one session: one index_copy_ (fewest kernels per step)
            self._slot_words[0].index_copy_(0, self.step_view % self.depth, self.words)
            return
        torch.remainder(self.step_view, self.depth, out=self._slot)
        self._slot_words.index_put_((self._rows, self._slot), self.words)

    def recorded(self):
        """[sessions, static words]: the blocks the latest record() saved (pre-step state;
        sessions > 1), in the words of `self.words`."""
        return self._slot_words[self._rows, self._slot]

    def restore(self, step, session=0):
        """Put back a session's pre-step static block of step `step` (the caller checks
        availability)."""
        n = self.nbytes
        self._transfer.copy(self.arena.storage, self.slots, n,
                            dst_offset=session * self.arena.block_nbytes,
                            src_offset=(session * self.depth + step % self.depth) * n)


def _widest_view(blocks, block_nbytes):
    """blocks (uint8 [sessions, nbytes], rows block_nbytes apart) as the widest integer words
    that tile both the rows and their spacing (the same bytes, reinterpreted)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if blocks.shape[1] % size == 0 and block_nbytes % size == 0 and \
                (blocks.storage_offset() % size == 0) and blocks.data_ptr() % size == 0:
            return blocks.view(dtype)
    return blocks
