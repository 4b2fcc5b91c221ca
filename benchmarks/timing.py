"""Timing helpers: CUDA events on the GPU, perf_counter on the CPU, nearest-rank percentiles.

Every figure in the suite is a distribution over many iterations after warm-up, and every
reported ratio compares two distributions measured in the same process, so a noisy machine
moves both sides together.
"""

import math
import time

import torch


def percentile(xs, q):
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence; NaN when empty."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return float(s[min(len(s) - 1, max(0, math.ceil(q / 100.0 * len(s)) - 1))])


def stats(xs):
    """p50 / p99 / max / mean (microseconds in, microseconds out) and the sample count."""
    return {'p50': percentile(xs, 50), 'p99': percentile(xs, 99),
            'max': float(max(xs)) if xs else math.nan,
            'mean': float(sum(xs) / len(xs)) if xs else math.nan, 'n': len(xs)}


class Clock:
    """Times a callable per iteration: device time on CUDA, wall time on CPU (microseconds)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == 'cuda'
        # Event.record() with no stream looks the stream up in Python on every call (several
        # microseconds on the H200 host): look it up once.
        self.stream = torch.cuda.current_stream(self.device) if self.cuda else None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def once(self, fn):
        """Microseconds of one fn() call (events recorded around it on CUDA)."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            fn()
            end.record(self.stream)
            end.synchronize()
            return start.elapsed_time(end) * 1000.0
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def time(self, fn, iters, warmup=3, before=None):
        """Run before() (untimed, e.g. to dirty the state) then fn() (timed) each iteration."""
        out = []
        for i in range(warmup + iters):
            if before is not None:
                before()
            us = self.once(fn)
            if i >= warmup:
                out.append(us)
        return out


def wall(fn):
    """(result, microseconds) of one call, host wall clock (the caller's view)."""
    t0 = time.perf_counter()
    r = fn()
    return r, (time.perf_counter() - t0) * 1e6
