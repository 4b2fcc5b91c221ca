'''StepGraph: CUDA-graph capture and replay of a step function, eager on CPU.

One code path: the same `fn` runs eagerly on CPU (or with capture disabled) and is captured
once on CUDA. The graph holds no persistent buffers of its own; everything it reads or writes
lives in tensors the caller owns (the arena views, the obs/action staging buffers), whose
addresses must never change after capture.
'''

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
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self.fn()
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
