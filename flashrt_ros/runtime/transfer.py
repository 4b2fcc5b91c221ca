"""Transfer: the byte copies of the step and of every capsule operation, and their one
synchronisation.

Everything the engine moves between the arena, capsules, the rollback ring and the obs/action
staging buffers is a contiguous byte range, so one primitive covers it: copy `nbytes` from one
tensor's storage to another's, on the engine's stream, then `sync()` once per operation.

On CUDA the copies go through cuda-python's runtime API (`cudaMemcpyAsync`, direction
`cudaMemcpyDefault`: device, pinned or pageable host memory on either side) when
`cuda.bindings` (or the older `cuda.cudart`) imports: on the H200 host that issues a 4 KB copy
about 2 us faster than torch's `copy_` dispatch, and `cudaStreamSynchronize` is the cheapest
wait (see benchmarks/results). Without cuda-python, and on CPU, the copy is torch's `copy_`:
the same call sites, the same bytes, only the issuing library differs. Timer measures an
operation from its first issued copy to that synchronisation.
"""

import math
import time

import torch


def _cudart():
    """cuda-python's runtime module, or None when it is not installed."""
    try:
        from cuda.bindings import runtime
        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart
        return cudart
    except ImportError:
        return None


class Transfer:
    """Byte copies on one device's current stream (captured at construction) and the wait.

    Tensors passed in must be contiguous; offsets and sizes are in bytes. Nothing here
    allocates, so a capsule operation's cost is its copy, its wait and its bookkeeping.
    """

    def __init__(self, device, use_cuda_python=True):
        self.device = torch.device(device)
        self.cuda = self.device.type == 'cuda'
        self._rt = None
        self.backend = 'torch'
        if self.cuda:
            self._stream = torch.cuda.current_stream(self.device)
            rt = _cudart() if use_cuda_python else None
            if rt is not None:
                self._rt = rt
                self._handle = self._stream.cuda_stream
                self._kind = rt.cudaMemcpyKind.cudaMemcpyDefault
                self._ok = rt.cudaError_t.cudaSuccess
                self.backend = 'cuda-python'

    def copy(self, dst, src, nbytes, dst_offset=0, src_offset=0):
        """dst bytes [dst_offset, +nbytes) = src bytes [src_offset, +nbytes); asynchronous on
        CUDA (call sync() before reading the result on the host or freeing either side)."""
        if nbytes <= 0:
            return
        if self._rt is not None:
            err, = self._rt.cudaMemcpyAsync(
                dst.data_ptr() + dst_offset, src.data_ptr() + src_offset, nbytes, self._kind,
                self._handle)
            if err != self._ok:
                raise RuntimeError(f'cudaMemcpyAsync of {nbytes} bytes failed: {err}')
            return
        d, s = _bytes(dst), _bytes(src)
        if dst_offset or d.numel() != nbytes:
            d = d[dst_offset:dst_offset + nbytes]
        if src_offset or s.numel() != nbytes:
            s = s[src_offset:src_offset + nbytes]
        d.copy_(s, non_blocking=True)

    def sync(self):
        """Wait for every copy (and graph replay) queued on the stream so far."""
        if self._rt is not None:
            err, = self._rt.cudaStreamSynchronize(self._handle)
            if err != self._ok:
                raise RuntimeError(f'cudaStreamSynchronize failed: {err}')
        elif self.cuda:
            self._stream.synchronize()


class Timer:
    """Wall time of an operation's device work, ended by its one synchronisation.

    The window opens before the copies (or the graph replay) are issued and closes after
    Transfer.sync() returns, so `us` is what the work costs the caller, issue overhead (and
    any host bookkeeping done while the copy is in flight) included, on every device. (CUDA
    events measured the copy alone and cost two records, an event wait and elapsed_time:
    about 12 us per call on the H200 host.)
    """

    def __init__(self, transfer):
        self._transfer = transfer
        self._depth = 0     # reset_episode times a restore that times itself: outermost wins

    def __enter__(self):
        self._depth += 1
        if self._depth == 1:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth:
            self.us = math.nan      # an inner window has no figure of its own
            return False
        self._transfer.sync()
        self.us = (time.perf_counter() - self._t0) * 1e6
        return False


def _bytes(t):
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if t.dim() != 1:
        t = t.view(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)
