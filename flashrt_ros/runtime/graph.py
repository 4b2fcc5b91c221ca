'''StepGraph: CUDA-graph capture and replay of a step function, eager on CPU.

One code path: the same `fn` runs eagerly on CPU (or with capture disabled) and is captured
once on CUDA. The graph holds no persistent buffers of its own; everything it reads or writes
lives in tensors the caller owns (the arena views, the obs/action staging buffers), whose
addresses must never change after capture.
'''

import gc
import time

import torch
from torch.overrides import TorchFunctionMode


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

    host_constants: run warm-up and capture under HostConstants (a step whose library code
    builds small constants from host data on every call, such as LeRobot's).
    '''

    def __init__(self, fn, device, enabled, state=None, warmup=3, *, pool=None, check=None,
                 host_constants=False):
        self.fn = fn
        self.constants = HostConstants() if host_constants else None
        self.device = torch.device(device)
        self.captured = False
        self.graph = None
        self.pool = None
        self._check = {name: (t, t.data_ptr()) for name, t in (check or {}).items()}
        if enabled and self.device.type == 'cuda':
            self._capture(state, warmup, pool)

    def _capture(self, state, warmup, pool):
        saved = state.clone() if state is not None else None
        fn = self.fn if self.constants is None else lambda: self.constants.run(self.fn)
        stream = torch.cuda.Stream(self.device)
        # the side stream must see everything queued so far (arena init, weights upload)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
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
                fn()
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


class HostConstants(TorchFunctionMode):
    '''Host-to-device copies of constants, made capturable. A CUDA graph cannot hold a copy
    from pageable host memory (it synchronises), yet library code builds small constants from
    Python values on every call (LeRobot: attention-mask patterns, the flow-matching timestep,
    special tokens, ACT's zero latent). run(fn) calls fn under this mode: on the first call
    (warm-up, eager) each such copy (torch.tensor(..., device=cuda), cpu_tensor.to(cuda),
    .cuda()) runs and its result is kept, in call order; on later calls (more warm-up, the
    capture) the k-th copy's host value must equal the kept one's (else RuntimeError: it is
    not a constant, and a graph would freeze it) and a device-side clone of the kept tensor
    stands in: a captured copy kernel, so code that writes its result in place cannot change
    the constant. Any other host synchronisation still fails the capture, as it should.'''

    def __init__(self):
        super().__init__()
        self.kept, self.index = [], 0

    def run(self, fn):
        self.index = 0
        with self:
            return fn()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        host = _host_value(func, args, kwargs)
        if host is None:
            return func(*args, **kwargs)
        index, self.index = self.index, self.index + 1
        if index == len(self.kept):
            out = func(*args, **kwargs)
            self.kept.append((host.clone(), out.clone()))
            return out
        kept_host, kept = self.kept[index]
        if host.dtype != kept_host.dtype or host.shape != kept_host.shape or \
                not torch.equal(host, kept_host):
            raise RuntimeError(f'host-to-device copy #{index} ({func.__name__}) changed value '
                               'between calls: not a constant, cannot be captured')
        return kept.clone()


def _host_value(func, args, kwargs):
    '''The host tensor a call copies to a CUDA device, else None.'''
    if func is torch.tensor:
        device = kwargs.get('device')
        if device is None or torch.device(device).type != 'cuda':
            return None
        return torch.tensor(args[0], dtype=kwargs.get('dtype'))
    if func not in (torch.Tensor.to, torch.Tensor.cuda) or args[0].device.type != 'cpu':
        return None
    if func is torch.Tensor.cuda:
        return args[0]
    device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    if device is None or torch.device(device).type != 'cuda':
        return None
    return args[0] if dtype is None else args[0].to(dtype)


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
