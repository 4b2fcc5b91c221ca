'''LeRobot's Pi0 and Pi0.5 on the engine (LeRobot 0.6; lerobot_chunk.py says how the chunk policies
work): LeRobot's own sample_actions, PaliGemma's pass over the prefix (SigLIP over each camera,
the instruction's tokens) into a KV cache, then num_inference_steps flow-matching steps of the
Gemma action expert against it, as one captured CUDA graph on CUDA. The arena holds the chunk,
how many of its actions are left, the rng counter its noise is drawn from, and the prefix KV
cache of the last chunk with its pad mask and the observation it came from: a chunk whose
observation repeats that one bit for bit runs the denoising steps alone (lerobot_prefix.py).
The cache is PaliGemma's transformers DynamicCache ([1, kv heads, S, head dim] per layer), put
back as its prefix pass fills it.

The observation vector is SmolVLA's: the state, each camera's image in [0, 1] (3 x H x W), the
instruction's token ids (tokenizer_max_length) and their attention mask. Given the same inputs
and noise, the actions are LeRobot's (its normaliser, predict_action_chunk, its unnormaliser)
bit for bit on the same device (test/unit/test_lerobot_pi0.py).

Pi0.5 (Pi05ChunkPolicy) differs in its inputs: its pre-processor writes the state,
normalised (quantiles by default) and discretised into 256 bins, into the prompt before
tokenizing, and the model reads no other state. So the token ids of its observation change
with the state and must come from the checkpoint's pre-processor run on that observation
(lerobot_checkpoint.checkpoint_inputs, which the node runs at every step of a cameras
observation); the state part of the vector is normalised and otherwise unused.

vision_dtype 'bfloat16' (opt-in; the default 'float32' is LeRobot's): LeRobot keeps PaliGemma's
SigLIP vision tower and its projector in float32 in a bfloat16 model, and on the H200 their
float32 GEMMs are most of the prefix pass (README). In bfloat16 they are several times faster,
and the actions are no longer LeRobot's bit for bit: they are those of LeRobot's model with the
same two modules cast (tested), off LeRobot's own by rounding (the README says how far that
was on random weights; a trained checkpoint must be measured, benchmarks/vla_pi0.py --vision).

LeRobot 0.4's Pi0 and Pi0.5 need a transformers fork that is not on PyPI and are refused; so
are relative actions (not yet). Real-time chunking: lerobot_rtc.py.
'''

from importlib.metadata import version

import torch

from ..errors import InvalidConfig
from .lerobot_checkpoint import MASK, TOKENS
from .lerobot_prefix import check_kernels, compiled, FUSED
from .lerobot_rtc import RealTimeChunkPolicy
from .pi05_expert import FusedPi05Expert, FusedPi0Expert


