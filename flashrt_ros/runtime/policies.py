'''Policies: state declared as BufferSpecs, an in-place graph-capturable step over arena views.

A policy owns its weights (parameters and model buffers) but never its execution state: every
piece of state is declared by state_specs(), allocated by the arena, and handed back through
bind(). step() reads and writes only those views (copy_ / index_copy_), so a capsule of the
arena is the policy's complete state, and a captured CUDA graph stays valid across restores.
'''

import hashlib
import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import CapacityExceeded, InvalidConfig
from .state import META_POSITION, BufferSpec

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


def gaussian_noise(seed, counter, n):
    '''Standard normal float32 [n], a pure function of (seed, counter) (int64 tensors [1]).

    Integer tensor ops only (hash, then Box-Muller), no generator state: graph-capturable,
    and a restored rng buffer reproduces the same future samples.
    '''
    h = _fmix32(seed & _M32)
    h = _fmix32(h ^ (counter & _M32))
    h = _fmix32(h ^ ((counter >> 32) & _M32))
    lanes = torch.arange(2 * n, device=seed.device, dtype=torch.int64)
    h = _fmix32(_fmix32(h ^ lanes))                                  # [2n]
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))      # (0, 1), never 0
    return torch.sqrt(-2.0 * torch.log(u[:n])) * torch.cos((2.0 * math.pi) * u[n:])


# ---------------------------------------------------------------- base

class Policy(nn.Module):
    '''Base class; see docs/runtime.md. Subclasses fill state_specs(), step(), prefill().'''

    kind = ''

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
        return {'kind': self.kind, 'obs_dim': self.obs_dim, 'act_dim': self.act_dim,
                'capacity': self.capacity, 'noise_std': self.noise_std}

    def bind(self, views):
        '''Keep references to the arena views (which must include 'meta'). Never copies.'''
        for spec in self.state_specs():
            view = views.get(spec.name)
            if view is None:
                raise InvalidConfig(f'bind: no view for state buffer {spec.name!r}')
            if tuple(view.shape) != tuple(spec.shape) or view.dtype != spec.dtype:
                raise InvalidConfig(
                    f'bind: {spec.name!r} is {tuple(view.shape)} {view.dtype}, the policy '
                    f'declared {tuple(spec.shape)} {spec.dtype}')
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

    def _noise(self, n, offset=None):
        # counter (+ offset, a device tensor) -> noise_std * N(0, 1) [n]; caller advances
        seed, counter = self.views['rng'][0:1], self.views['rng'][1:2]
        if offset is not None:
            counter = counter + offset
        return self.noise_std * gaussian_noise(seed, counter, n)


# ---------------------------------------------------------------- recurrent (rsl_rl actor)

_ACTIVATIONS = {'elu': nn.ELU, 'relu': nn.ReLU, 'selu': nn.SELU, 'tanh': nn.Tanh,
                'sigmoid': nn.Sigmoid, 'lrelu': nn.LeakyReLU, 'leakyrelu': nn.LeakyReLU,
                'gelu': nn.GELU, 'softplus': nn.Softplus, 'swish': nn.SiLU, 'silu': nn.SiLU,
                'mish': nn.Mish, 'identity': nn.Identity}


def _mlp(in_dim, hidden_dims, out_dim, activation):
    # rsl_rl layout: Linear, act, Linear, act, ..., Linear -> keys 'actor.0.weight', ...;
    # out_dim None ends with an activation (an encoder feeding the rnn)
    if activation not in _ACTIVATIONS:
        raise InvalidConfig(f'unknown activation {activation!r}; one of {sorted(_ACTIVATIONS)}')
    layers, dims = [], [in_dim, *hidden_dims]
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), _ACTIVATIONS[activation]()]
    if out_dim is not None:
        layers.append(nn.Linear(dims[-1], out_dim))
    return nn.Sequential(*layers)


