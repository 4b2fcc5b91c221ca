'''LeRobot's SmolVLA on the engine (lerobot_chunk.py says how the chunk policies work): the
prefix KV cache of every VLM layer, its pad mask and the flow-matching noise's rng counter are
arena state beside the chunk.

The prefix is reused where that is exact: the arena also keeps the observation the prefix was
computed from (prefix_obs, kind 'kv' with the cache), and a chunk whose observation equals it
bit for bit runs the denoise steps alone against the kept prefix: the same kernels on the same
bytes as a whole chunk, so the same actions. That happens at an episode start that looks like
one before it (a simulator reset, whose first observation repeats), after restoring the 'kv'
buffers of a capsule taken after that start's first chunk: the VLM pass is skipped.

Both LeRobot cache layouts are served: 0.4's dict of [B, S, H, D] keys and values per layer
(forward(fill_kv_cache=True)), and 0.6's transformers DynamicCache of [B, H, S, D] (filled when
forward is given none; the denoise steps append to it and crop it back). The kept prefix is
stored in the version's layout, so a capsule's schema names it.'''

import contextlib
import inspect

import torch

from ..errors import InvalidConfig
from ..graph import StepGraph
from ..state import BufferSpec
from .lerobot_checkpoint import MASK, TOKENS
from .lerobot_chunk import LanguageChunkPolicy


