'''Pi0.5's and Pi0's denoising steps on a computation of our own (denoise_kernels 'fused',
opt-in). LeRobot's denoise_step is thousands of small kernels a chunk (README: 17 ms of graph on
the H200 even when torch.compile fuses it), and most of them are work that need not be done per
step, or not in so many pieces:

- The time conditioning (Pi0.5). Pi0.5's expert modulates every RMSNorm (AdaRMS: scale, shift
  and a residual gate) from the time step alone, through a float32 GEMV per norm (37 a step at
  the published depth). The steps' times are the same for every chunk (1, 1 - 1/n, ...), so
  each norm's modulation for each step is computed once, here, by LeRobot's own modules
  (embed_suffix's time MLP, each norm's dense layer) on the policy's device. Pi0's norms are
  plain Gemma RMSNorms: their (1 + weight) is computed once.
- The prefix cache. LeRobot concatenates the prefix's keys and values with the step's in every
  layer of every step; here they sit in one static buffer per layer, the prefix copied in once
  a chunk and each step writing its own rows after it (Pi0: the state token's and the 50
  actions'; Pi0.5: the actions').
- Attention. LeRobot's eager attention repeats the one key head for each of the 8 query heads
  and multiplies head by head; here the query heads that share a key head are rows of one
  matrix (the model has one key head: every head reads the same keys), so each side of the
  float32 softmax is one GEMM over that buffer.
- The projections. q, k and v are one GEMM over their concatenated weights, and so are the
  MLP's gate and up (weights copied once: about 400 MB at the published sizes).

Pi0's step embeds its suffix (the state token, the actions mixed with the time) by LeRobot's
own embed_suffix, and its attention keeps LeRobot's mask: the state token sees the prefix and
itself, the actions see everything.

The step (the suffix's embedding, 18 layers, the final norm, action_out_proj) is then compiled
by torch.compile as denoise_kernels 'compiled' compiles LeRobot's (inductor's deterministic
mode), and the chunk captured around it as ever. The arithmetic is LeRobot's, in its dtypes
(bfloat16 weights and residuals, float32 norm statistics and modulation, the float32
projections in and out): run eagerly on the CPU the actions are LeRobot's bit for bit (tested),
so compiled they are off LeRobot's by the compiler's rounding only: the tests bound it on
LeRobot's model at reduced sizes, the benchmark measures it at the published ones (a trained
checkpoint must be measured too: benchmarks/vla_pi0.py --denoise-kernels lerobot,fused).
Deterministic like the rest: the same inputs give the same bits, replay after replay and
process after process.
'''

import torch
import torch.nn.functional as F

from ..errors import InvalidConfig


