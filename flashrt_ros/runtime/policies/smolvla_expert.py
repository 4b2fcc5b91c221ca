'''SmolVLA's denoising steps on a computation of our own (denoise_kernels 'fused', opt-in),
as pi05_expert.py does for Pi0.5. LeRobot's denoise_step (smolvlm_with_expert.py) redoes, at
every step, work that depends on the chunk's prefix alone, and splits the rest in more kernels
than it needs:

- The cross-attention layers (every other layer by default) project the prefix's cached VLM
  keys and values through the expert's k_proj and v_proj at every step: the same GEMMs over
  the whole prefix, ten times a chunk. Here they run once a chunk, by LeRobot's own modules.
- The self-attention layers concatenate the prefix's keys and values with the step's (and
  transformers' DynamicCache crops them back after the step); here they sit in one static
  buffer per layer, the prefix copied in once a chunk, each step writing its own rows after it.
- The sinusoidal time embedding, the RoPE angles and the attention masks depend on the step's
  time or the prefix's pad mask alone: computed once (the times are the same every chunk).
- Attention. LeRobot's eager attention repeats each key head for its query heads and
  multiplies head by head; here the query heads that share a key head are the rows of one
  matrix, one GEMM each side of the float32 softmax. q / k / v and the MLP's gate / up are
  one GEMM each (their weights concatenated once).

The step is then compiled as denoise_kernels 'compiled' compiles LeRobot's (inductor's
deterministic mode) and the chunk captured around it. The arithmetic is LeRobot's, in its
dtypes (the expert's, float32 or bfloat16 with expert_dtype; the float32 softmax; the in-place
residual sums; its own norm modules): eagerly on the CPU the actions are LeRobot's bit for bit
(tested), compiled they are off by rounding (tested at reduced sizes, measured at the published
ones by benchmarks/vla.py --denoise-kernels compiled,fused).
'''

import torch
import torch.nn.functional as F

from ..errors import InvalidConfig


