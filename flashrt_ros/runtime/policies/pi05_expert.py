'''Pi0.5's denoising steps on a computation of our own (denoise_kernels 'fused', opt-in; Pi0.5
only). LeRobot's denoise_step is thousands of small kernels a chunk (README: 17 ms of graph on
the H200 even when torch.compile fuses it), and most of them are work that need not be done per
step, or not in so many pieces:

- The time conditioning. Pi0.5's expert modulates every RMSNorm (AdaRMS: scale, shift and a
  residual gate) from the time step alone, through a float32 GEMV per norm (37 a step at the
  published depth). The steps' times are the same for every chunk (1, 1 - 1/n, ...), so each
  norm's modulation for each step is computed once, here, by LeRobot's own modules
  (embed_suffix's time MLP, each norm's dense layer) on the policy's device.
- The prefix cache. LeRobot concatenates the prefix's keys and values with the step's in every
  layer of every step; here they sit in one static buffer per layer, the prefix copied in once
  a chunk and each step writing its own 50 rows after it.
- Attention. LeRobot's eager attention repeats the one key head for each of the 8 query heads
  and multiplies head by head; here the query heads that share a key head are rows of one
  matrix (the model has one key head: every head reads the same keys), so each side of the
  float32 softmax is one GEMM over that buffer.
- The projections. q, k and v are one GEMM over their concatenated weights, and so are the
  MLP's gate and up (weights copied once: about 400 MB at the published sizes).

The step (action_in_proj, 18 layers, the final norm, action_out_proj) is then compiled by
torch.compile as denoise_kernels 'compiled' compiles LeRobot's (inductor's deterministic mode),
and the chunk captured around it as ever. The arithmetic is LeRobot's, in its dtypes (bfloat16
weights and residuals, float32 norm statistics and modulation, the float32 projections in and
out), and the actions are off LeRobot's by rounding only: the tests bound it on LeRobot's model
at reduced sizes, the benchmark measures it at the published ones (a trained checkpoint must be
measured too: benchmarks/vla_pi0.py --denoise-kernels lerobot,fused). Deterministic like the
rest: the same inputs give the same bits, replay after replay and process after process.
'''

import torch
import torch.nn.functional as F

from ..errors import InvalidConfig


