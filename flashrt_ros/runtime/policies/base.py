'''Policy base: state declared as BufferSpecs, an in-place graph-capturable step over arena views.

A policy owns its weights (parameters and model buffers) but never its execution state: every
piece of state is declared by state_specs(), allocated by the arena, and handed back through
bind(). step() reads and writes only those views (copy_ / index_copy_), so a capsule of the
arena is the policy's complete state, and a captured CUDA graph stays valid across restores.

Also here: the counter-based sampler, the activation table and MLP builder shared by the
feed-forward and recurrent actors, ObservationHistory (the last N observations stacked, kept
in the arena) and TermHistory (Isaac Lab's per-term history, kept in the arena).
'''

import hashlib
import math

import torch
import torch.nn as nn

from ..errors import InvalidConfig
from ..state import BufferSpec, META_POSITION
from .invariant import check_kernels, pointwise

_M32 = 0xFFFFFFFF


# ---------------------------------------------------------------- counter-based sampler

def _mul32(x, c):
    # x * c mod 2**32 for x, c < 2**32 using only products below 2**49: int64 never
    # overflows, so CPU and CUDA produce identical bits (overflow wrap is not relied on)
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(x):
    # murmur3 finaliser: a bijection on [0, 2**32) with full avalanche; x stays non-negative,
    # so the arithmetic right shift of int64 acts as a logical one
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def gaussian_noise(seed, counter, n, apply=None):
    '''Standard normal float32 [..., n], a pure function of (seed, counter) (int64 tensors
    [..., 1]: one pair per session of a batched step, each row drawn as if alone).

    Integer tensor ops only (hash, then Box-Muller), no generator state: graph-capturable,
    and a restored rng buffer reproduces the same future samples. apply(fn, x): how log and
    cos run (invariant.pointwise for batch-invariant kernels), None: fn(x).
    '''
    apply = apply or (lambda fn, x: fn(x))
    h = _fmix32(seed & _M32)
    h = _fmix32(h ^ (counter & _M32))
    h = _fmix32(h ^ ((counter >> 32) & _M32))
    lanes = torch.arange(2 * n, device=seed.device, dtype=torch.int64)
    h = _fmix32(_fmix32(h ^ lanes))                                  # [..., 2n]
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))      # (0, 1), never 0
    return torch.sqrt(-2.0 * apply(torch.log, u[..., :n])) * \
        apply(torch.cos, (2.0 * math.pi) * u[..., n:])


# ---------------------------------------------------------------- base