class RecurrentPolicy(Policy):
    '''[normalizer] -> [MLP encoder] -> LSTM/GRU -> MLP head: the rsl_rl / Isaac Lab
    recurrent actor (ActorCriticRecurrent.act_inference). Submodule names follow the
    exporter's policy.pt ('rnn', 'actor'), so its weights load by name.

    State: 'hidden_state' (and 'cell_state' for LSTM) [num_layers, hidden] (batch 1 folded),
    'rng' (seed, counter) for optional Gaussian action noise of std `noise_std`.
    '''

    kind = 'recurrent'

    def __init__(self, obs_dim, act_dim, *, rnn_type='lstm', rnn_hidden_dim=256,
                 rnn_num_layers=1, encoder_dims=(), actor_hidden_dims=(256, 128, 64),
                 activation='elu', normalize=False, norm_eps=1e-2, noise_std=0.0, seed=0):
        super().__init__(obs_dim, act_dim, 0, noise_std, seed)
        rnn_type = rnn_type.lower()
        if rnn_type not in ('lstm', 'gru'):
            raise InvalidConfig(f"rnn_type must be 'lstm' or 'gru', got {rnn_type!r}")
        self.rnn_type, self.activation = rnn_type, activation
        self.encoder_dims, self.actor_hidden_dims = tuple(encoder_dims), tuple(actor_hidden_dims)
        self.normalize, self.norm_eps = bool(normalize), float(norm_eps)
        if self.normalize:
            # EmpiricalNormalization: (x - _mean) / (_std + eps), [1, obs_dim] buffers
            self.register_buffer('norm_mean', torch.zeros(1, obs_dim))
            self.register_buffer('norm_std', torch.ones(1, obs_dim))
        self.encoder = _mlp(obs_dim, self.encoder_dims, None, activation)
        rnn_in = self.encoder_dims[-1] if self.encoder_dims else obs_dim
        cls = nn.LSTM if rnn_type == 'lstm' else nn.GRU
        self.rnn = cls(rnn_in, rnn_hidden_dim, rnn_num_layers)
        self.actor = _mlp(rnn_hidden_dim, self.actor_hidden_dims, act_dim, activation)
        self.requires_grad_(False)
        self.eval()

    def config(self):
        return {**super().config(), 'rnn_type': self.rnn_type, 'activation': self.activation,
                'normalize': self.normalize, 'norm_eps': self.norm_eps}

    def state_specs(self):
        shape = (self.rnn.num_layers, self.rnn.hidden_size)
        dtype = self.rnn.weight_hh_l0.dtype
        specs = [BufferSpec('hidden_state', shape, dtype, 'recurrent')]
        if self.rnn_type == 'lstm':
            specs.append(BufferSpec('cell_state', shape, dtype, 'recurrent'))
        return specs + [self._rng_spec()]

    @torch.no_grad()
    def step(self, obs, action):
        # same op sequence and shapes as the exporter's forward on x [1, obs_dim], so the
        # actions match it bit for bit on the same device
        x = obs.view(1, self.obs_dim).to(self.rnn.weight_hh_l0.dtype)      # [1, obs]
        if self.normalize:
            x = (x - self.norm_mean) / (self.norm_std + self.norm_eps)
        x = self.encoder(x).unsqueeze(0)                                     # [1, 1, in]
        hidden = self.views['hidden_state']                                  # [L, H]
        if self.rnn_type == 'lstm':
            cell = self.views['cell_state']
            out, (h, c) = self.rnn(x, (hidden.unsqueeze(1), cell.unsqueeze(1)))
            cell.copy_(c.view_as(cell))
        else:
            out, h = self.rnn(x, hidden.unsqueeze(1))
        hidden.copy_(h.view_as(hidden))
        mean = self.actor(out.squeeze(0)).view(self.act_dim)                 # [A]
        if self.noise_std > 0:
            mean = mean + self._noise(self.act_dim)
            self.views['rng'][1:2].add_(1)
        action.copy_(mean)


# ---------------------------------------------------------------- history (hybrid)

class _AttentionMixer(nn.Module):
    # causal self-attention without positional encoding: order comes from the recurrent
    # layers and the causal mask (NoPE), which keeps every position's math identical
    def __init__(self, d_model, heads):
        super().__init__()
        self.heads, self.head_dim = heads, d_model // heads
        self.wqkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)


