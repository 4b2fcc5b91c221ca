"""Timing helpers: CUDA events on the GPU, perf_counter on the CPU, nearest-rank percentiles,
and the interleaved loop that times the variants of one row together.

Every figure in the suite is a distribution over many iterations after warm-up, and every
reported ratio compares two distributions measured in the same process, so a noisy machine
moves both sides together.
"""

import math
import random
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


def interleaved(clock, timed, ops, iters, warmup=3, before=None, walled=None):
    """Time every callable once per iteration, in turn, for warmup + iters iterations.

    Interleaving (rather than one loop per operation) makes the ratios within a row robust to
    a machine whose speed drifts during the run (a shared VM, GPU clocks): all columns see the
    same conditions. The order is shuffled every iteration (seeded), so no callable always runs
    right after another one's `before` step (the first host call after a step measured ~8 us
    slower on the CPU VM: cold caches); each takes each position equally often on average.
    timed: name -> fn, timed by `clock`; walled: name -> fn timed by host wall (its own
    synchronisation inside), reported with `timed`; ops: name -> engine operation, kept as
    (OpResult.latency_us, host wall of the whole call); before: name -> an untimed fn run just
    before that op. Returns ({name: stats}, {name: (reported latency, wall)}).
    """
    before = before or {}
    entries = [('timed', k, fn) for k, fn in timed.items()] + \
        [('walled', k, fn) for k, fn in (walled or {}).items()] + \
        [('op', k, fn) for k, fn in ops.items()]
    t = {k: [] for kind, k, _ in entries if kind != 'op'}
    dev, host = {k: [] for k in ops}, {k: [] for k in ops}
    order = random.Random(0)
    for i in range(warmup + iters):
        keep = i >= warmup
        order.shuffle(entries)
        for kind, k, fn in entries:
            if kind == 'timed':
                us = clock.once(fn)
            elif kind == 'walled':
                _, us = wall(fn)
            else:
                if k in before:
                    before[k]()
                result, us = wall(fn)
                if keep:
                    dev[k].append(result.latency_us)
            if keep:
                (host[k] if kind == 'op' else t[k]).append(us)
    return ({k: stats(v) for k, v in t.items()},
            {k: (stats(dev[k]), stats(host[k])) for k in ops})