class Policy(nn.Module):
    '''Base class; see docs/runtime.md. Subclasses fill state_specs(), step(), prefill().'''

    kind = ''
    # True when step() also takes a whole fleet at once: views [sessions, *shape], obs
    # [sessions, obs_dim], action [sessions, act_dim], each row computed as if alone. The
    # engine steps other policies session by session inside the same captured graph.
    batched = False
    # 'default' (the exporter's kernels) or 'batch_invariant' (invariant.py: every row of a
    # batch computed as if alone, so a fleet stepped as one batch is exact); set_kernels()
    kernels = 'default'

    def __init__(self, obs_dim, act_dim, capacity=0, noise_std=0.0, seed=0):
        super().__init__()
        if obs_dim < 1 or act_dim < 1:
            raise InvalidConfig(f'obs_dim and act_dim must be >= 1, got {obs_dim}, {act_dim}')
        self.obs_dim, self.act_dim, self.capacity = int(obs_dim), int(act_dim), int(capacity)
        self.noise_std, self.seed = float(noise_std), int(seed)
        self.views = {}     # name -> arena view; plain attribute: state is not a module buffer
        self.meta = None    # int64 [>=3] engine counters, shared with the engine

    def state_specs(self):
        raise NotImplementedError

    def config(self):
        '''Plain-Python description of what, besides weights, shapes the computation.'''
        # the kernel set rounds differently, so it is part of the digest (default: absent,
        # which keeps the digests of capsules taken before it existed)
        kernels = {} if self.kernels == 'default' else {'kernels': self.kernels}
        return {'kind': self.kind, 'obs_dim': self.obs_dim, 'act_dim': self.act_dim,
                'capacity': self.capacity, 'noise_std': self.noise_std, **kernels}

    def set_kernels(self, name):
        '''Use the kernel set `name` (invariant.KERNELS) for every later step.'''
        if check_kernels(name) != 'default' and not self.batched:
            raise InvalidConfig(f'kernels {name!r}: a {self.kind!r} policy of this format '
                                'steps one session at a time (mlp and recurrent policies '
                                'built from weights batch; TorchScript and ONNX files run '
                                'their own kernels); use the default kernels')
        self.kernels = name
        return self

    def bind(self, views, sessions=None):
        '''Keep references to the arena views (which must include 'meta'). Never copies.

        sessions: None for one session's views, or the leading dimension of batched views
        (StateArena.batched; only for policies with batched = True).'''
        lead = () if sessions is None else (int(sessions),)
        if lead and not self.batched:
            raise InvalidConfig(f'bind: a {self.kind!r} policy steps one session at a time')
        for spec in self.state_specs():
            view = views.get(spec.name)
            if view is None:
                raise InvalidConfig(f'bind: no view for state buffer {spec.name!r}')
            want = lead + tuple(spec.shape)
            if tuple(view.shape) != want or view.dtype != spec.dtype:
                raise InvalidConfig(
                    f'bind: {spec.name!r} is {tuple(view.shape)} {view.dtype}, the policy '
                    f'declared {want} {spec.dtype}')
            if view.device != self.device:
                raise InvalidConfig(f'bind: {spec.name!r} is on {view.device}, '
                                    f'the policy on {self.device}')
        meta = views.get('meta')
        if meta is None or meta.dtype != torch.int64 or meta.numel() <= META_POSITION:
            raise InvalidConfig("bind: needs an int64 'meta' view of at least 3 counters")
        self.views = {spec.name: views[spec.name] for spec in self.state_specs()}
        self.meta = meta

    @torch.no_grad()
    def reset_state(self):
        '''Initial state, in place: zeros, and the rng buffer set to (seed, counter 0).'''
        for view in self.views.values():
            view.zero_()
        self.views['rng'][0] = self.seed

    def step(self, obs, action):
        raise NotImplementedError

    def spans(self):
        '''History spans the step can be specialised to (ascending, the last = capacity), or
        [] when its cost does not depend on the position. The engine captures one step per
        span and runs the smallest span that covers the position; step(obs, action, span)
        must then read only the history rows [0, span).'''
        return []

    def prefill(self, observations):
        raise InvalidConfig(f'a {self.kind!r} policy keeps no history to prefill; use step()')

    def model_digest(self):
        '''sha256 hex over the config and every parameter/model buffer (name, dtype, shape,
        bytes). State lives in the arena, so it is never part of the digest.'''
        digest = hashlib.sha256(repr(sorted(self.config().items())).encode())
        for name, tensor in self.state_dict().items():
            t = tensor.detach().contiguous().cpu()
            digest.update(f'{name}|{t.dtype}|{tuple(t.shape)}|'.encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    @property
    def device(self):
        return next(self.parameters()).device

    def _rng_spec(self):
        return BufferSpec('rng', (2,), torch.int64, 'rng')      # seed, counter

    def _act(self, mean, action):
        '''action <- mean ([act_dim], or [sessions, act_dim] batched), plus noise_std *
        N(0, 1) from each session's rng counter (advanced) when sampling: the one place a
        single-action policy writes its output.'''
        if self.noise_std > 0:
            mean = mean + self._noise(self.act_dim)
            self.views['rng'][..., 1:2].add_(1)
        action.copy_(mean)

    def _noise(self, n, offset=None):
        # counter (+ offset, a device tensor) -> noise_std * N(0, 1) [..., n]; caller advances
        seed, counter = self.views['rng'][..., 0:1], self.views['rng'][..., 1:2]
        if offset is not None:
            counter = counter + offset
        invariant = self.kernels == 'batch_invariant'
        return self.noise_std * gaussian_noise(seed, counter, n, pointwise if invariant else None)


# ---------------------------------------------------------------- shared building blocks

ACTIVATIONS = {'elu': nn.ELU, 'relu': nn.ReLU, 'selu': nn.SELU, 'tanh': nn.Tanh,
               'sigmoid': nn.Sigmoid, 'lrelu': nn.LeakyReLU, 'leakyrelu': nn.LeakyReLU,
               'gelu': nn.GELU, 'softplus': nn.Softplus, 'swish': nn.SiLU, 'silu': nn.SiLU,
               'mish': nn.Mish, 'identity': nn.Identity}


def mlp(in_dim, hidden_dims, out_dim, activation):
    '''rsl_rl layout: Linear, act, Linear, act, ..., Linear (keys '0.weight', '2.weight', ...);
    out_dim None ends with an activation (an encoder feeding an rnn).'''
    if activation not in ACTIVATIONS:
        raise InvalidConfig(f'unknown activation {activation!r}; one of {sorted(ACTIVATIONS)}')
    layers, dims = [], [in_dim, *hidden_dims]
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), ACTIVATIONS[activation]()]
    if out_dim is not None:
        layers.append(nn.Linear(dims[-1], out_dim))
    return nn.Sequential(*layers)


