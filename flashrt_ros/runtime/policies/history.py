'''HistoryPolicy: the hybrid history model (attention KV cache + gated linear recurrence +
multi-step action head), the paper's state set in policy form.'''

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..enums import Growth, PolicyKind
from ..errors import CapacityExceeded, InvalidConfig
from ..state import BufferSpec, META_POSITION
from .base import Policy

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


# The one attention kernel on CUDA: CUTLASS's memory-efficient kernel (xformers), called
# directly. It is bit-reproducible run to run (one thread block per query tile walks the keys in
# a fixed order: no split-K, no atomics). F.scaled_dot_product_attention would let the
# dispatcher choose, and on the H200 (torch 2.11) it chose cuDNN for the step, whose replays
# from one state differed in the last bits (issue 19); sdpa_kernel() would pin the choice only
# by flipping process-global flags that the node's other executor threads race on. Layout
# BMHK ([batch, tokens, heads, head_dim]), which the KV cache already is: no transposes.
MASK_NONE, MASK_CAUSAL_BOTTOM_RIGHT = 0, 2      # the op's custom_mask_type


def efficient_attention(q, k, v, bias=None, mask=MASK_NONE):
    '''Attention of q [1, T, H, D] over k, v [1, S, H, D] -> [1, T, H, D] by the memory-
    efficient CUDA kernel. bias: additive [1, H, T, S] (q's dtype; stride 0 over H is fine);
    mask MASK_CAUSAL_BOTTOM_RIGHT: query t sees keys [0, S - T + t] (a prefill at S - T).'''
    return torch.ops.aten._efficient_attention_forward(
        q, k, v, bias, None, None, None, None, 0.0, mask)[0]


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

    Masked-out KV rows never reach the output as long as they are finite (their scores get
    -inf added: a softmax weight of 0 times a finite value), which is what lets a restore copy
    only the live prefix.

    One token's step is hundreds of small kernels, each ~1-3 us even inside a CUDA graph, so
    step() keeps its op count low: the mask is built once per step, residual adds ride in the
    GEMMs, and dtype casts are left to ops that take mixed dtypes.
    '''

    kind = PolicyKind.HISTORY

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
        # 'efficient' (default): on CUDA the step attends by cuBLAS matmuls and prefill by
        # efficient_attention(), both reproducible; 'dispatcher': the kernel that
        # F.scaled_dot_product_attention picks (cuDNN on the H200: not reproducible), kept to
        # measure what the reproducible choice costs. The CPU always uses the dispatcher (its
        # kernels are reproducible for a fixed thread count: test_determinism.py).
        self.attention = 'efficient'
        self.n_attn, self.n_rec = (n_layers + 1) // 2, n_layers // 2
        self.embed = nn.Linear(obs_dim, d_model)
        self.blocks = nn.ModuleList(
            _Block(d_model, heads, mlp_ratio, conv_width, attention=(i % 2 == 0))
            for i in range(n_layers))
        self.norm_f = nn.RMSNorm(d_model, eps=1e-6)
        self.head = nn.Linear(d_model, chunk * act_dim)
        # constant, not state: positions compared against meta's position for the mask
        self.register_buffer('positions', torch.arange(capacity), persistent=False)
        # the mask bias's two values (visible, masked) in the model dtype (self.to below):
        # torch.where over these device scalars makes the bias in one op, in that dtype
        self.register_buffer('mask_values', torch.tensor([0.0, -math.inf]), persistent=False)
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
                       Growth.APPEND),
            BufferSpec('conv', (self.n_rec, self.conv_width - 1, d), self.dtype, 'conv'),
            BufferSpec('recurrent', (self.n_rec, d), torch.float32, 'recurrent'),
            BufferSpec('chunk', (self.chunk, self.act_dim), torch.float32, 'chunk'),
            BufferSpec('cursor', (1,), torch.int64, 'chunk'),
            self._rng_spec(),
        ]

    MIN_SPAN = 64       # below this a shorter attention saves less than a graph costs

    def spans(self):
        '''Powers of two from MIN_SPAN below the capacity, then the capacity: a step at
        position p attends over the smallest span > p, so its cost follows the position
        (within 2x) instead of the capacity.'''
        out, span = [], self.MIN_SPAN
        while span < self.capacity:
            out.append(span)
            span *= 2
        return out + [self.capacity]

    # one token at meta's position; every shape static, position only ever read on device
    @torch.no_grad()
    def step(self, obs, action, span=None):
        '''One step; `span` (from spans(), > the position): attend over rows [0, span)
        only. The engine picks it from the position; None means the whole capacity.'''
        span = self.capacity if span is None else span
        pos = self.meta[META_POSITION:META_POSITION + 1]                    # [1] int64
        x = self.embed(obs.view(1, self.obs_dim).to(self.dtype))            # [1, d]
        kv, conv, rec = self.views['kv'], self.views['conv'], self.views['recurrent']
        # the same for every attention layer, so built once: the mask positions <= pos as an
        # additive bias (0 / -inf) in the model dtype, [span, 1] against scores [H, span, 1]
        visible, masked = self.mask_values
        bias = torch.where(self.positions[:span] <= pos, visible, masked).view(span, 1)
        for i, block in enumerate(self.blocks):
            h, m = block.norm1(x), block.mixer
            if i % 2 == 0:
                x = self._attend_one(m, h, x, kv[:span, i // 2], pos, bias)
            else:
                x = self._recur_one(m, h, x, conv[i // 2], rec[i // 2])
            x = self._mlp(block, x)
        self._emit(self.norm_f(x), 1)
        cursor, chunk = self.views['cursor'], self.views['chunk']
        torch.index_select(chunk, 0, cursor, out=action.view(1, self.act_dim))
        self._advance(1)

    @staticmethod
    def _plus_linear(x, y, linear):
        # x + linear(y) (a bias-free Linear) as one GEMM with x as its addend; one row goes in
        # as a 1-D bias, which cuBLASLt adds in the GEMM's epilogue (no copy of x first)
        return torch.addmm(x[0] if x.shape[0] == 1 else x, y, linear.weight.t())

    def _mlp(self, block, x):
        up, act, down = block.mlp
        return self._plus_linear(x, act(up(block.norm2(x))), down)

    def _advance(self, n):
        # n tokens on: chunk cursor (mod chunk), rng counter and position, in one foreach add
        cursor = self.views['cursor']
        torch._foreach_add_([cursor, self.views['rng'][1:2],
                             self.meta[META_POSITION:META_POSITION + 1]], n)
        cursor.remainder_(self.chunk)

    def _attend_one(self, m, h, x, kv, pos, bias):
        # kv [span, 2, H, D]: write this token's K, V at pos (< span), attend over every slot
        # with the mask bias (static shapes; masked slots weigh exactly 0); returns x + output
        qkv = m.wqkv(h).view(3, m.heads, m.head_dim)                         # [3, H, D]
        kv.index_copy_(0, pos, qkv[1:].unsqueeze(0))
        k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)            # [H, C, D]
        if self.dtype in (torch.bfloat16, torch.float16) and not self._efficient(h):
            # the dispatcher's fused kernel (CPU, or attention='dispatcher')
            o = F.scaled_dot_product_attention(
                qkv[0].view(1, m.heads, 1, m.head_dim), k[None], v[None],
                attn_mask=bias.view(1, 1, 1, -1))
            return self._plus_linear(x, o.view(1, self.d_model), m.wo)
        # CUDA (every dtype) and float32 on the CPU: two batched matmuls straight over the
        # cache views (strided, no copies); cuBLAS on one stream is reproducible run to run.
        # One query against C keys is a gemv: the fused kernels parallelise it poorly (the
        # memory-efficient kernel, reproducible, runs one block per head: 2.9 ms a bf16 step
        # at 2k keys and 9 ms at 16k on the H200, against ~1 ms here; cuDNN's is fast but not
        # reproducible). The first also applies the scale and adds the mask bias (on CUDA a
        # copy of the bias into its output, then the GEMM); softmax accumulates in float32.
        scores = torch.baddbmm(bias, k, qkv[0].unsqueeze(-1), alpha=m.head_dim ** -0.5)
        p = torch.softmax(scores.view(m.heads, -1), dim=-1)                  # [H, C]
        o = torch.bmm(p.unsqueeze(1), v)                                     # [H, 1, D]
        return self._plus_linear(x, o.view(1, self.d_model), m.wo)

    def _efficient(self, t):
        return t.is_cuda and self.attention == 'efficient'

    def _recur_one(self, m, h, x, conv, rec):
        # conv [W-1, d] holds the last W-1 conv inputs; rec [d] the recurrence (float32);
        # returns x + output
        u, g, z = m.in_proj(h).view(3, -1)                                   # [d] each
        window = torch.cat([conv, u.view(1, -1)])                           # [W, d]
        conv.copy_(window[1:])
        # the depthwise conv, conv_b[c] + conv_w[c] . window[:, c], as d batched 1 x W x 1
        # products over strided views: one batched GEMM (on CUDA after a copy of conv_b)
        y = F.silu(torch.baddbmm(m.conv_b.view(-1, 1, 1), m.conv_w.unsqueeze(1),
                                 window.t().unsqueeze(-1)).view(-1))         # [d]
        a = torch.sigmoid(g + m.a_bias)                                      # [d]
        # a*rec + (1-a)*y, as y + a*(rec - y): float32 (rec's dtype) by type promotion
        torch.addcmul(y, a, rec - y, out=rec)
        # rec * silu(z) computed in float32 and rounded once into the model dtype
        gated = torch.mul(rec, F.silu(z), out=torch.empty_like(z))
        return self._plus_linear(x, gated.view(1, -1), m.out_proj)

    def _emit(self, xf, n_steps, last=None):
        # at cursor 0 the head's chunk replaces the chunk buffer (torch.where: no branching).
        # For prefill (n_steps tokens), the last token that met cursor 0 is `last`; a step
        # (last None, n_steps 1) emits at cursor 0 from xf, its noise at the counter itself
        cursor, chunk = self.views['cursor'], self.views['chunk']
        if last is None:
            emit, offset, row = cursor == 0, None, xf
        else:
            emit_at = n_steps - 1 - torch.remainder(cursor + (n_steps - 1), self.chunk)  # [1]
            emit, offset = emit_at >= 0, emit_at.clamp(min=0)
            row = last.index_select(0, offset)
        new = self.head(row).view(self.chunk, self.act_dim)        # model dtype; where promotes
        if self.noise_std > 0:
            noise = self._noise(self.chunk * self.act_dim, offset)
            new = new + noise.view(self.chunk, self.act_dim)
        torch.where(emit, new, chunk, out=chunk)

    @torch.no_grad()
    def prefill(self, observations, position=None):
        '''Ingest observations [T, obs_dim] at the current position in one pass: batched
        attention writing KV rows [pos, pos+T), conv and recurrence by parallel scan, head
        and cursor as T steps would leave them (numerically close, not bit-equal).
        `position`: the position when the caller knows it (the engine's host mirror), else
        it is read from the device once; given, prefill has no host sync and can be captured.
        '''
        T = observations.shape[0]
        if observations.dim() != 2 or observations.shape[1] != self.obs_dim:
            raise InvalidConfig(f'prefill needs [T, {self.obs_dim}] observations, '
                                f'got {tuple(observations.shape)}')
        pos = int(self.meta[META_POSITION]) if position is None else int(position)
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
                x = self._attend_many(m, h, x, kv[:, i // 2], pos)
            else:
                x = self._recur_many(m, h, x, conv[i // 2], rec[i // 2])
            x = self._mlp(block, x)
        xf = self.norm_f(x)
        self._emit(xf, T, last=xf)
        self._advance(T)

    def _attend_many(self, m, h, x, kv, pos):
        T = h.shape[0]
        qkv = m.wqkv(h).view(T, 3, m.heads, m.head_dim)                      # [T, 3, H, D]
        kv[pos:pos + T].copy_(qkv[:, 1:])
        if self._efficient(h):
            # bottom-right causal: query t (at pos + t) sees keys 0..pos+t, no mask tensor
            o = efficient_attention(qkv[None, :, 0], kv[None, :pos + T, 0],
                                    kv[None, :pos + T, 1], mask=MASK_CAUSAL_BOTTOM_RIGHT)
            return self._plus_linear(x, o.view(T, self.d_model), m.wo)
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
        return self._plus_linear(x, o[0].transpose(0, 1).reshape(T, self.d_model), m.wo)

    def _recur_many(self, m, h, x, conv, rec):
        u, g, z = m.in_proj(h).chunk(3, dim=-1)                              # [T, d] each
        full = torch.cat([conv, u])                                          # [W-1+T, d]
        conv.copy_(full[-(self.conv_width - 1):])
        y = F.conv1d(full.t().unsqueeze(0), m.conv_w.unsqueeze(1), m.conv_b,
                     groups=self.d_model)                                    # [1, d, T]
        y = F.silu(y.squeeze(0).t())                                         # [T, d]
        a = torch.sigmoid(g + m.a_bias).float()                              # [T, d]
        hs = linear_scan(a, (1 - a) * y.float(), rec)                        # [T, d]
        rec.copy_(hs[-1])
        return self._plus_linear(x, hs.to(self.dtype) * F.silu(z), m.out_proj)