class SmolVLAChunkPolicy(LanguageChunkPolicy):
    '''A lerobot SmolVLAPolicy: the prefix KV cache of every layer, its pad mask and the
    noise's rng counter are arena state too.'''

    kind = 'smolvla'
    computation = ('chunk_size', 'num_steps', 'max_state_dim', 'max_action_dim',
                   'resize_imgs_with_padding', 'prefix_length', 'attention_mode',
                   'num_vlm_layers', 'num_expert_layers', 'self_attn_every_n_layers',
                   'expert_width_multiplier', 'add_image_special_tokens', 'min_period',
                   'max_period', 'use_cache', 'empty_cameras')

    def __init__(self, lerobot_policy, stats=None, cameras=None, seed=0):
        cfg = lerobot_policy.config
        if getattr(cfg, 'adapt_to_pi_aloha', False) or getattr(cfg, 'rtc_config', None) \
                or not cfg.use_cache:
            raise InvalidConfig('smolvla: adapt_to_pi_aloha, real-time chunking and use_cache '
                                'false are not supported yet')
        # LeRobot 0.4: the cache a dict filled on request; 0.6: a DynamicCache
        self._dict_cache = 'fill_kv_cache' in inspect.signature(
            lerobot_policy.model.vlm_with_expert.forward).parameters
        self.tokens = int(cfg.tokenizer_max_length)
        super().__init__(lerobot_policy, stats, cameras, seed)
        self.noise_shape = (1, self.chunk, int(cfg.max_action_dim))
        # the prefix's length and the cache's layout, from one prefix pass on zeros
        kv, pad = self._prefix(self._inputs(torch.zeros(self.obs_dim, device=self.device)),
                               record=True)
        first = kv[0][0]
        self.layers, self.kv_shape = len(kv), tuple(first.shape)
        self.kv_dtype, self.prefix_len = first.dtype, pad.shape[1]
        self.vocabulary = self.lerobot.model.vlm_with_expert.get_vlm_model().text_model \
            .embed_tokens.num_embeddings

    def state_specs(self):
        cache = (self.layers, *self.kv_shape)
        return super().state_specs() + [
            BufferSpec('prefix_k', cache, self.kv_dtype, 'kv'),
            BufferSpec('prefix_v', cache, self.kv_dtype, 'kv'),
            BufferSpec('prefix_pad', (1, self.prefix_len), torch.bool, 'kv'),
            # the key of the cache above: the observation it came from, and whether it holds one
            BufferSpec('prefix_obs', (self.obs_dim,), torch.float32, 'kv'),
            BufferSpec('prefix_ready', (1,), torch.int64, 'kv'),
            self._rng_spec()]

    def _prefix(self, batch, record=False):
        '''LeRobot's sample_actions up to the filled KV cache: ([(keys, values)] per layer,
        prefix pad mask). record: with transformers' own patch position ids, recorded (the
        first pass).'''
        from lerobot.policies.smolvla.modeling_smolvla import make_att_2d_masks
        model = self.lerobot.model
        images, img_masks = self.lerobot.prepare_images(batch)
        state = self.lerobot.prepare_state(batch)
        with self._recorded_positions() if record else self._fixed_positions():
            embs, pad, att = model.embed_prefix(images, img_masks, batch[TOKENS], batch[MASK],
                                                state=state)
        fill = {'fill_kv_cache': True} if self._dict_cache else {}
        _, kv = model.vlm_with_expert.forward(
            attention_mask=make_att_2d_masks(pad, att), position_ids=torch.cumsum(pad, 1) - 1,
            past_key_values=None, inputs_embeds=[embs, None], use_cache=True, **fill)
        if self._dict_cache:
            return [(kv[i]['key_states'], kv[i]['value_states']) for i in range(len(kv))], pad
        return [(layer.keys, layer.values) for layer in kv.layers], pad

    def capture(self, enabled):
        '''The whole chunk (LeRobotChunkPolicy.capture) and its denoise steps alone, each a
        CUDA graph when enabled; both denoise from the static prefix buffers (_cache).'''
        cache, dev = (self.layers, *self.kv_shape), self.device
        self._cache = {'prefix_k': torch.zeros(cache, dtype=self.kv_dtype, device=dev),
                       'prefix_v': torch.zeros(cache, dtype=self.kv_dtype, device=dev),
                       'prefix_pad': torch.zeros(1, self.prefix_len, dtype=torch.bool,
                                                 device=dev)}
        self.prefix_reused = 0      # chunks that skipped the prefix pass (benchmarks, tests)
        super().capture(enabled)
        self._denoise_graph = StepGraph(self._denoise_fn, dev, enabled, host_constants=True)

    def _chunk(self, batch):
        kv, pad = self._prefix(batch)
        c = self._cache
        c['prefix_k'].copy_(torch.stack([k for k, _ in kv]))
        c['prefix_v'].copy_(torch.stack([v for _, v in kv]))
        c['prefix_pad'].copy_(pad)
        return {**self._denoise(), **c}

    def _denoise(self):
        '''LeRobot's sample_actions after the prefix pass, against the static prefix.'''
        model, cfg, c = self.lerobot.model, self.lerobot.config, self._cache
        if self._dict_cache:
            kv = {i: {'key_states': c['prefix_k'][i], 'value_states': c['prefix_v'][i]}
                  for i in range(self.layers)}
        else:       # filled as the prefix pass fills it: update() copies each layer in
            from transformers import DynamicCache
            kv = DynamicCache()
            for i in range(self.layers):
                kv.update(c['prefix_k'][i], c['prefix_v'][i], i)
        x = self.noise(self._chunk_rng)
        dt = -1.0 / cfg.num_steps
        for k in range(cfg.num_steps):
            t = torch.tensor(1.0 + k * dt, dtype=torch.float32, device=x.device).expand(1)
            x = x + dt * model.denoise_step(x_t=x, prefix_pad_masks=c['prefix_pad'],
                                            past_key_values=kv, timestep=t)
        return {'queue': self._normalised('action', x[0, :self.steps, :self.act_dim], True)}

    @torch.no_grad()
    def _denoise_fn(self):
        self._denoise_out = self._denoise()

    def _replay(self, obs):
        '''A chunk; the denoise steps alone when the session's prefix came from obs (its
        bits: -0.0 is not 0.0 here), one read of the device to know.'''
        if self._chunk_graph is None:
            self.capture(False)
        v = self.views
        same = (obs.view(torch.int32) == v['prefix_obs'].view(torch.int32)).all()
        if bool(same & (v['prefix_ready'] == 1).all()):
            for name, buffer in self._cache.items():
                buffer.copy_(v[name])
            self._run(self._denoise_graph)
            self.prefix_reused += 1
            return self._denoise_out
        out = super()._replay(obs)
        v['prefix_obs'].copy_(obs)
        v['prefix_ready'].fill_(1)
        return out

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
        depend on the image shape only.'''
        emb = self._vision_embeddings()
        ids = {s: getattr(self, f'_vision_positions_{i}')
               for i, s in enumerate(self._position_shapes)}

        def forward(pixel_values, patch_attention_mask):
            patches = emb.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
            return patches + emb.position_embedding(ids[tuple(pixel_values.shape)])
        emb.forward = forward
        try:
            yield
        finally:
            del emb.forward