# ---------------------------------------------------------------- observation history

HISTORY_ORDERS = ('oldest_first', 'newest_first')


class _InputHistory(Policy):
    '''A wrapper that keeps observation history in the arena in front of `inner`: the
    subclass declares its own history buffers (own_specs) and its step; the inner policy's
    state, binding, reset and device pass through, and prefill is refused.'''

    def __init__(self, inner, obs_dim):
        super().__init__(obs_dim, inner.act_dim, inner.capacity, inner.noise_std, inner.seed)
        self.inner = inner
        self.kind, self.batched = inner.kind, inner.batched

    def own_specs(self):
        raise NotImplementedError

    @property
    def kernels(self):
        return self.inner.kernels

    def set_kernels(self, name):
        self.inner.set_kernels(name)
        return self

    def state_specs(self):
        return list(self.inner.state_specs()) + self.own_specs()

    def bind(self, views, sessions=None):
        self.inner.bind(views, sessions)
        self.views = {**self.inner.views, **{s.name: views[s.name] for s in self.own_specs()}}
        self.meta = self.inner.meta

    @torch.no_grad()
    def reset_state(self):
        self.inner.reset_state()
        for spec in self.own_specs():
            self.views[spec.name].zero_()

    def prefill(self, observations):
        raise InvalidConfig(f'prefill with {self.history_name} is not supported; step() '
                            'instead')

    @property
    def device(self):
        return self.inner.device


