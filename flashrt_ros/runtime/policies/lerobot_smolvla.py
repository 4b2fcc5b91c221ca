'''LeRobot's SmolVLA on the engine (lerobot_chunk.py says how the chunk policies work): the
prefix KV cache of every VLM layer, its pad mask and the flow-matching noise's rng counter are
arena state beside the chunk, and the prefix is reused where that is exact (lerobot_prefix.py).

Both LeRobot cache layouts are served: 0.4's dict of [B, S, H, D] keys and values per layer
(forward(fill_kv_cache=True)), and 0.6's transformers DynamicCache of [B, H, S, D] (filled when
forward is given none; the denoise steps append to it and crop it back). The kept prefix is
stored in the version's layout, so a capsule's schema names it.

expert_dtype 'bfloat16' (opt-in; the default 'float32' is LeRobot's): LeRobot runs SmolVLA's
action expert in float32 beside a bfloat16 VLM, and casts each layer's input to its weights'
dtype, so the expert cast to bfloat16 runs as it is, on tensor cores: the denoising steps
take about half the time on the H200 (README), and the actions are those of LeRobot's model
with the same cast, bit for bit, off LeRobot's own by rounding. The prefix pass does not use
the expert: the kept prefix is the same either way.'''

import contextlib
import inspect

import torch

from ..errors import InvalidConfig
from .lerobot_checkpoint import MASK, TOKENS
from .lerobot_prefix import check_kernels, compiled, FUSED
from .lerobot_rtc import RealTimeChunkPolicy
from .smolvla_expert import FusedSmolVLAExpert


