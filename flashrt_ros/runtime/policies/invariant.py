'''Batch-invariant kernels: every row of a batch computed exactly as if it ran alone.

The default kernels (cuBLAS, cuDNN, MKL) choose their algorithm by the batch size: a row of a
512-row product rounds differently from the same row alone (measured on the H200 and on this
CPU: up to ~1e-6 per layer). With kernels='batch_invariant' a policy's linear layers, RNN cells
and pointwise functions use kernels whose arithmetic for one row does not depend on how many
rows run with it, so a fleet steps as one batch and stays bit for bit a single-session engine
with the same kernels (the idea of thinking-machines-lab/batch_invariant_ops and vLLM's
batch-invariant mode). They round differently from the default kernels (float rounding: the
tests bound it), so the kernel set is part of the model digest: a capsule replays bit for bit
only under the kernels it was taken with.

CUDA: one Triton matmul per layer, its tile sizes fixed by the layer's shape, never by the row
count, with the activation fused into it, and one Triton kernel per LSTM layer (the four gates,
their activations and the new h and c); each row's dot products run in one fixed order, and
pointwise torch kernels apply one function per element. CPU: a batched matrix product of 1-row
matrices (one small GEMM per row, the same for every batch size: each row's input and output
64-byte aligned as a row alone is; one row runs as a batch of two, as ATen takes a batch of one
for a plain product) and the pointwise functions over a
strided view, which makes ATen take its scalar loop for every element (its vector loop handles
the tail of a tensor, and each thread's chunk, with other math: measured here, ELU's differ in
the last bit). verify() checks a policy's rows against rows run alone on the machine at hand;
the engine calls it before it trusts a batch.
'''

import torch
import torch.nn as nn

from ..errors import InvalidConfig

KERNELS = ('default', 'batch_invariant')

try:                    # CUDA builds of torch bring Triton; the CPU path needs none
    import triton
    import triton.language as tl
except (ImportError, AttributeError, RuntimeError):   # absent, or a build that fails to load
    triton = None


def check_kernels(name):
    if name not in KERNELS:
        raise InvalidConfig(f'kernels must be one of {KERNELS}, got {name!r}')
    return name


def pointwise(fn, x):
    '''fn(x) for a pointwise torch function, each element computed the same way wherever it
    sits in the batch. CUDA's pointwise kernels apply one function per element already; on
    the CPU the input is laid out with a stride of 2, so ATen's scalar loop computes every
    element (the vector loop, with other rounding for transcendental functions, needs unit
    strides).'''
    if x.is_cuda:
        return fn(x)
    wide = x.new_empty(*x.shape, 2)
    wide[..., 0].copy_(x)
    return fn(wide[..., 0])


# activation module type -> the code of the Triton epilogue (anything else runs as pointwise)
_FUSED = {nn.Identity: 0, nn.ReLU: 1, nn.ELU: 2, nn.Tanh: 3, nn.Sigmoid: 4}


def _fused_code(activation):
    if activation is None:
        return 0
    code = _FUSED.get(type(activation))
    if code == 2 and float(activation.alpha) != 1.0:
        return None
    return code


def linear(x, layer, activation=None):
    '''activation(layer(x)) for x [rows, in], each row independent of the others.'''
    if x.is_cuda:
        x = x.contiguous()
        code = _fused_code(activation)
        y = _triton_linear(x, layer.weight, layer.bias, 0 if code is None else code)
        return y if code is not None else pointwise(activation, y)
    rows, weight = x.shape[0], layer.weight
    (n, k), batch = weight.shape, max(rows, 2)  # ATen runs a batch of one as a plain product
    bias = layer.bias if layer.bias is not None else weight.new_zeros(n)
    # Every row's input and output start on a 64-byte boundary, as a row alone does: MKL's
    # AVX-512 kernels treat a vector's tail by its alignment (measured: a 250 -> 130 layer's
    # last column differed in the last bit for odd rows of a packed batch)
    padded = x.new_zeros(batch, _aligned(k))
    padded[:rows, :k] = x
    padded[rows:, :k] = x[0]
    y = x.new_empty(batch, 1, _aligned(n))[:, :, :n]
    torch.baddbmm(bias.view(1, 1, -1).expand(batch, 1, -1), padded[:, :k].unsqueeze(1),
                  weight.t().unsqueeze(0).expand(batch, -1, -1), out=y)
    y = y.squeeze(1)[:rows]
    return y if activation is None or isinstance(activation, nn.Identity) \
        else pointwise(activation, y)