class ObservationHistory(_InputHistory):
    '''The last `frames` observations stacked into one input of `inner` (obs_dim * frames).

    The window is state ('obs_history' [frames, obs_dim], kind history), so a capsule restores
    it. It starts as zeros at every episode start, as rsl_rl's and legged_gym's history
    buffers do after a reset. order: 'oldest_first' (the newest observation is the last row,
    rsl_rl / Isaac Lab CircularBuffer) or 'newest_first'.
    '''

    def __init__(self, inner, frames, order='oldest_first'):
        if frames < 2 or inner.obs_dim % frames:
            raise InvalidConfig(f'obs_history {frames}: the policy takes {inner.obs_dim} '
                                'inputs, which must be a multiple of obs_history (>= 2)')
        if order not in HISTORY_ORDERS:
            raise InvalidConfig(f'history_order {order!r}: one of {HISTORY_ORDERS}')
        super().__init__(inner, inner.obs_dim // frames)
        self.frames, self.order = int(frames), order

    def config(self):
        return {**self.inner.config(), 'obs_history': self.frames, 'history_order': self.order}

    history_name = 'obs_history'

    def own_specs(self):
        return [BufferSpec('obs_history', (self.frames, self.obs_dim), torch.float32, 'history')]

    @torch.no_grad()
    def step(self, obs, action):
        window = self.views['obs_history']                  # [(sessions,) frames, obs]
        obs = obs.view(window.shape[:-2] + (self.obs_dim,))
        if self.order == 'oldest_first':
            # roll materialises: no overlapping copy
            window.copy_(torch.roll(window, -1, window.dim() - 2))
            window[..., -1, :].copy_(obs)
        else:
            window.copy_(torch.roll(window, 1, window.dim() - 2))
            window[..., 0, :].copy_(obs)
        self.inner.step(window.flatten(-2), action)

    def model_digest(self):
        return self.inner.model_digest() + f'+history{self.frames}{self.order}'


class TermHistory(_InputHistory):
    '''Per-term history, as Isaac Lab's ObservationManager keeps it: each term of the
    observation frame has its own window of `history_length` readings; the input of `inner`
    is, term after term, that term's window oldest first, flattened.

    terms: [(size, history_length)] in frame order (ObservationLayout.term_history()); a
    term of history 1 passes through. The windows are state ('term_history', laid out as the
    inner input itself, kind history), and so is 'term_history_primed' (0 until the first
    step of an episode): that first step fills every slot of each window with its reading,
    as a CircularBuffer does after a reset. Both are chosen on the device (torch.where), so
    the step stays graph-capturable and a capsule restores the windows exactly.
    '''

    def __init__(self, inner, terms):
        terms = [(int(size), int(frames)) for size, frames in terms]
        if not terms or any(size < 1 or frames < 1 for size, frames in terms):
            raise InvalidConfig(f'term history {terms}: sizes and history lengths must be >= 1')
        width = sum(size * frames for size, frames in terms)
        if inner.obs_dim != width:
            raise InvalidConfig(
                f'per-term history: the terms stack to {width} policy inputs '
                f'({" + ".join(f"{f} x {s}" for s, f in terms)}), the policy takes '
                f'{inner.obs_dim}')
        super().__init__(inner, sum(size for size, _ in terms))
        self.terms = terms
        # (start in the frame, size, frames, start in the window buffer) per term
        self.segments, start, offset = [], 0, 0
        for size, frames in terms:
            self.segments.append((start, size, frames, offset))
            start, offset = start + size, offset + size * frames

    def config(self):
        return {**self.inner.config(), 'term_history': [list(t) for t in self.terms]}

    history_name = 'per-term history'

    def own_specs(self):
        return [BufferSpec('term_history', (self.inner.obs_dim,), torch.float32, 'history'),
                BufferSpec('term_history_primed', (1,), torch.float32, 'history')]

    @torch.no_grad()
    def step(self, obs, action):
        stacked = self.views['term_history']            # [(sessions,) inner obs_dim]
        primed = self.views['term_history_primed']      # [(sessions,) 1]
        obs = obs.view(stacked.shape[:-1] + (self.obs_dim,))
        shifted, filled = [], []
        for start, size, frames, offset in self.segments:
            window = stacked[..., offset:offset + size * frames].unflatten(-1, (frames, size))
            new = obs[..., start:start + size].unsqueeze(-2)            # [(sessions,) 1, size]
            shifted.append(torch.cat([window[..., 1:, :], new], -2).flatten(-2))
            filled.append(new.expand(window.shape).flatten(-2))
        # copies only: the policy input holds the readings bit for bit
        stacked.copy_(torch.where(primed > 0, torch.cat(shifted, -1), torch.cat(filled, -1)))
        primed.fill_(1.0)
        self.inner.step(stacked, action)

    def model_digest(self):
        return self.inner.model_digest() + f'+terms{self.terms}'