class FusedSmolVLAExpert:
    '''The denoising steps of a LeRobot VLAFlowMatching (SmolVLAPolicy.model) against a prefix
    cache, on the model's device (build it there).'''

    def __init__(self, model, compile_step, heads_first):
        cfg, vlm = model.config, model.vlm_with_expert
        text = vlm.config.text_config
        expert = vlm.lm_expert
        ecfg = expert.config
        if vlm.num_expert_layers != vlm.num_vlm_layers or ecfg.attention_bias or \
                getattr(ecfg, 'mlp_bias', False) or ecfg.hidden_act != 'silu':
            raise InvalidConfig('denoise_kernels fused: not the SmolVLA action expert it knows '
                                '(as many expert layers as VLM layers, no biases, SiLU)')
        self.heads, self.kv_heads = text.num_attention_heads, text.num_key_value_heads
        self.head_dim = text.head_dim
        self.chunk, self.num_steps = int(cfg.chunk_size), int(cfg.num_steps)
        self.heads_first = heads_first      # the kept prefix's layout: 0.6's [B, H, S, D]
        self.expert, self.model = expert, model
        n = vlm.self_attn_every_n_layers
        self.self_layers = [i for i in range(len(expert.layers))
                            if 'cross' not in vlm.attention_mode or (n > 0 and i % n == 0)]
        self.layers = [self._weights(i, layer) for i, layer in enumerate(expert.layers)]
        self.dtype = expert.layers[0].self_attn.q_proj.weight.dtype
        self.time = self._time_embeddings(model, cfg, vlm.expert_hidden_size)
        self._step_fn = compile_step(self._step)
        self._keys = None

    def _weights(self, i, layer):
        attn, mlp = layer.self_attn, layer.mlp
        w = {'o': attn.o_proj.weight, 'down': mlp.down_proj.weight,
             'gate_up': torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
             'input_norm': layer.input_layernorm, 'post_norm': layer.post_attention_layernorm}
        if i in self.self_layers:
            w['qkv'] = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        else:   # cross-attention: the expert's queries; keys and values from the prefix
            w['q'] = attn.q_proj.weight
        return w

    @torch.no_grad()
    def _time_embeddings(self, model, cfg, width):
        '''Each step's sinusoidal time embedding [1, width], as embed_suffix computes it from
        the time sample_actions gives it (in action_in_proj's dtype).'''
        from lerobot.policies.smolvla.modeling_smolvla import create_sinusoidal_pos_embedding
        device, dtype = model.action_in_proj.weight.device, model.action_in_proj.weight.dtype
        dt, out = -1.0 / self.num_steps, []
        for step in range(self.num_steps):
            time = torch.tensor(1.0 + step * dt, dtype=torch.float32, device=device).expand(1)
            out.append(create_sinusoidal_pos_embedding(
                time, width, cfg.min_period, cfg.max_period, device=device).type(dtype=dtype))
        return out

    def _angles(self, positions):
        '''apply_rope's cos and sin for positions [1, L]: [1, L, 1, head dim / 2] float32.'''
        half = self.head_dim // 2
        exponents = (2.0 / self.head_dim) * torch.arange(half, dtype=torch.float32,
                                                         device=positions.device)
        timescale = 10_000 ** exponents
        radians = (positions[..., None].to(torch.float32) /
                   timescale[None, None, :].to(torch.float32))[..., None, :]
        return torch.cos(radians), torch.sin(radians)

    @staticmethod
    def _rope(x, cos, sin):
        '''LeRobot's apply_rope with its angles computed once.'''
        dtype, x = x.dtype, x.to(torch.float32)
        x1, x2 = x.split(x.shape[-1] // 2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)

    def _attend(self, q, keys, values, mask):
        '''LeRobot's eager_attention_forward with the query heads of one key head as rows of
        one matrix: q [1, L, heads, D] (after RoPE), keys / values [1, kv heads, S, D], mask
        [1, 1, groups x L, S] bool -> [1, L, heads x D].'''
        c, d, groups = q.shape[1], self.head_dim, self.heads // self.kv_heads
        q = q.to(torch.float32).transpose(1, 2).reshape(1, self.kv_heads, groups * c, d)
        scores = torch.matmul(q, keys.to(torch.float32).transpose(2, 3))
        scores *= d ** -0.5
        scores = torch.where(mask, scores, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)
        return out.view(1, self.heads, c, d).transpose(1, 2).reshape(1, c, self.heads * d)

    def _suffix(self, x_t, time):
        '''embed_suffix's action-time embedding for the step's noisy actions.'''
        m = self.model
        action = m.action_in_proj(x_t)
        both = torch.cat([action, time[:, None, :].expand_as(action)], dim=2)
        return m.action_time_mlp_out(F.silu(m.action_time_mlp_in(both)))

    def _step(self, x_t, time, rope, keys, values, cross_k, cross_v, masks):
        '''One flow-matching step's velocity (LeRobot's denoise_step): keys / values [self
        layers, 1, kv heads, prefix + chunk, D] whose prefix part is filled (each self layer
        writes its chunk rows), cross_k / cross_v [cross layers, 1, kv heads, prefix, D]
        (the expert's projections of the prefix).'''
        c, d = self.chunk, self.head_dim
        prefix = keys.shape[3] - c
        sizes = (self.heads * d, self.kv_heads * d, self.kv_heads * d)
        h, s, x = self._suffix(x_t, time), 0, 0
        for i, w in enumerate(self.layers):
            y = w['input_norm'](h).to(self.dtype)
            if 'qkv' in w:
                q, k, v = F.linear(y, w['qkv']).split(sizes, dim=-1)
                cos, sin = rope[0]
                q = self._rope(q.view(1, c, self.heads, d), cos, sin)
                k = self._rope(k.view(1, c, self.kv_heads, d), cos, sin)
                keys[s, :, :, prefix:] = k.transpose(1, 2)
                values[s, :, :, prefix:] = v.view(1, c, self.kv_heads, d).transpose(1, 2)
                out = self._attend(q, keys[s], values[s], masks[0])
                s += 1
            else:
                cos, sin = rope[1]
                q = self._rope(F.linear(y, w['q']).view(1, c, self.heads, d), cos, sin)
                out = self._attend(q, cross_k[x], cross_v[x], masks[1])
                x += 1
            # the residual sums in place, as LeRobot's (into the projection's dtype)
            h_mid = F.linear(out.to(w['o'].dtype), w['o'])
            h_mid += h
            g, u = F.linear(w['post_norm'](h_mid), w['gate_up']).chunk(2, dim=-1)
            h = F.linear(F.silu(g) * u, w['down'])
            h += h_mid
        h = self.expert.norm(h)[:, -c:]
        return self.model.action_out_proj(h.to(torch.float32))

    def _prepare(self, prefix_k, prefix_v, prefix_pad):
        '''Per chunk: the self layers' static buffers with the prefix in, the cross layers'
        projections of it, the RoPE angles and the masks.'''
        if self.heads_first:    # LeRobot's attention reads [B, S, H, D]
            prefix_k, prefix_v = prefix_k.transpose(2, 3), prefix_v.transpose(2, 3)
        layers, _, size = prefix_k.shape[:3]
        c, kvh, d, device = self.chunk, self.kv_heads, self.head_dim, prefix_pad.device
        dtype = torch.promote_types(prefix_k.dtype, self.dtype)     # torch.cat's, as LeRobot's
        shape = (len(self.self_layers), 1, kvh, size + c, d)
        if self._keys is None or self._keys.shape != shape:
            self._keys = torch.zeros(shape, dtype=dtype, device=device)
            self._values = torch.zeros(shape, dtype=dtype, device=device)
        cross_k, cross_v = [], []
        for i, layer in enumerate(self.expert.layers):
            k, v = prefix_k[i], prefix_v[i]     # [1, S, kv heads, D]
            if i in self.self_layers:
                j = self.self_layers.index(i)
                self._keys[j, :, :, :size].copy_(k.transpose(1, 2))
                self._values[j, :, :, :size].copy_(v.transpose(1, 2))
                continue
            attn = layer.self_attn
            for proj, kv, out in ((attn.k_proj, k, cross_k), (attn.v_proj, v, cross_v)):
                flat = kv.to(proj.weight.dtype).reshape(1, size, -1)
                out.append(proj(flat).view(1, size, -1, d).transpose(1, 2).contiguous())
        # denoise_step's positions: after the prefix's valid tokens in the self layers, from 0
        # in the cross layers; its masks: the valid prefix, and the chunk causally
        steps = torch.arange(c, device=device)
        rope = (self._angles(prefix_pad.sum(dim=-1, keepdim=True) + steps[None]),
                self._angles(steps[None]))
        causal = steps[None, :] <= steps[:, None]
        groups = self.heads // kvh
        cross_mask = prefix_pad[:, None, :].expand(1, c, size)
        self_mask = torch.cat([cross_mask, causal[None]], dim=2)
        masks = tuple(m[:, None].repeat(1, 1, groups, 1) for m in (self_mask, cross_mask))
        if not cross_k:     # attention_mode self_attn: no cross layers
            return rope, None, None, masks
        return rope, torch.stack(cross_k), torch.stack(cross_v), masks

    def sample(self, noise, prefix_k, prefix_v, prefix_pad):
        '''LeRobot's sample_actions' steps from noise [1, chunk, max action dim] against the
        prefix cache (the policy's [layers, ...] keys and values, its [1, prefix] pad mask).'''
        rope, cross_k, cross_v, masks = self._prepare(prefix_k, prefix_v, prefix_pad)
        x_t, dt = noise, -1.0 / self.num_steps
        for time in self.time:
            v = self._step_fn(x_t, time, rope, self._keys, self._values, cross_k, cross_v,
                              masks)
            x_t = x_t + dt * v
        return x_t