def _aligned(columns):
    """columns rounded up to a multiple of 16 float32s (64 bytes)."""
    return -(-columns // 16) * 16


def sequential(layers, x):
    '''An rsl_rl MLP (Linear, activation, Linear, ..., nn.Sequential) over x [rows, in].'''
    mods, i = list(layers), 0
    while i < len(mods):
        act = mods[i + 1] if i + 1 < len(mods) and not isinstance(mods[i + 1], nn.Linear) \
            else None
        x = linear(x, mods[i], act)
        i += 2 if act is not None else 1
    return x


def rnn_step(rnn, x, hidden, cell=None):
    '''One time step of an nn.LSTM / nn.GRU (PyTorch's gate equations) for x [rows, in],
    hidden / cell [rows, layers, hidden] (updated in place); returns the top layer's output.'''
    for layer in range(rnn.num_layers):
        w_ih, w_hh = (getattr(rnn, f'{w}_l{layer}') for w in ('weight_ih', 'weight_hh'))
        b_ih, b_hh = (getattr(rnn, f'{b}_l{layer}', None) for b in ('bias_ih', 'bias_hh'))
        h = hidden[:, layer]
        if cell is not None and x.is_cuda:     # one Triton kernel for the whole LSTM cell
            x, c = _triton_lstm(x.contiguous(), h, cell[:, layer], w_ih, w_hh, b_ih, b_hh)
            cell[:, layer].copy_(c)
            hidden[:, layer].copy_(x)
            continue
        gi, gh = linear(x, _Linear(w_ih, b_ih)), linear(h, _Linear(w_hh, b_hh))
        if cell is None:        # GRU: r, z, n
            r = pointwise(torch.sigmoid, gi[:, :rnn.hidden_size] + gh[:, :rnn.hidden_size])
            z = pointwise(torch.sigmoid, gi[:, rnn.hidden_size:2 * rnn.hidden_size] +
                          gh[:, rnn.hidden_size:2 * rnn.hidden_size])
            n = pointwise(torch.tanh, gi[:, 2 * rnn.hidden_size:] +
                          r * gh[:, 2 * rnn.hidden_size:])
            x = (1 - z) * n + z * h
        else:                   # LSTM: i, f, g, o
            i, f, g, o = (gi + gh).chunk(4, 1)
            c = pointwise(torch.sigmoid, f) * cell[:, layer] + \
                pointwise(torch.sigmoid, i) * pointwise(torch.tanh, g)
            x = pointwise(torch.sigmoid, o) * pointwise(torch.tanh, c)
            cell[:, layer].copy_(c)
        hidden[:, layer].copy_(x)
    return x


class _Linear:
    '''weight and bias in nn.Linear's shape, for linear().'''

    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias


# ---------------------------------------------------------------- CUDA: Triton

if triton is not None:
    @triton.jit(do_not_specialize=['rows'])
    def _linear_kernel(x, w, b, y, rows, cols, depth, HAS_BIAS: tl.constexpr,
                       ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr):
        # one [BM, BN] tile of y = act(x @ w.T + b); the k loop and the tile sizes are the
        # same for every row count, so a row's sums run in the same order in any batch
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, depth, BK):
            rk = k + tl.arange(0, BK)
            a = tl.load(x + rm[:, None] * depth + rk[None, :],
                        mask=(rm[:, None] < rows) & (rk[None, :] < depth), other=0.0)
            bt = tl.load(w + rn[None, :] * depth + rk[:, None],
                         mask=(rn[None, :] < cols) & (rk[:, None] < depth), other=0.0)
            acc += tl.dot(a, bt, input_precision='ieee')
        if HAS_BIAS:
            acc += tl.load(b + rn, mask=rn < cols, other=0.0)[None, :]
        if ACT == 1:
            acc = tl.maximum(acc, 0.0)
        elif ACT == 2:
            acc = tl.where(acc > 0, acc, tl.exp(acc) - 1.0)
        elif ACT == 3:
            acc = _tanh(acc)
        elif ACT == 4:
            acc = _sigmoid(acc)
        tl.store(y + rm[:, None] * cols + rn[None, :], acc,
                 mask=(rm[:, None] < rows) & (rn[None, :] < cols))

    @triton.jit
    def _sigmoid(v):
        return 1.0 / (1.0 + tl.exp(-v))

    @triton.jit
    def _tanh(v):
        return 2.0 * _sigmoid(2.0 * v) - 1.0

    @triton.jit
    def _gate(x, h, w_ih, w_hh, b_ih, b_hh, rm, rj, rows, depth, hidden, h_stride, q,
              HAS_BIAS: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
        # gate q's pre-activation for rows rm, units rj: x @ w_ih[q].T, then h @ w_hh[q].T
        # (k in BK steps from 0), then b_ih[q] and b_hh[q]: PyTorch's order of terms
        acc = tl.zeros((BM, BH), tl.float32)
        for k in range(0, depth, BK):
            rk = k + tl.arange(0, BK)
            a = tl.load(x + rm[:, None] * depth + rk[None, :],
                        mask=(rm[:, None] < rows) & (rk[None, :] < depth), other=0.0)
            bt = tl.load(w_ih + (q * hidden + rj[None, :]) * depth + rk[:, None],
                         mask=(rj[None, :] < hidden) & (rk[:, None] < depth), other=0.0)
            acc += tl.dot(a, bt, input_precision='ieee')
        for k in range(0, hidden, BK):
            rk = k + tl.arange(0, BK)
            a = tl.load(h + rm[:, None] * h_stride + rk[None, :],
                        mask=(rm[:, None] < rows) & (rk[None, :] < hidden), other=0.0)
            bt = tl.load(w_hh + (q * hidden + rj[None, :]) * hidden + rk[:, None],
                         mask=(rj[None, :] < hidden) & (rk[:, None] < hidden), other=0.0)
            acc += tl.dot(a, bt, input_precision='ieee')
        if HAS_BIAS:
            acc += tl.load(b_ih + q * hidden + rj, mask=rj < hidden, other=0.0)[None, :]
            acc += tl.load(b_hh + q * hidden + rj, mask=rj < hidden, other=0.0)[None, :]
        return acc

    @triton.jit(do_not_specialize=['rows'])
    def _lstm_kernel(x, h, c, w_ih, w_hh, b_ih, b_hh, h_out, c_out, rows, depth, hidden,
                     h_stride, c_stride, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
                     BH: tl.constexpr, BK: tl.constexpr):
        # PyTorch's LSTM cell (gates i, f, g, o) for rows [BM] x hidden units [BH], one kernel
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rj = tl.program_id(1) * BH + tl.arange(0, BH)
        i = _sigmoid(_gate(x, h, w_ih, w_hh, b_ih, b_hh, rm, rj, rows, depth, hidden,
                           h_stride, 0, HAS_BIAS, BM, BH, BK))
        f = _sigmoid(_gate(x, h, w_ih, w_hh, b_ih, b_hh, rm, rj, rows, depth, hidden,
                           h_stride, 1, HAS_BIAS, BM, BH, BK))
        g = _tanh(_gate(x, h, w_ih, w_hh, b_ih, b_hh, rm, rj, rows, depth, hidden,
                        h_stride, 2, HAS_BIAS, BM, BH, BK))
        o = _sigmoid(_gate(x, h, w_ih, w_hh, b_ih, b_hh, rm, rj, rows, depth, hidden,
                           h_stride, 3, HAS_BIAS, BM, BH, BK))
        mask = (rm[:, None] < rows) & (rj[None, :] < hidden)
        c_new = f * tl.load(c + rm[:, None] * c_stride + rj[None, :], mask=mask, other=0.0) \
            + i * g
        tl.store(c_out + rm[:, None] * hidden + rj[None, :], c_new, mask=mask)
        tl.store(h_out + rm[:, None] * hidden + rj[None, :], o * _tanh(c_new), mask=mask)


def _triton_lstm(x, h, c, w_ih, w_hh, b_ih, b_hh):
    '''(h', c') [rows, hidden] of one LSTM layer: x [rows, in] contiguous, h and c [rows,
    hidden] views with unit column stride (rows of the arena's [sessions, layers, hidden]).'''
    _need_triton(w_ih)
    rows, depth = x.shape
    hidden = w_hh.shape[1]
    h_out, c_out = (torch.empty(rows, hidden, dtype=x.dtype, device=x.device) for _ in 'hc')
    bm, bh, bk = LSTM_TILES
    grid = (triton.cdiv(rows, bm), triton.cdiv(hidden, bh))
    bias = b_ih is not None
    _lstm_kernel[grid](x, h, c, w_ih, w_hh, b_ih if bias else w_ih, b_hh if bias else w_hh,
                       h_out, c_out, rows, depth, hidden, h.stride(0), c.stride(0),
                       HAS_BIAS=bias, BM=bm, BH=bh, BK=bk)
    return h_out, c_out


def _tiles(cols, depth):
    """Tile sizes (rows, columns, k step) from the layer's shape only, never the row count.
    Chosen on the H200 (benchmarks/kernel_tiles.py, 2026-12-01: 18 configurations, the MLP
    47-512-256-128-12 step at N = 1 / 512 / 4,096): 32 x 32 x 32 gave 48 / 53 / 258 us against
    43 / 71 / 464 us for 16 x 32 x 64; 16 is tl.dot's smallest tile."""
    return 32, (32 if cols >= 32 else 16), 32


# rows, hidden units, k step of _lstm_kernel; the same sweep, G1-size LSTM 64 step:
# 19 / 21 / 68 us at N = 1 / 512 / 4,096 (cuDNN, default kernels: 22 / 74 / 307 us)
LSTM_TILES = (16, 16, 16)


def _need_triton(weight):
    if triton is None:
        raise InvalidConfig("kernels 'batch_invariant' on CUDA needs Triton (it comes with "
                            'CUDA builds of torch); install triton or use the default kernels')
    if weight.dtype != torch.float32:
        raise InvalidConfig(f"kernels 'batch_invariant' run float32 weights, not {weight.dtype}")


def _triton_linear(x, weight, bias, act):
    _need_triton(weight)
    rows, depth = x.shape
    cols = weight.shape[0]
    y = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    bm, bn, bk = _tiles(cols, depth)
    grid = (triton.cdiv(rows, bm), triton.cdiv(cols, bn))
    _linear_kernel[grid](x, weight.contiguous(), bias if bias is not None else weight, y, rows,
                         cols, depth, HAS_BIAS=bias is not None, ACT=act, BM=bm, BN=bn, BK=bk)
    return y


# ---------------------------------------------------------------- verification

@torch.no_grad()
def verify(policy, sessions, device, rows=4, seed=0):
    '''Raise InvalidConfig unless policy.step over `sessions` rows (random state and inputs)
    gives, for `rows` sampled rows, exactly what each gives stepped alone: the check of this
    machine's libraries before a fleet is stepped as one batch (kernel choice depends on
    shapes, not values, so random inputs that agree mean the same arithmetic).'''
    gen = torch.Generator().manual_seed(seed)

    def views(n):
        out = {s.name: (torch.randn((n, *s.shape), generator=gen) * 0.5).to(s.dtype)
               if s.dtype.is_floating_point else torch.zeros((n, *s.shape), dtype=s.dtype)
               for s in policy.state_specs()}
        out['meta'] = torch.zeros(n, 4, dtype=torch.int64)
        return {k: v.to(device) for k, v in out.items()}

    batch = views(sessions)
    start = {k: v.clone() for k, v in batch.items()}
    obs = (torch.randn(sessions, policy.obs_dim, generator=gen)).to(device)
    act = torch.zeros(sessions, policy.act_dim, device=device)
    policy.bind(batch, sessions)
    policy.step(obs, act)
    picks = torch.randperm(sessions, generator=gen)[:rows].tolist()
    for i in picks:
        alone = {k: v[i].clone() for k, v in start.items()}
        out = torch.zeros(policy.act_dim, device=device)
        policy.bind(alone)
        policy.step(obs[i].clone(), out)
        same = torch.equal(out, act[i]) and \
            all(torch.equal(alone[k], batch[k][i]) for k in alone if k != 'meta')
        if not same:
            raise InvalidConfig(
                f"kernels 'batch_invariant': on {device} row {i} of a {sessions}-row batch "
                f'differs from the same row alone (max |diff| '
                f'{float((out - act[i]).abs().max()):.3g}); this machine\'s libraries do not '
                'keep rows independent here: use the default kernels (sessions then step '
                'one by one, bit for bit)')