class SmolVLAChunkPolicy(RealTimeChunkPolicy):
    '''A lerobot SmolVLAPolicy: the prefix KV cache of every layer, its pad mask and the
    noise's rng counter are arena state too.'''

    kind = 'smolvla'
    computation = ('chunk_size', 'num_steps', 'max_state_dim', 'max_action_dim',
                   'resize_imgs_with_padding', 'prefix_length', 'attention_mode',
                   'num_vlm_layers', 'num_expert_layers', 'self_attn_every_n_layers',
                   'expert_width_multiplier', 'add_image_special_tokens', 'min_period',
                   'max_period', 'use_cache', 'empty_cameras')

    checkpoint_options = RealTimeChunkPolicy.checkpoint_options + ('expert_dtype',)

    def __init__(self, lerobot_policy, stats=None, cameras=None, seed=0,
                 denoise_kernels='lerobot', expert_dtype='float32', prefix_kernels='lerobot',
                 **rtc):
        cfg = lerobot_policy.config
        check_kernels(self.kind, denoise_kernels, prefix_kernels, rtc.get('rtc_delay', -1),
                      cfg.use_amp, f'expert_dtype {expert_dtype}' * (expert_dtype != 'float32'))
        if expert_dtype not in ('float32', 'bfloat16'):
            raise InvalidConfig(f'smolvla: expert_dtype {expert_dtype!r}: float32 (LeRobot\'s) '
                                'or bfloat16')
        if expert_dtype == 'bfloat16' and rtc.get('rtc_delay', -1) >= 0:
            raise InvalidConfig('smolvla: expert_dtype bfloat16 with real-time chunking is not '
                                'supported yet (its guidance through the expert is not measured)')
        if getattr(cfg, 'adapt_to_pi_aloha', False) or not cfg.use_cache:
            raise InvalidConfig('smolvla: adapt_to_pi_aloha and use_cache false are not '
                                'supported yet')
        # LeRobot 0.4: the cache a dict filled on request; 0.6: a DynamicCache
        self._dict_cache = 'fill_kv_cache' in inspect.signature(
            lerobot_policy.model.vlm_with_expert.forward).parameters
        self.tokens = int(cfg.tokenizer_max_length)
        super().__init__(lerobot_policy, stats, cameras, seed)
        self.setup_rtc(**rtc)
        self.noise_shape = (1, self.chunk, int(cfg.max_action_dim))
        # the cache's layout, from one prefix pass on zeros that records the position ids
        self.learn_layout(*self._prefix(
            self._inputs(torch.zeros(self.obs_dim, device=self.device)), record=True))
        self.vocabulary = self.lerobot.model.vlm_with_expert.get_vlm_model().text_model \
            .embed_tokens.num_embeddings
        self.expert_dtype = expert_dtype
        if expert_dtype == 'bfloat16':      # once nothing else can refuse the model
            expert_in_bfloat16(self.lerobot)
        self.use_kernels(denoise_kernels, prefix_kernels)

    def config(self):
        return {**super().config(), 'expert_dtype': self.expert_dtype}

    def _vlm(self):
        return self.lerobot.model.vlm_with_expert

    def _prefix(self, batch, record=False):
        '''LeRobot's sample_actions up to the filled KV cache: ([(keys, values)] per layer,
        prefix pad mask). record: with transformers' own patch position ids, recorded (the
        first pass).'''
        from lerobot.policies.smolvla.modeling_smolvla import make_att_2d_masks
        images, img_masks = self.lerobot.prepare_images(batch)
        state = self.lerobot.prepare_state(batch)
        with self._recorded_positions() if record else self._fixed_positions():
            embs, pad, att = self._embed_prefix(images, img_masks, batch[TOKENS], batch[MASK],
                                                state=state)
        fill = {'fill_kv_cache': True} if self._dict_cache else {}
        _, kv = self._prefix_forward()(
            attention_mask=make_att_2d_masks(pad, att), position_ids=torch.cumsum(pad, 1) - 1,
            past_key_values=None, inputs_embeds=[embs, None], use_cache=True, **fill)
        if self._dict_cache:
            return [(kv[i]['key_states'], kv[i]['value_states']) for i in range(len(kv))], pad
        return [(layer.keys, layer.values) for layer in kv.layers], pad

    def fused_expert(self):
        return FusedSmolVLAExpert(self.lerobot.model, compiled, heads_first=not self._dict_cache)

    def _denoise(self, batch):
        '''LeRobot's sample_actions after the prefix pass, against the static prefix (the
        state went into the prefix).'''
        if self.denoise_kernels == FUSED:
            return self._fused_chunk()
        model, cfg, c = self.lerobot.model, self.lerobot.config, self._cache
        if self._dict_cache:
            kv = {i: {'key_states': c['prefix_k'][i], 'value_states': c['prefix_v'][i]}
                  for i in range(self.layers)}
        else:
            kv = self._dynamic_cache()
        x = self.noise(self._chunk_rng)
        dt = -1.0 / cfg.num_steps
        for k in range(cfg.num_steps):
            time = 1.0 + k * dt
            t = torch.tensor(time, dtype=torch.float32, device=x.device).expand(1)

            def velocity(x_t, t=t):
                return model.denoise_step(x_t=x_t, prefix_pad_masks=c['prefix_pad'],
                                          past_key_values=kv, timestep=t)
            if self._guidance:      # real-time chunking: sample_actions' RTC branch
                g = self._guidance
                v = g['rtc_processor'].denoise_step(
                    x_t=x, prev_chunk_left_over=g['prev_chunk_left_over'],
                    inference_delay=g['inference_delay'], time=time,
                    original_denoise_step_partial=velocity, execution_horizon=None)
            else:
                v = velocity(x)
            x = x + dt * v
        return self._chunk_outputs(x)

    def _vision_embeddings(self):
        return self.lerobot.model.vlm_with_expert.get_vlm_model().vision_model.embeddings

    @contextlib.contextmanager
    def _recorded_positions(self):
        '''Keep the patch position ids transformers computes for each image shape.'''
        emb, shape, found = self._vision_embeddings(), [], {}
        hooks = [emb.register_forward_pre_hook(   # transformers passes pixel_values by name
                     lambda m, a, kw: shape.append(tuple(kw['pixel_values'].shape)),
                     with_kwargs=True),
                 emb.position_embedding.register_forward_pre_hook(
                     lambda m, a: found.setdefault(shape[-1], a[0].clone()))]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
        self._position_shapes = list(found)     # the ids: buffers, to move with the model
        for i, ids in enumerate(found.values()):
            self.register_buffer(f'_vision_positions_{i}', ids, persistent=False)

    @contextlib.contextmanager
    def _fixed_positions(self):
        '''SigLIP's patch embeddings (transformers' SmolVLMVisionEmbeddings: the same
        operations) with the recorded position ids: transformers derives them from the patch
        mask with host-synchronising ops (torch.arange of a device count, boolean indexing)
        that a CUDA graph cannot hold, and for the full mask embed_image always passes they
        depend on the image shape only: each image of a batch has the ids of one image of its
        shape (prefix_kernels 'compiled' embeds the cameras in one batch).'''
        emb = self._vision_embeddings()
        ids = {s: getattr(self, f'_vision_positions_{i}')
               for i, s in enumerate(self._position_shapes)}

        def forward(pixel_values, patch_attention_mask):
            patches = emb.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
            shape = tuple(pixel_values.shape)
            positions = ids[shape] if shape in ids else \
                ids[(1, *shape[1:])].expand(shape[0], -1)
            return patches + emb.position_embedding(positions)
        emb.forward = forward
        try:
            yield
        finally:
            del emb.forward


def expert_in_bfloat16(lerobot_policy):
    '''Cast a LeRobot SmolVLAPolicy's action expert (the transformer the denoising steps run
    through; the action projections around it stay float32) to bfloat16, in place.'''
    lerobot_policy.model.vlm_with_expert.lm_expert.to(torch.bfloat16)
