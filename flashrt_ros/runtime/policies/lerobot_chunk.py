'''LeRobot's chunk policies on the engine: SmolVLA (cameras, instruction, state -> action
chunks) and ACT (cameras, state -> action chunks), whose execution state lives in the arena,
so that a capsule holds all of it.

LeRobot's select_action keeps a deque of actions and, when it runs empty, computes a chunk:
the prefix (images through SigLIP, instruction tokens, state) through the VLM fills a KV cache,
and num_steps flow-matching steps run the action expert against that cache, starting from
Gaussian noise. Here the same modules run the same operations, but every piece of state is an
arena buffer: the chunk's remaining actions and how many are left, the prefix KV cache of every
layer and the prefix's pad mask, and the rng counter the noise is drawn from (base.
gaussian_noise: a pure function of (seed, counter), so a restored capsule draws the same
future chunks). Given the same inputs and noise, the actions are LeRobot's select_action bit
for bit on the same device (test/unit/test_lerobot_chunk.py).

The observation is one float32 vector, as for every policy here, in this order: the state
(its dims), each camera's image in [0, 1] as 3 x H x W (the cameras of the checkpoint's
config, in its order), the instruction's token ids (tokenizer_max_length of them, padded) and
their attention mask (1 or 0). Token ids travel as float32, exact below 2**24.

The state is normalised and the actions unnormalised as LeRobot's processor pipeline does it
(NormalizerProcessorStep / UnnormalizerProcessorStep: the same operations in the same order),
with the statistics of the checkpoint's policy_preprocessor files (from_pretrained) or given;
a config that normalises state or actions with no statistics is refused, never run raw.

The step is a host-side branch (pop the queue, or compute a chunk first), so the engine runs
it eagerly; the chunk's computation itself is one CUDA graph on CUDA (capture()): a function of
static buffers (the observation and rng counter copied in; the chunk, and SmolVLA's prefix
cache and pad mask, copied out to the session's arena views). LeRobot's host-built constants
are kept at capture (graph.HostConstants); SigLIP's patch position ids, which transformers
computes with host-synchronising ops, are recorded from transformers' own computation once
(SmolVLAChunkPolicy._fixed_positions). On the CPU the same function runs eagerly.

Not yet (issue 24): ACT temporal ensembling and real-time chunking.
'''

import contextlib

import torch

from ..errors import InvalidConfig, InvalidObservation
from ..state import BufferSpec
from ..graph import StepGraph
from .base import gaussian_noise, Policy
from .lerobot_checkpoint import MASK, observation_size, STATE, TOKENS