class _RecurrenceMixer(nn.Module):
    # gated linear recurrence: u -> causal depthwise conv (width 4) -> silu -> diagonal
    # h = a*h + (1-a)*u with a = sigmoid(W_a x + b_a), output gated by silu(z)
    def __init__(self, d_model, conv_width):
        super().__init__()
        self.in_proj = nn.Linear(d_model, 3 * d_model, bias=False)
        self.conv_w = nn.Parameter(torch.randn(d_model, conv_width) / math.sqrt(conv_width))
        self.conv_b = nn.Parameter(torch.zeros(d_model))
        # decay biases spread over [2, 7]: a in ~[0.88, 0.999], time scales 10..1000 steps
        self.a_bias = nn.Parameter(torch.linspace(2.0, 7.0, d_model))
        self.out_proj = nn.Linear(d_model, d_model, bias=False)


class _Block(nn.Module):
    def __init__(self, d_model, heads, mlp_ratio, conv_width, attention):
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model, eps=1e-6)
        self.norm2 = nn.RMSNorm(d_model, eps=1e-6)
        if attention:
            self.mixer = _AttentionMixer(d_model, heads)
        else:
            self.mixer = _RecurrenceMixer(d_model, conv_width)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model, bias=False), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model, bias=False))


def linear_scan(a, b, h0):
    '''h_t = a_t * h_{t-1} + b_t over t, for a, b [T, d] and h0 [d]; returns h [T, d].

    Hillis-Steele inclusive scan: log2(T) elementwise passes instead of T sequential steps.
    Composing (a1, b1) then (a2, b2) gives (a2*a1, a2*b1 + b2); products of a <= 1 only
    shrink, so the scan is stable (they underflow to 0, which is the right limit).
    '''
    a, b = a.clone(), b.clone()
    b[0] += a[0] * h0
    shift = 1
    while shift < a.shape[0]:
        # right-hand sides are materialised before the slice is written, so these in-place
        # updates read only the previous pass; b first, since it needs the old a
        b[shift:] += a[shift:] * b[:-shift]
        a[shift:] *= a[:-shift].clone()
        shift *= 2
    return b