class FusedPi05Expert:
    '''The denoising steps of a LeRobot PI05Pytorch (lerobot_policy.model) against a prefix
    cache, on the model's device (build it there: the conditioning is computed at once).'''

    def __init__(self, model, compile_step):
        cfg, expert = model.config, model.paligemma_with_expert.gemma_expert.model
        ecfg = expert.config
        attn = expert.layers[0].self_attn
        if not getattr(ecfg, 'use_adarms', False) or ecfg.attention_bias or \
                ecfg.hidden_activation != 'gelu_pytorch_tanh':
            raise InvalidConfig('denoise_kernels fused: not the Pi0.5 action expert it knows '
                                '(AdaRMS norms, no attention bias, tanh GELU)')
        self.heads, self.kv_heads = ecfg.num_attention_heads, ecfg.num_key_value_heads
        self.head_dim, self.eps, self.scaling = attn.head_dim, ecfg.rms_norm_eps, attn.scaling
        self.chunk, self.num_steps = int(cfg.chunk_size), int(cfg.num_inference_steps)
        self.dtype = attn.q_proj.weight.dtype
        self.rotary = expert.rotary_emb
        self.action_in, self.action_out = model.action_in_proj, model.action_out_proj
        self.layers = [self._weights(layer) for layer in expert.layers]
        self.qkv_sizes = (self.heads * self.head_dim, self.kv_heads * self.head_dim,
                          self.kv_heads * self.head_dim)
        self.modulation = self._modulation(model, expert)
        self._step_fn = compile_step(self._step)
        self._keys = self._values = None

    @staticmethod
    def _weights(layer):
        attn, mlp = layer.self_attn, layer.mlp
        return {'qkv': torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                'o': attn.o_proj.weight,
                'gate_up': torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                'down': mlp.down_proj.weight}

    @torch.no_grad()
    def _modulation(self, model, expert):
        '''Each step's [norms, 3, width] float32 modulation (scale, shift, gate of every AdaRMS
        norm, the final one last), by LeRobot's modules at batch 1, as its denoise_step
        computes them from the time euler_integrate gives it.'''
        norms = [n for layer in expert.layers
                 for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        norms.append(expert.norm)
        device = self.action_in.weight.device
        x = torch.zeros(1, self.chunk, self.action_in.in_features, device=device)
        dt, out = -1.0 / self.num_steps, []
        for step in range(self.num_steps):
            time = torch.tensor(1.0 + step * dt, dtype=torch.float32, device=device).expand(1)
            cond = model.embed_suffix(x, time)[3]
            out.append(torch.stack([n.dense(cond).view(3, -1) for n in norms]))
        return out

    def _norm(self, h, mod):
        '''PiGemmaRMSNorm with its condition: (normed h, its residual gate).'''
        scale, shift, gate = mod
        var = torch.mean(torch.square(h.float()), dim=-1, keepdim=True)
        normed = h * torch.rsqrt(var + self.eps)
        return (normed * (1 + scale) + shift).to(h.dtype), gate.to(h.dtype)

    def _step(self, x_t, mods, cos, sin, keys, values, mask):
        '''One flow-matching step's velocity (LeRobot's denoise_step): keys / values are the
        [layers, 1, kv heads, prefix + chunk, head dim] buffers whose prefix part is filled;
        each layer writes its chunk rows.'''
        c, d, groups = self.chunk, self.head_dim, self.heads // self.kv_heads
        prefix = keys.shape[3] - c
        h = self.action_in(x_t).to(self.dtype)
        for i, w in enumerate(self.layers):
            y, gate = self._norm(h, mods[2 * i])
            q, k, v = F.linear(y, w['qkv']).split(self.qkv_sizes, dim=-1)
            q = q.view(1, c, self.heads, d).transpose(1, 2)
            k = k.view(1, c, self.kv_heads, d).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            keys[i, :, :, prefix:] = k * cos + _rotate_half(k) * sin
            values[i, :, :, prefix:] = v.view(1, c, self.kv_heads, d).transpose(1, 2)
            # LeRobot's eager attention with the query heads of one key head as rows of one
            # ([1, kv heads, groups x c, d]): one GEMM each side of the softmax, all of the
            # GPU busy (scaled_dot_product_attention gave these 400 rows a handful of blocks:
            # 3 ms a chunk slower on the H100)
            scores = torch.matmul(q.reshape(1, self.kv_heads, groups * c, d),
                                  keys[i].transpose(2, 3)) * self.scaling + mask
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(weights, values[i])
            out = out.view(1, self.heads, c, d).transpose(1, 2).reshape(1, c, self.heads * d)
            h = h + F.linear(out, w['o']) * gate
            y, gate = self._norm(h, mods[2 * i + 1])
            g, u = F.linear(y, w['gate_up']).chunk(2, dim=-1)
            h = h + F.linear(F.gelu(g, approximate='tanh') * u, w['down']) * gate
        h, _ = self._norm(h, mods[-1])
        return self.action_out(h[:, -c:].to(torch.float32))

    def sample(self, noise, prefix_k, prefix_v, prefix_pad):
        '''LeRobot's euler_integrate over the steps from noise [1, chunk, action dim] against
        the prefix cache ([layers, 1, kv heads, prefix, head dim] keys and values, its [1,
        prefix] pad mask): the chunk's actions.'''
        c, prefix = self.chunk, prefix_pad.shape[1]
        shape = (*prefix_k.shape[:3], prefix + c, prefix_k.shape[4])
        if self._keys is None or self._keys.shape != shape:
            self._keys = prefix_k.new_zeros(shape)
            self._values = prefix_v.new_zeros(shape)
        self._keys[:, :, :, :prefix].copy_(prefix_k)
        self._values[:, :, :, :prefix].copy_(prefix_v)
        # denoise_step's positions (after the prefix's valid tokens) and additive mask (every
        # valid prefix token and every action token, for every action token)
        from lerobot.policies.common.vla_utils import prepare_attention_masks_4d
        device = prefix_pad.device
        positions = prefix_pad.sum(dim=-1, keepdim=True) + torch.arange(c, device=device)
        cos, sin = self.rotary(self._keys.new_zeros(1, c, 1), positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        mask = prepare_attention_masks_4d(
            torch.cat([prefix_pad, prefix_pad.new_ones(1, c)], dim=1)[:, None, :])
        x_t, dt = noise, -1.0 / self.num_steps
        for mods in self.modulation:
            x_t = x_t + dt * self._step_fn(x_t, mods, cos, sin, self._keys, self._values, mask)
        return x_t


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