class LeRobotChunkPolicy(Policy):
    '''What LeRobot's chunk policies share: the observation vector's layout (state, cameras,
    and for a language policy the instruction's tokens), normalisation with the checkpoint's
    statistics, and the chunk in the arena (`queue`, `left`), refilled by _compute() when it
    runs empty. cameras: {feature key: (3, H, W)} of the images the node will give (default:
    the config's image features, at their configured shapes).'''

    capturable = False      # the engine runs step() eagerly and calls capture()
    tokens = 0              # the instruction's token count (a language policy)
    computation = ()        # config fields that change the actions for the same weights

    def __init__(self, lerobot_policy, stats=None, cameras=None, seed=0):
        cfg = lerobot_policy.config
        state_dim = cfg.input_features[STATE].shape[0]
        cams = {k: tuple(f.shape) for k, f in cfg.image_features.items()} if cameras is None \
            else {k: tuple(int(s) for s in v) for k, v in cameras.items()}
        unknown = sorted(set(cams) - set(cfg.image_features))
        if unknown or not cams or any(len(s) != 3 or s[0] != 3 for s in cams.values()):
            raise InvalidConfig(f'{self.kind} cameras {cams}: each a (3, H, W) image of the '
                                f'config\'s {sorted(cfg.image_features)}')
        super().__init__(observation_size(state_dim, cams, self.tokens),
                         cfg.output_features['action'].shape[0], seed=seed)
        self.lerobot = lerobot_policy.eval()
        self.state_dim, self.cameras = state_dim, cams
        self.chunk, self.steps = int(cfg.chunk_size), int(cfg.n_action_steps)
        # the statistics are buffers: they move with the model and are in its digest
        self._modes, device = {}, next(lerobot_policy.parameters()).device
        for key, ftype in ((STATE, 'STATE'), ('action', 'ACTION'),
                           *((k, 'VISUAL') for k in cams)):
            self._modes[key], found = _statistics(self.kind, cfg, key, ftype, stats)
            for name, value in found.items():
                self.register_buffer(f'{key.replace(".", "_")}_{name}', value.to(device))
        self._chunk_graph = None

    @classmethod
    def from_pretrained(cls, folder, cameras=None, seed=0):
        '''A LeRobot checkpoint folder (config.json, model.safetensors and the processor files
        save_pretrained writes), loaded by LeRobot itself; the statistics are those of its
        policy_preprocessor's normaliser.'''
        from lerobot.policies.factory import get_policy_class
        from lerobot.processor import NormalizerProcessorStep, PolicyProcessorPipeline
        pre = PolicyProcessorPipeline.from_pretrained(
            folder, config_filename='policy_preprocessor.json')
        found = [s.stats for s in pre.steps if isinstance(s, NormalizerProcessorStep)]
        return cls(get_policy_class(cls.kind).from_pretrained(folder),
                   stats=found[0] if found else None, cameras=cameras, seed=seed)

    def config(self):
        # what shapes the computation besides the weights; never a path (vlm_model_name): a
        # capsule stays valid when the checkpoint moves
        cfg = self.lerobot.config
        return {**super().config(), 'cameras': sorted(self.cameras.items()),
                'n_action_steps': self.steps, 'tokens': self.tokens, 'normalisation': sorted(
                    (k, v) for k, v in self._modes.items()),
                **{k: repr(getattr(cfg, k, None)) for k in self.computation}}

    def state_specs(self):
        return [BufferSpec('queue', (self.steps, self.act_dim), torch.float32, 'chunk'),
                BufferSpec('left', (1,), torch.int64, 'chunk')]

    @torch.no_grad()
    def reset_state(self):
        for view in self.views.values():
            view.zero_()
        if 'rng' in self.views:     # a policy that samples (SmolVLA's noise)
            self.views['rng'][0] = self.seed

    def _inputs(self, obs):
        '''The LeRobot batch the observation vector packs, normalised.'''
        batch, at = {STATE: self._normalised(STATE, obs[:self.state_dim].view(1, -1))}, \
            self.state_dim
        for key, (c, h, w) in self.cameras.items():
            batch[key] = self._normalised(key, obs[at:at + c * h * w].view(1, c, h, w))
            at += c * h * w
        if self.tokens:
            batch[TOKENS] = obs[at:at + self.tokens].view(1, -1).to(torch.long)
            batch[MASK] = obs[at + self.tokens:].view(1, -1) != 0
        return batch

    def _normalised(self, key, x, inverse=False):
        '''LeRobot's NormalizerProcessorStep._apply_transform, the same operations in order.'''
        mode, prefix, eps = self._modes[key], key.replace('.', '_'), 1e-8
        if mode == 'mean_std':
            mean, std = getattr(self, prefix + '_mean'), getattr(self, prefix + '_std')
            return x * std + mean if inverse else (x - mean) / (std + eps)
        if mode == 'min_max':
            low, high = getattr(self, prefix + '_min'), getattr(self, prefix + '_max')
            span = high - low
            span = torch.where(span == 0, torch.tensor(eps, device=x.device), span)
            return (x + 1) / 2 * span + low if inverse else 2 * (x - low) / span - 1
        return x

    def capture(self, enabled):
        '''The chunk's computation over static buffers: one CUDA graph when enabled (on CUDA),
        else the same function eagerly. Called by the engine once the policy is on its
        device; step() calls it (eager) when nothing did.'''
        self._chunk_obs = torch.zeros(self.obs_dim, device=self.device)
        self._chunk_rng = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._chunk_graph = StepGraph(self._chunk_fn, self.device, enabled, host_constants=True)

    @torch.no_grad()
    def _chunk_fn(self):
        self._chunk_out = self._chunk(self._inputs(self._chunk_obs))

    @torch.no_grad()
    def step(self, obs, action):
        v, left = self.views, int(self.views['left'])     # one read of the device
        if left == 0:               # the queue ran empty: the next chunk (host branch)
            if self._chunk_graph is None:
                self.capture(False)
            self._chunk_obs.copy_(obs)
            if 'rng' in v:
                self._chunk_rng.copy_(v['rng'])
            self._chunk_graph.replay()
            for name, value in self._chunk_out.items():
                v[name].copy_(value)
            if 'rng' in v:
                v['rng'][1:2].add_(1)       # the next chunk's noise
            left = self.steps
        action.copy_(v['queue'][self.steps - left])
        v['left'].fill_(left - 1)

    def fresh_chunk(self, views):
        '''The chunk (numpy [n_action_steps, act_dim]) when the session's latest step
        computed it (its first action was that step's), else None; views: the session's.'''
        if int(views['left']) != self.steps - 1:
            return None
        return views['queue'].cpu().numpy()