class HistoryPolicy(Policy):
    '''Hybrid history policy: one token per observation; layers alternate causal attention
    (KV cache over the episode) and a gated linear recurrence (conv + recurrent state); a
    multi-step head emits `chunk` actions every `chunk` steps, played out one per step.

    State: 'kv' append [capacity, n_attn, 2, heads, head_dim] (position-major), 'conv'
    [n_rec, conv_width-1, d], 'recurrent' [n_rec, d] (float32), 'chunk' [chunk, act_dim] and
    'cursor' [1] (kind chunk), 'rng'. Position is meta[META_POSITION]; the engine must refuse
    a step at position == capacity (CapacityExceeded) before calling step().

    Masked-out KV rows never reach the output as long as they are finite (a softmax weight of
    0 times a finite value), which is what lets a restore copy only the live prefix.
    '''

    kind = 'history'

    def __init__(self, obs_dim, act_dim, *, d_model=256, n_layers=4, heads=4, capacity=2048,
                 chunk=8, mlp_ratio=4, conv_width=4, dtype=torch.float32, noise_std=0.0,
                 seed=0):
        super().__init__(obs_dim, act_dim, capacity, noise_std, seed)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if d_model % heads or n_layers < 2 or capacity < 1 or chunk < 1 or conv_width < 2:
            raise InvalidConfig(
                f'history sizes: need d_model % heads == 0, n_layers >= 2, capacity, chunk >= 1,'
                f' conv_width >= 2; got d_model={d_model} heads={heads} n_layers={n_layers} '
                f'capacity={capacity} chunk={chunk} conv_width={conv_width}')
        self.d_model, self.n_layers, self.heads = d_model, n_layers, heads
        self.chunk, self.mlp_ratio, self.conv_width = chunk, mlp_ratio, conv_width
        self.dtype = dtype
        self.n_attn, self.n_rec = (n_layers + 1) // 2, n_layers // 2
        self.embed = nn.Linear(obs_dim, d_model)
        self.blocks = nn.ModuleList(
            _Block(d_model, heads, mlp_ratio, conv_width, attention=(i % 2 == 0))
            for i in range(n_layers))
        self.norm_f = nn.RMSNorm(d_model, eps=1e-6)
        self.head = nn.Linear(d_model, chunk * act_dim)
        # constant, not state: positions compared against meta's position for the mask
        self.register_buffer('positions', torch.arange(capacity), persistent=False)
        self.to(dtype)
        self.requires_grad_(False)
        self.eval()

    def config(self):
        return {**super().config(), 'd_model': self.d_model, 'n_layers': self.n_layers,
                'heads': self.heads, 'chunk': self.chunk, 'conv_width': self.conv_width,
                'dtype': str(self.dtype)}

    def state_specs(self):
        d, hd = self.d_model, self.d_model // self.heads
        return [
            BufferSpec('kv', (self.capacity, self.n_attn, 2, self.heads, hd), self.dtype, 'kv',
                       'append'),
            BufferSpec('conv', (self.n_rec, self.conv_width - 1, d), self.dtype, 'conv'),
            BufferSpec('recurrent', (self.n_rec, d), torch.float32, 'recurrent'),
            BufferSpec('chunk', (self.chunk, self.act_dim), torch.float32, 'chunk'),
            BufferSpec('cursor', (1,), torch.int64, 'chunk'),
            self._rng_spec(),
        ]

    # one token at meta's position; every shape static, position only ever read on device
    @torch.no_grad()
    def step(self, obs, action):
        pos = self.meta[META_POSITION:META_POSITION + 1]                    # [1] int64
        x = self.embed(obs.view(1, self.obs_dim).to(self.dtype))            # [1, d]
        kv, conv, rec = self.views['kv'], self.views['conv'], self.views['recurrent']
        for i, block in enumerate(self.blocks):
            h, m = block.norm1(x), block.mixer
            if i % 2 == 0:
                x = x + self._attend_one(m, h, kv[:, i // 2], pos)
            else:
                x = x + self._recur_one(m, h, conv[i // 2], rec[i // 2])
            x = x + block.mlp(block.norm2(x))
        self._emit(self.norm_f(x), 1)
        cursor, chunk = self.views['cursor'], self.views['chunk']
        action.copy_(chunk.index_select(0, cursor).view(self.act_dim))
        cursor.copy_(torch.remainder(cursor + 1, self.chunk))
        self.views['rng'][1:2].add_(1)
        pos.add_(1)

    def _attend_one(self, m, h, kv, pos):
        # kv [capacity, 2, H, D]: write this token's K, V at pos, attend over every slot
        # with the mask positions <= pos (static shapes; masked slots weigh exactly 0)
        qkv = m.wqkv(h).view(3, m.heads, m.head_dim)                         # [3, H, D]
        kv.index_copy_(0, pos, qkv[1:].unsqueeze(0))
        # two batched matmuls straight over the cache views (strided, no copies): one query
        # against C keys is a gemv, and fused SDPA kernels with a mask parallelise poorly
        # over a single query (fp32 fell to one block per head)
        k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)            # [H, C, D]
        scores = torch.matmul(k, qkv[0].unsqueeze(-1)).squeeze(-1).float()   # [H, C]
        scores = torch.where(self.positions <= pos, scores * m.head_dim ** -0.5, -math.inf)
        p = torch.softmax(scores, dim=-1).to(self.dtype)                     # [H, C]
        o = torch.matmul(p.unsqueeze(1), v)                                  # [H, 1, D]
        return m.wo(o.reshape(1, self.d_model))

    def _recur_one(self, m, h, conv, rec):
        # conv [W-1, d] holds the last W-1 conv inputs; rec [d] the recurrence (float32)
        u, g, z = m.in_proj(h).chunk(3, dim=-1)                              # [1, d] each
        window = torch.cat([conv, u])                                        # [W, d]
        conv.copy_(window[1:])
        y = F.silu((window * m.conv_w.t()).sum(0) + m.conv_b)                # [d]
        a = torch.sigmoid(g.view(-1) + m.a_bias).float()                     # [d]
        rec.copy_(a * rec + (1 - a) * y.float())
        return m.out_proj(rec.to(self.dtype).view(1, -1) * F.silu(z))

    def _emit(self, xf, n_steps, last=None):
        # at cursor 0 the head's chunk replaces the chunk buffer (torch.where: no branching).
        # For prefill (n_steps tokens), the last token that met cursor 0 is `last`
        cursor, chunk = self.views['cursor'], self.views['chunk']
        emit_at = n_steps - 1 - torch.remainder(cursor + (n_steps - 1), self.chunk)  # [1]
        emit = emit_at >= 0
        if last is None:
            row = xf
        else:
            row = last.index_select(0, emit_at.clamp(min=0))
        new = self.head(row).float().view(self.chunk, self.act_dim)
        if self.noise_std > 0:
            noise = self._noise(self.chunk * self.act_dim, emit_at.clamp(min=0))
            new = new + noise.view(self.chunk, self.act_dim)
        chunk.copy_(torch.where(emit, new, chunk))

    @torch.no_grad()
    def prefill(self, observations):
        '''Ingest observations [T, obs_dim] at the current position in one pass: batched
        attention writing KV rows [pos, pos+T), conv and recurrence by parallel scan, head
        and cursor as T steps would leave them (numerically close, not bit-equal). Reads the
        position to the host once: prefill runs between steps, never inside the step graph.
        '''
        T = observations.shape[0]
        if observations.dim() != 2 or observations.shape[1] != self.obs_dim:
            raise InvalidConfig(f'prefill needs [T, {self.obs_dim}] observations, '
                                f'got {tuple(observations.shape)}')
        pos = int(self.meta[META_POSITION])
        if pos + T > self.capacity:
            raise CapacityExceeded(f'prefill of {T} tokens at position {pos} exceeds the '
                                   f'history capacity {self.capacity}')
        if T == 0:
            return
        x = self.embed(observations.to(self.device, self.dtype))            # [T, d]
        kv, conv, rec = self.views['kv'], self.views['conv'], self.views['recurrent']
        for i, block in enumerate(self.blocks):
            h, m = block.norm1(x), block.mixer
            if i % 2 == 0:
                x = x + self._attend_many(m, h, kv[:, i // 2], pos)
            else:
                x = x + self._recur_many(m, h, conv[i // 2], rec[i // 2])
            x = x + block.mlp(block.norm2(x))
        xf = self.norm_f(x)
        self._emit(xf, T, last=xf)
        cursor = self.views['cursor']
        cursor.copy_(torch.remainder(cursor + T, self.chunk))
        self.views['rng'][1:2].add_(T)
        self.meta[META_POSITION:META_POSITION + 1].add_(T)

    def _attend_many(self, m, h, kv, pos):
        T = h.shape[0]
        qkv = m.wqkv(h).view(T, 3, m.heads, m.head_dim)                      # [T, 3, H, D]
        kv[pos:pos + T].copy_(qkv[:, 1:])
        q = qkv[:, 0].transpose(0, 1)[None]                                  # [1, H, T, D]
        k = kv[:pos + T, 0].transpose(0, 1)[None]                            # [1, H, S, D]
        v = kv[:pos + T, 1].transpose(0, 1)[None]
        if pos == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # query t sits at pos + t and sees keys 0..pos+t (SDPA's is_causal would align
            # the diagonal to key 0 instead)
            keys = torch.arange(pos + T, device=h.device)
            mask = keys.view(1, -1) <= (pos + torch.arange(T, device=h.device)).view(-1, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return m.wo(o[0].transpose(0, 1).reshape(T, self.d_model))

    def _recur_many(self, m, h, conv, rec):
        u, g, z = m.in_proj(h).chunk(3, dim=-1)                              # [T, d] each
        full = torch.cat([conv, u])                                          # [W-1+T, d]
        conv.copy_(full[-(self.conv_width - 1):])
        y = F.conv1d(full.t().unsqueeze(0), m.conv_w.unsqueeze(1), m.conv_b,
                     groups=self.d_model)                                    # [1, d, T]
        y = F.silu(y.squeeze(0).t())                                         # [T, d]
        a = torch.sigmoid(g + m.a_bias).float()                              # [T, d]
        hs = linear_scan(a, (1 - a) * y.float(), rec)                        # [T, d]
        rec.copy_(hs[-1])
        return m.out_proj(hs.to(self.dtype) * F.silu(z))


# ---------------------------------------------------------------- loading and construction

# rsl_rl ActorCriticRecurrent (and StudentTeacherRecurrent) checkpoint prefixes -> ours
_RSL_PREFIXES = (('memory_a.rnn.', 'rnn.'), ('memory_s.rnn.', 'rnn.'), ('actor.', 'actor.'),
                 ('student.', 'actor.'), ('actor_obs_normalizer._mean', 'norm_mean'),
                 ('actor_obs_normalizer._std', 'norm_std'), ('student_obs_normalizer._mean',
                 'norm_mean'), ('student_obs_normalizer._std', 'norm_std'),
                 ('normalizer._mean', 'norm_mean'), ('normalizer._std', 'norm_std'))


def _rename_rsl(state_dict):
    out = {}
    for key, value in state_dict.items():
        if key.startswith(('rnn.', 'encoder.', 'norm_mean', 'norm_std')):
            out[key] = value
            continue
        for old, new in _RSL_PREFIXES:
            if key.startswith(old):
                out[new + key[len(old):]] = value
                break
    return out


def _recurrent_sizes(state_dict):
    # infer layer sizes from weight shapes (a state_dict holds no activation names)
    w_ih, w_hh = state_dict['rnn.weight_ih_l0'], state_dict['rnn.weight_hh_l0']
    hidden = w_hh.shape[1]
    gates = w_ih.shape[0] // hidden
    if gates not in (3, 4):
        raise InvalidConfig(f'rnn.weight_ih_l0 {tuple(w_ih.shape)} is neither LSTM nor GRU')
    layers = 1 + max(int(k.rsplit('_l', 1)[1]) for k in state_dict if k.startswith('rnn.weight'))

    def linears(prefix):
        keys = sorted((int(k.split('.')[1]), k) for k in state_dict
                      if k.startswith(prefix) and k.endswith('.weight'))
        return [state_dict[k].shape for _, k in keys]

    actor = linears('actor.')
    encoder = linears('encoder.')
    return {'rnn_type': 'lstm' if gates == 4 else 'gru', 'rnn_hidden_dim': hidden,
            'rnn_num_layers': layers, 'encoder_dims': tuple(s[0] for s in encoder),
            'actor_hidden_dims': tuple(s[0] for s in actor[:-1]),
            'normalize': 'norm_mean' in state_dict}, actor[-1][0]


def _torchscript_activation(module):
    # the exporter's actor is a scripted Sequential; its children keep their Python names
    names = {child.original_name.lower() for child in module.children()} - {'linear'}
    if len(names) > 1:
        raise InvalidConfig(f'actor mixes activations {sorted(names)}; one is supported')
    name = names.pop() if names else 'identity'
    if name not in _ACTIVATIONS:
        raise InvalidConfig(f'actor activation {name!r} is not supported')
    return name


def recurrent_from_file(path, obs_dim, act_dim, **sizes):
    '''RecurrentPolicy from an rsl_rl / Isaac Lab policy.pt (TorchScript: 'actor', 'rnn',
    optional 'normalizer'), an rsl_rl checkpoint ({'model_state_dict': ...}) or a plain
    state_dict (.pt or .safetensors). Sizes come from the weights; `sizes` may add
    activation (state_dicts do not record it), noise_std, seed.'''
    activation, norm_eps = sizes.pop('activation', 'elu'), sizes.pop('norm_eps', 1e-2)
    try:
        with warnings.catch_warnings():
            # rsl_rl / Isaac Lab still export TorchScript; torch's deprecation notice is noise
            warnings.simplefilter('ignore', DeprecationWarning)
            scripted = torch.jit.load(path, map_location='cpu')
    except (RuntimeError, ValueError):
        scripted = None
    if scripted is not None:
        if not hasattr(scripted, 'rnn') or not hasattr(scripted, 'actor'):
            raise InvalidConfig(f'{path}: TorchScript policy has no recurrent actor '
                                "('rnn' and 'actor' submodules)")
        state_dict = scripted.state_dict()
        activation = _torchscript_activation(scripted.actor)
        if hasattr(scripted, 'normalizer') and hasattr(scripted.normalizer, 'eps'):
            norm_eps = float(scripted.normalizer.eps)
    elif str(path).endswith('.safetensors'):
        from safetensors.torch import load_file
        state_dict = load_file(path)
    else:
        state_dict = torch.load(path, map_location='cpu', weights_only=True)
        state_dict = state_dict.get('model_state_dict', state_dict)
    return recurrent_from_state_dict(state_dict, obs_dim, act_dim, activation=activation,
                                     norm_eps=norm_eps, **sizes)


def recurrent_from_state_dict(state_dict, obs_dim, act_dim, **sizes):
    state_dict = _rename_rsl(state_dict)
    if 'rnn.weight_ih_l0' not in state_dict:
        raise InvalidConfig('state_dict has no recurrent actor weights '
                            "('memory_a.rnn.*' or 'rnn.*')")
    inferred, file_act_dim = _recurrent_sizes(state_dict)
    rnn_in = state_dict['rnn.weight_ih_l0'].shape[1]
    file_obs_dim = state_dict['encoder.0.weight'].shape[1] if inferred['encoder_dims'] else rnn_in
    if (file_obs_dim, file_act_dim) != (obs_dim, act_dim):
        raise InvalidConfig(f'the weights take {file_obs_dim} observations and give '
                            f'{file_act_dim} actions; configured {obs_dim} and {act_dim}')
    policy = RecurrentPolicy(obs_dim, act_dim, **{**inferred, **sizes})
    ours = policy.state_dict()
    if 'norm_mean' in state_dict:
        # EmpiricalNormalization keeps [1, obs]; accept [obs] too
        state_dict['norm_mean'] = state_dict['norm_mean'].reshape(ours['norm_mean'].shape)
        state_dict['norm_std'] = state_dict['norm_std'].reshape(ours['norm_std'].shape)
    missing = sorted(set(ours) - set(state_dict))
    if missing:
        raise InvalidConfig(f'state_dict lacks {missing[:4]}')
    policy.load_state_dict({k: state_dict[k] for k in ours})
    return policy


def make_policy(kind, obs_dim, act_dim, *, file='', seed=0, device='cpu', **sizes):
    '''Build a policy: from `file` when given, else a seeded random initialisation (the
    global torch RNG is left untouched). Unknown sizes raise InvalidConfig.'''
    try:
        if kind == 'recurrent' and file:
            policy = recurrent_from_file(file, obs_dim, act_dim, seed=seed, **sizes)
        elif kind in ('recurrent', 'history'):
            cls = RecurrentPolicy if kind == 'recurrent' else HistoryPolicy
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                policy = cls(obs_dim, act_dim, seed=seed, **sizes)
            if file:
                policy.load_state_dict(_load_weights(file))
        else:
            raise InvalidConfig(f"unknown policy kind {kind!r}; 'recurrent' or 'history'")
    except TypeError as exc:
        raise InvalidConfig(f'{kind} policy: {exc}') from exc
    return policy.to(device)


def _load_weights(path):
    if str(path).endswith('.safetensors'):
        from safetensors.torch import load_file
        return load_file(path)
    state_dict = torch.load(path, map_location='cpu', weights_only=True)
    return state_dict.get('model_state_dict', state_dict)