class FusedPi05Expert:
    '''The denoising steps of a LeRobot PI05Pytorch (lerobot_policy.model) against a prefix
    cache, on the model's device (build it there: the conditioning is computed at once).
    FusedPi0Expert: PI0Pytorch's.'''

    adaptive = True     # AdaRMS norms conditioned on the time; else Gemma's RMSNorm
    state_token = 0     # suffix rows before the actions' (Pi0: the state's)

    def __init__(self, model, compile_step):
        cfg, expert = model.config, model.paligemma_with_expert.gemma_expert.model
        ecfg = expert.config
        attn = expert.layers[0].self_attn
        if bool(getattr(ecfg, 'use_adarms', False)) != self.adaptive or \
                ecfg.attention_bias or ecfg.hidden_activation != 'gelu_pytorch_tanh':
            raise InvalidConfig('denoise_kernels fused: not the action expert it knows ('
                                + ('AdaRMS' if self.adaptive else 'Gemma RMSNorm') +
                                ' norms, no attention bias, tanh GELU)')
        self.model = model
        self.heads, self.kv_heads = ecfg.num_attention_heads, ecfg.num_key_value_heads
        self.head_dim, self.eps, self.scaling = attn.head_dim, ecfg.rms_norm_eps, attn.scaling
        self.chunk, self.num_steps = int(cfg.chunk_size), int(cfg.num_inference_steps)
        self.suffix = self.state_token + self.chunk
        self.dtype = attn.q_proj.weight.dtype
        self.rotary = expert.rotary_emb
        self.action_in, self.action_out = model.action_in_proj, model.action_out_proj
        self.layers = [self._weights(layer) for layer in expert.layers]
        self.qkv_sizes = (self.heads * self.head_dim, self.kv_heads * self.head_dim,
                          self.kv_heads * self.head_dim)
        self.norms = [n for layer in expert.layers
                      for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.norms.append(expert.norm)
        self.conditions = self._conditions()
        self._step_fn = compile_step(self._step)
        self._keys = self._values = None

    @staticmethod
    def _weights(layer):
        attn, mlp = layer.self_attn, layer.mlp
        return {'qkv': torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                'o': attn.o_proj.weight,
                'gate_up': torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                'down': mlp.down_proj.weight}

    def _times(self):
        '''The steps' times as euler_integrate gives them to denoise_step.'''
        device, dt = self.action_in.weight.device, -1.0 / self.num_steps
        return [torch.tensor(1.0 + step * dt, dtype=torch.float32, device=device).expand(1)
                for step in range(self.num_steps)]

    @torch.no_grad()
    def _conditions(self):
        '''Each step's [norms, 3, width] float32 modulation (scale, shift, gate of every AdaRMS
        norm, the final one last), by LeRobot's modules at batch 1, as its denoise_step
        computes them from the time euler_integrate gives it.'''
        x = torch.zeros(1, self.chunk, self.action_in.in_features,
                        device=self.action_in.weight.device)
        return [torch.stack([n.dense(self.model.embed_suffix(x, time)[3]).view(3, -1)
                             for n in self.norms]) for time in self._times()]

    def _embed(self, x_t, cond, state):
        '''The step's suffix rows, in the layers' dtype (PiGemmaModel's cast).'''
        return self.action_in(x_t).to(self.dtype)

    def _norm(self, h, cond, i):
        '''Norm i of the expert with its condition: (normed h, its residual gate).'''
        scale, shift, gate = cond[i]
        var = torch.mean(torch.square(h.float()), dim=-1, keepdim=True)
        normed = h * torch.rsqrt(var + self.eps)
        return (normed * (1 + scale) + shift).to(h.dtype), gate.to(h.dtype)

    def _step(self, x_t, cond, state, cos, sin, keys, values, mask):
        '''One flow-matching step's velocity (LeRobot's denoise_step): keys / values are the
        [layers, 1, kv heads, prefix + suffix, head dim] buffers whose prefix part is filled;
        each layer writes its suffix rows.'''
        s, d, groups = self.suffix, self.head_dim, self.heads // self.kv_heads
        prefix = keys.shape[3] - s
        h = self._embed(x_t, cond, state)
        for i, w in enumerate(self.layers):
            y, gate = self._norm(h, cond, 2 * i)
            q, k, v = F.linear(y, w['qkv']).split(self.qkv_sizes, dim=-1)
            q = q.view(1, s, self.heads, d).transpose(1, 2)
            k = k.view(1, s, self.kv_heads, d).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            keys[i, :, :, prefix:] = k * cos + _rotate_half(k) * sin
            values[i, :, :, prefix:] = v.view(1, s, self.kv_heads, d).transpose(1, 2)
            # LeRobot's eager attention with the query heads of one key head as rows of one
            # ([1, kv heads, groups x s, d]): one GEMM each side of the softmax, all of the
            # GPU busy (scaled_dot_product_attention gave these 400 rows a handful of blocks:
            # 3 ms a chunk slower on the H100)
            scores = torch.matmul(q.reshape(1, self.kv_heads, groups * s, d),
                                  keys[i].transpose(2, 3)) * self.scaling + mask
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(weights, values[i])
            out = out.view(1, self.heads, s, d).transpose(1, 2).reshape(1, s, self.heads * d)
            h = _residual(h, F.linear(out, w['o']), gate)
            y, gate = self._norm(h, cond, 2 * i + 1)
            g, u = F.linear(y, w['gate_up']).chunk(2, dim=-1)
            h = _residual(h, F.linear(F.gelu(g, approximate='tanh') * u, w['down']), gate)
        h, _ = self._norm(h, cond, -1)
        return self.action_out(h[:, -self.chunk:].to(torch.float32))

    def sample(self, noise, prefix_k, prefix_v, prefix_pad, state=None):
        '''LeRobot's euler_integrate over the steps from noise [1, chunk, action dim] against
        the prefix cache ([layers, 1, kv heads, prefix, head dim] keys and values, its [1,
        prefix] pad mask; Pi0: and the padded state [1, state dim]): the chunk's actions.'''
        from lerobot.policies.common.vla_utils import make_att_2d_masks, \
            prepare_attention_masks_4d
        s, prefix = self.suffix, prefix_pad.shape[1]
        shape = (*prefix_k.shape[:3], prefix + s, prefix_k.shape[4])
        if self._keys is None or self._keys.shape != shape:
            self._keys = prefix_k.new_zeros(shape)
            self._values = prefix_v.new_zeros(shape)
        self._keys[:, :, :, :prefix].copy_(prefix_k)
        self._values[:, :, :, :prefix].copy_(prefix_v)
        # denoise_step's positions (after the prefix's valid tokens) and additive mask (every
        # valid prefix token; the suffix's own blocks: Pi0's state token does not see the
        # actions), its rows repeated for each query head of a key head (_step's rows)
        device = prefix_pad.device
        positions = prefix_pad.sum(dim=-1, keepdim=True) + torch.arange(s, device=device)
        cos, sin = self.rotary(self._keys.new_zeros(1, s, 1), positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        blocks = torch.zeros(1, s, dtype=torch.bool, device=device)
        blocks[:, :self.state_token + 1] = True
        suffix = make_att_2d_masks(torch.ones_like(blocks), blocks)
        mask = prepare_attention_masks_4d(torch.cat(
            [prefix_pad[:, None, :].expand(1, s, prefix), suffix], dim=2))
        # one row where every row sees the same (Pi0.5), broadcast over the rows
        mask = mask.repeat(1, 1, self.heads // self.kv_heads, 1) if self.state_token \
            else mask[:, :, :1]
        x_t, dt = noise, -1.0 / self.num_steps
        for cond in self.conditions:
            x_t = x_t + dt * self._step_fn(x_t, cond, state, cos, sin, self._keys,
                                           self._values, mask)
        return x_t


class FusedPi0Expert(FusedPi05Expert):
    '''Pi0's denoising steps (PI0Pytorch): the state token first in the suffix, the time mixed
    into the actions by LeRobot's embed_suffix at each step, Gemma's RMSNorm.'''

    adaptive, state_token = False, 1

    @torch.no_grad()
    def _conditions(self):
        self.scales = [1.0 + n.weight.float() for n in self.norms]   # as the norm computes it
        return self._times()

    def _embed(self, x_t, time, state):
        return self.model.embed_suffix(state, x_t, time)[0].to(self.dtype)

    def _norm(self, h, time, i):
        var = torch.mean(torch.square(h.float()), dim=-1, keepdim=True)
        return (h * torch.rsqrt(var + self.eps) * self.scales[i]).to(h.dtype), None


def _residual(h, out, gate):
    '''LeRobot's _gated_residual.'''
    return h + out if gate is None else h + out * gate


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