class SmolVLAChunkPolicy(LeRobotChunkPolicy):
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
        if getattr(cfg, 'adapt_to_pi_aloha', False) or getattr(cfg, 'rtc_config', None):
            raise InvalidConfig('smolvla: adapt_to_pi_aloha and real-time chunking are not '
                                'supported yet')
        self.tokens = int(cfg.tokenizer_max_length)
        super().__init__(lerobot_policy, stats, cameras, seed)
        self.noise_shape = (1, self.chunk, int(cfg.max_action_dim))
        # the prefix's length and the cache's layout, from one prefix pass on zeros
        kv, pad = self._prefix(self._inputs(torch.zeros(self.obs_dim, device=self.device)),
                               record=True)
        first = kv[0]['key_states']
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
            self._rng_spec()]

    def _prefix(self, batch, record=False):
        '''LeRobot's sample_actions up to the filled KV cache: (cache, prefix pad mask).
        record: with transformers' own patch position ids, recorded (the first pass).'''
        from lerobot.policies.smolvla.modeling_smolvla import make_att_2d_masks
        model = self.lerobot.model
        images, img_masks = self.lerobot.prepare_images(batch)
        state = self.lerobot.prepare_state(batch)
        with self._recorded_positions() if record else self._fixed_positions():
            embs, pad, att = model.embed_prefix(images, img_masks, batch[TOKENS], batch[MASK],
                                                state=state)
        _, kv = model.vlm_with_expert.forward(
            attention_mask=make_att_2d_masks(pad, att), position_ids=torch.cumsum(pad, 1) - 1,
            past_key_values=None, inputs_embeds=[embs, None], use_cache=True,
            fill_kv_cache=True)
        return kv, pad

    def check_observation(self, obs):
        '''InvalidObservation unless the instruction part of obs ([..., obs_dim], numpy or a
        tensor, finite) holds token ids the model embeds (integers in [0, vocabulary)) and a
        mask of 0 and 1: a float there would be truncated to another token without an error.'''
        obs, vocabulary = torch.as_tensor(obs), self.vocabulary
        ids, mask = obs[..., -2 * self.tokens:-self.tokens], obs[..., -self.tokens:]
        if not bool(((ids == ids.round()) & (ids >= 0) & (ids < vocabulary)).all()):
            first = self.obs_dim - 2 * self.tokens
            raise InvalidObservation(f'the instruction\'s token ids must be integers in [0, '
                                     f'{vocabulary}) (observation values {first}..'
                                     f'{first + self.tokens - 1})')
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise InvalidObservation('the instruction\'s attention mask must be 0 or 1 (the '
                                     f'last {self.tokens} observation values)')

    def valid_probe(self, obs):
        '''The engine's determinism probe fills observations with random floats: valid token
        ids (0) and an attention mask (1) instead, in place.'''
        obs[..., -2 * self.tokens:-self.tokens] = 0
        obs[..., -self.tokens:] = 1

    def _chunk(self, batch):
        model, cfg = self.lerobot.model, self.lerobot.config
        kv, pad = self._prefix(batch)
        x = self.noise(self._chunk_rng)
        dt = -1.0 / cfg.num_steps
        for k in range(cfg.num_steps):
            t = torch.tensor(1.0 + k * dt, dtype=torch.float32, device=x.device).expand(1)
            x = x + dt * model.denoise_step(x_t=x, prefix_pad_masks=pad, past_key_values=kv,
                                            timestep=t)
        return {'queue': self._normalised('action', x[0, :self.steps, :self.act_dim], True),
                'prefix_k': torch.stack([kv[i]['key_states'] for i in range(self.layers)]),
                'prefix_v': torch.stack([kv[i]['value_states'] for i in range(self.layers)]),
                'prefix_pad': pad}

    def noise(self, rng=None):
        '''The flow-matching start of a chunk, [1, chunk_size, max_action_dim]: a pure
        function of an rng buffer (seed, counter; default the session's: the next chunk's).'''
        rng = self.views['rng'] if rng is None else rng
        n = self.noise_shape[1] * self.noise_shape[2]
        return gaussian_noise(rng[0:1], rng[1:2], n).view(self.noise_shape)

    def _vision_embeddings(self):
        return self.lerobot.model.vlm_with_expert.get_vlm_model().vision_model.embeddings

    @contextlib.contextmanager
    def _recorded_positions(self):
        '''Keep the patch position ids transformers computes for each image shape.'''
        emb, shape = self._vision_embeddings(), []
        self._positions = {}
        hooks = [emb.register_forward_pre_hook(   # transformers passes pixel_values by name
                     lambda m, a, kw: shape.append(tuple(kw['pixel_values'].shape)),
                     with_kwargs=True),
                 emb.position_embedding.register_forward_pre_hook(
                     lambda m, a: self._positions.setdefault(shape[-1], a[0].clone()))]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
        for i, ids in enumerate(self._positions.values()):
            self.register_buffer(f'_vision_positions_{i}', ids, persistent=False)

    @contextlib.contextmanager
    def _fixed_positions(self):
        '''SigLIP's patch embeddings (transformers' SmolVLMVisionEmbeddings: the same
        operations) with the recorded position ids: transformers derives them from the patch
        mask with host-synchronising ops (torch.arange of a device count, boolean indexing)
        that a CUDA graph cannot hold, and for the full mask embed_image always passes they
        depend on the image shape only.'''
        emb = self._vision_embeddings()
        ids = {s: getattr(self, f'_vision_positions_{i}') for i, s in enumerate(self._positions)}

        def forward(pixel_values, patch_attention_mask):
            patches = emb.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
            return patches + emb.position_embedding(ids[tuple(pixel_values.shape)])
        emb.forward = forward
        try:
            yield
        finally:
            del emb.forward