class Pi0ChunkPolicy(RealTimeChunkPolicy):
    '''A lerobot PI0Policy (LeRobot >= 0.6): the chunk, its cursor, the noise's rng counter and
    the last chunk's prefix are the arena state.'''

    kind = 'pi0'
    state_input = True      # sample_actions takes the padded state (Pi0.5's does not)
    fused_class = FusedPi0Expert    # denoise_kernels 'fused'
    checkpoint_options = RealTimeChunkPolicy.checkpoint_options + ('vision_dtype',)
    computation = ('paligemma_variant', 'action_expert_variant', 'dtype', 'chunk_size',
                   'max_state_dim', 'max_action_dim', 'num_inference_steps', 'min_period',
                   'max_period', 'image_resolution', 'empty_cameras')

    def __init__(self, lerobot_policy, stats=None, cameras=None, seed=0,
                 vision_dtype='float32', denoise_kernels='lerobot', prefix_kernels='lerobot',
                 **rtc):
        cfg = lerobot_policy.config
        release = version('lerobot')
        if tuple(int(p) for p in release.split('.')[:2]) < (0, 6):
            raise InvalidConfig(f'{self.kind}: LeRobot {release}\'s is not supported (it '
                                'needs a transformers fork); LeRobot 0.6.1\'s is '
                                '(requirements/vla-lerobot06.txt, Python >= 3.12)')
        if getattr(cfg, 'use_relative_actions', False):
            raise InvalidConfig(f'{self.kind}: relative actions are not supported yet')
        self.tokens = int(cfg.tokenizer_max_length)
        if vision_dtype not in ('float32', 'bfloat16'):
            raise InvalidConfig(f'{self.kind}: vision_dtype {vision_dtype!r}: float32 '
                                '(LeRobot\'s) or bfloat16')
        if vision_dtype == 'bfloat16' and cfg.dtype != 'bfloat16':
            raise InvalidConfig(f'{self.kind}: vision_dtype bfloat16 needs a bfloat16 model '
                                f'(the checkpoint\'s dtype is {cfg.dtype})')
        check_kernels(self.kind, denoise_kernels, prefix_kernels, rtc.get('rtc_delay', -1),
                      cfg.use_amp, f'vision_dtype {vision_dtype}' * (vision_dtype != 'float32'))
        super().__init__(lerobot_policy, stats, cameras, seed)
        self.setup_rtc(**rtc)
        self.vision_dtype = vision_dtype
        if vision_dtype == 'bfloat16':      # once nothing else can refuse the model
            vision_in_bfloat16(lerobot_policy)
        self.use_kernels(denoise_kernels, prefix_kernels)
        self.noise_shape = (1, self.chunk, int(cfg.max_action_dim))
        self.vocabulary = lerobot_policy.model.paligemma_with_expert.paligemma \
            .get_input_embeddings().num_embeddings

    def config(self):
        return {**super().config(), 'vision_dtype': self.vision_dtype}

    def fused_expert(self):
        return self.fused_class(self.lerobot.model, compiled)

    def _vlm(self):
        return self.lerobot.model.paligemma_with_expert

    def _prefix(self, batch):
        '''LeRobot's sample_actions up to the filled KV cache (its operations in order):
        ([(keys, values)] per layer, prefix pad mask).'''
        from lerobot.policies.common.vla_utils import make_att_2d_masks, \
            prepare_attention_masks_4d
        lerobot, model = self.lerobot, self.lerobot.model
        images, img_masks = lerobot._preprocess_images(batch)
        embs, pad, att = self._embed_prefix(images, img_masks, batch[TOKENS], batch[MASK])
        mask = prepare_attention_masks_4d(make_att_2d_masks(pad, att))
        model.paligemma_with_expert.paligemma.model.language_model.config \
            ._attn_implementation = 'eager'     # as sample_actions sets it
        _, kv = self._prefix_forward()(
            attention_mask=mask, position_ids=torch.cumsum(pad, dim=1) - 1,
            past_key_values=None, inputs_embeds=[embs, None], use_cache=True)
        return [(layer.keys, layer.values) for layer in kv.layers], pad

    def _denoise(self, batch):
        '''sample_actions' denoising steps (euler_integrate over denoise_step) against the
        static prefix, from the session's noise; then select_action's first n_action_steps,
        unnormalised.'''
        from lerobot.policies.common.flow_matching import euler_integrate
        state = {'state': self.lerobot.prepare_state(batch)} if self.state_input else {}
        if self.denoise_kernels == FUSED:
            return self._fused_chunk(**state)
        model, kv, pad = self.lerobot.model, self._dynamic_cache(), self._cache['prefix_pad']
        actions = euler_integrate(
            lambda x, t: model.denoise_step(prefix_pad_masks=pad, past_key_values=kv, x_t=x,
                                            timestep=t, **state),
            self.noise(self._chunk_rng), self.lerobot.config.num_inference_steps,
            **self._guidance)
        return self._chunk_outputs(actions)


def vision_in_bfloat16(lerobot_policy):
    '''Cast a LeRobot PI0Policy's / PI05Policy's SigLIP vision tower and projector to bfloat16,
    in place, and give them their images in bfloat16 (LeRobot's embed_image passes float32:
    get_image_features casts on entry; its float32 output is cast back by embed_image).'''
    model = lerobot_policy.model.paligemma_with_expert.paligemma.model
    model.vision_tower.to(torch.bfloat16)
    model.multi_modal_projector.to(torch.bfloat16)
    features = model.get_image_features
    model.get_image_features = lambda pixel_values, **kw: features(
        pixel_values.to(torch.bfloat16), **kw)


class Pi05ChunkPolicy(Pi0ChunkPolicy):
    '''A lerobot PI05Policy (LeRobot >= 0.6): the state reaches the model in the prompt's
    tokens (the module's note says what that asks of the observation).'''

    kind = 'pi05'
    state_input = False
    fused_class = FusedPi05Expert
