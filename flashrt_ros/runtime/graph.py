'''StepGraph: CUDA-graph capture and replay of a step function, eager on CPU.

One code path: the same `fn` runs eagerly on CPU (or with capture disabled) and is captured
once on CUDA. The graph holds no persistent buffers of its own; everything it reads or writes
lives in tensors the caller owns (the arena views, the obs/action staging buffers), whose
addresses must never change after capture.
'''

import gc
import time

import torch


class StepGraph:
    '''Capture `fn` once into a torch.cuda.CUDAGraph; replay() runs it.

    Capture protocol (nano-vllm / FlashRT style): save a clone of `state` (the arena
    storage), warm up `fn` `warmup` times on a dedicated side stream (lazy inits, cuBLAS
    workspaces, autotuning), synchronize, capture on that stream into `pool` (pass the `pool`
    of a previous StepGraph to share one graph memory pool), synchronize, then copy the saved
    state back so warm-up leaves no trace in the live state.

    On CPU, or with enabled=False, nothing is captured and replay() calls fn() eagerly.

    check: tensors whose data_ptr() must not move between replays (debug mode); replay()
    raises RuntimeError naming the tensor that moved, since a graph would silently keep
    reading the old address.
    '''

    def __init__(self, fn, device, enabled, state=None, warmup=3, *, pool=None, check=None):
        self.fn = fn
        self.device = torch.device(device)
        self.captured = False
        self.graph = None
        self.pool = None
        self._check = {name: (t, t.data_ptr()) for name, t in (check or {}).items()}
        if enabled and self.device.type == 'cuda':
            self._capture(state, warmup, pool)

    def _capture(self, state, warmup, pool):
        saved = state.clone() if state is not None else None
        stream = torch.cuda.Stream(self.device)
        # the side stream must see everything queued so far (arena init, weights upload)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # No garbage collection while capturing: a collection that frees an earlier engine's
        # graph (a reference cycle dropped by the caller) destroys its CUDA graph in the
        # middle of this capture, which CUDA forbids and which invalidates the capture
        # (seen on the H200: an MLP engine dropped, then an LSTM engine's capture failed).
        # torch.cuda.graph collects before capture begins; nothing may collect inside it.
        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.fn()
        finally:
            if gc_was_enabled:
                gc.enable()
        torch.cuda.synchronize(self.device)
        if saved is not None:
            # capture records kernels without running them, so state now holds exactly the
            # warm-up's effects; putting the clone back erases them
            state.copy_(saved)
            torch.cuda.synchronize(self.device)
        self.graph = graph
        self.captured = True

    def replay(self):
        '''Run the step once: graph replay on CUDA when captured, else fn() eagerly.'''
        if self._check:
            self.check_addresses()
        if self.captured:
            self.graph.replay()
        else:
            self.fn()

    def check_addresses(self):
        '''Raise RuntimeError if any checked tensor's storage moved since construction.'''
        for name, (tensor, ptr) in self._check.items():
            if tensor.data_ptr() != ptr:
                raise RuntimeError(
                    f'StepGraph: buffer {name!r} moved from {ptr:#x} to '
                    f'{tensor.data_ptr():#x} after capture; the graph would read stale memory')


def probe_determinism(graphs, prepare, state, outputs, replays=3):
    '''Replay each step in `graphs` `replays` times from one prepared state and compare every
    replay's outputs and state with the first, bit for bit. It can show that a kernel is not
    reproducible (an attention or GEMM that splits its reduction run to run), never prove that
    one is: a user's model (TorchScript, ONNX) may hold any kernel, so the engine asks at
    configure instead of trusting. prepare(i) sets `state` up for graph i (finite values that
    exercise the whole step); `state` is put back as it was afterwards.

    Returns a dict: deterministic, replays, graphs, differing (indices of graphs whose replays
    differed), max_abs_diff (outputs), probe_ms.
    '''
    t0 = time.perf_counter()
    saved = state.clone()
    differing, worst = [], 0.0
    try:
        for i, graph in enumerate(graphs):
            prepare(i)
            start = state.clone()
            first = None
            for _ in range(max(replays, 0)):
                state.copy_(start)
                graph.replay()
                now = (outputs.clone(), state.clone())
                if first is None:
                    first = now
                    continue
                if not (torch.equal(now[0], first[0]) and torch.equal(now[1], first[1])):
                    if i not in differing:
                        differing.append(i)
                    diff = (now[0].double() - first[0].double()).abs().max().item()
                    worst = max(worst, diff)
    finally:
        state.copy_(saved)
        if state.is_cuda:
            torch.cuda.synchronize(state.device)
    return {'deterministic': not differing, 'replays': max(replays, 0), 'graphs': len(graphs),
            'differing': differing, 'max_abs_diff': worst,
            'probe_ms': (time.perf_counter() - t0) * 1e3}