class ACTChunkPolicy(LeRobotChunkPolicy):
    '''A lerobot ACTPolicy: a chunk per n_action_steps steps, from the transformer (no noise
    at inference: the latent is zero); the chunk is its whole state.'''

    kind = 'act'
    computation = ('chunk_size', 'vision_backbone', 'replace_final_stride_with_dilation',
                   'pre_norm', 'dim_model', 'n_heads', 'n_encoder_layers', 'n_decoder_layers',
                   'use_vae', 'latent_dim', 'feedforward_activation')

    def __init__(self, lerobot_policy, stats=None, cameras=None, seed=0):
        if lerobot_policy.config.temporal_ensemble_coeff is not None:
            raise InvalidConfig('act: temporal ensembling is not supported yet (set '
                                'temporal_ensemble_coeff to None: the action queue)')
        super().__init__(lerobot_policy, stats, cameras, seed)

    def _chunk(self, batch):
        chunk = self.lerobot.predict_action_chunk(batch)[0]
        return {'queue': self._normalised('action', chunk[:self.steps], True)}


def _statistics(kind, cfg, key, feature_type, stats):
    '''(mode, float32 statistics) of LeRobot's (Un)NormalizerProcessorStep for feature `key`:
    ('identity', {}), ('mean_std', mean and std) or ('min_max', min and max).'''
    from lerobot.configs.types import FeatureType, NormalizationMode
    mode = cfg.normalization_mapping.get(getattr(FeatureType, feature_type),
                                         NormalizationMode.IDENTITY)
    if mode == NormalizationMode.IDENTITY:
        return 'identity', {}
    if mode not in (NormalizationMode.MEAN_STD, NormalizationMode.MIN_MAX):
        raise InvalidConfig(f'{kind}: normalisation {mode.value} of {key!r} is not supported '
                            'yet')
    have = (stats or {}).get(key)
    names = ('mean', 'std') if mode == NormalizationMode.MEAN_STD else ('min', 'max')
    if have is None or any(n not in have for n in names):
        raise InvalidConfig(f'{kind}: the config normalises {key!r} ({mode.value}) and no '
                            f'{"/".join(names)} statistics were given (load the checkpoint '
                            'with from_pretrained, or pass stats=): its actions would be wrong')
    return mode.value.lower(), {n: torch.as_tensor(have[n], dtype=torch.float32) for n in names}
