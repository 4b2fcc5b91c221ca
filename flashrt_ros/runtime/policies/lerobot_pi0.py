'''LeRobot's Pi0 and Pi0.5 on the engine (LeRobot 0.6; lerobot_chunk.py says how the chunk policies
work): LeRobot's own sample_actions, PaliGemma's pass over the prefix (SigLIP over each camera,
the instruction's tokens) into a KV cache, then num_inference_steps flow-matching steps of the
Gemma action expert against it, as one captured CUDA graph on CUDA. The arena holds the chunk,
how many of its actions are left and the rng counter its noise is drawn from. The prefix cache
lives inside one chunk's computation (every chunk computes it from its own observation, and no
step runs between its prefix pass and its denoising), so a capsule taken between steps holds all
the next step reads.

The observation vector is SmolVLA's: the state, each camera's image in [0, 1] (3 x H x W), the
instruction's token ids (tokenizer_max_length) and their attention mask. Given the same inputs
and noise, the actions are LeRobot's (its normaliser, predict_action_chunk, its unnormaliser)
bit for bit on the same device (test/unit/test_lerobot_pi0.py).

Pi0.5 (Pi05ChunkPolicy) differs in its inputs: its pre-processor writes the state,
normalised (quantiles by default) and discretised into 256 bins, into the prompt before
tokenizing, and the model reads no other state. So the token ids of its observation change
with the state and must come from the checkpoint's pre-processor run on that observation
(vla_inputs does not do that yet and refuses a Pi0.5 checkpoint); the state part of the vector
is normalised and otherwise unused.

LeRobot 0.4's Pi0 and Pi0.5 need a transformers fork that is not on PyPI and are refused; so
are real-time chunking and relative actions (not yet).
'''

from importlib.metadata import version

from ..errors import InvalidConfig
from .lerobot_checkpoint import MASK, TOKENS
from .lerobot_chunk import LanguageChunkPolicy


class Pi0ChunkPolicy(LanguageChunkPolicy):
    '''A lerobot PI0Policy (LeRobot >= 0.6): the chunk, its cursor and the noise's rng counter
    are the arena state.'''

    kind = 'pi0'
    state_input = True      # sample_actions takes the padded state (Pi0.5's does not)
    computation = ('paligemma_variant', 'action_expert_variant', 'dtype', 'chunk_size',
                   'max_state_dim', 'max_action_dim', 'num_inference_steps', 'min_period',
                   'max_period', 'image_resolution', 'empty_cameras')

    def __init__(self, lerobot_policy, stats=None, cameras=None, seed=0):
        cfg = lerobot_policy.config
        release = version('lerobot')
        if tuple(int(p) for p in release.split('.')[:2]) < (0, 6):
            raise InvalidConfig(f'{self.kind}: LeRobot {release}\'s is not supported (it '
                                'needs a transformers fork); LeRobot 0.6.1\'s is '
                                '(requirements/vla-lerobot06.txt, Python >= 3.12)')
        if cfg.rtc_config is not None or getattr(cfg, 'use_relative_actions', False):
            raise InvalidConfig(f'{self.kind}: real-time chunking and relative actions are not '
                                'supported yet')
        self.tokens = int(cfg.tokenizer_max_length)
        super().__init__(lerobot_policy, stats, cameras, seed)
        self.noise_shape = (1, self.chunk, int(cfg.max_action_dim))
        self.vocabulary = lerobot_policy.model.paligemma_with_expert.paligemma \
            .get_input_embeddings().num_embeddings

    def state_specs(self):
        return super().state_specs() + [self._rng_spec()]

    def _chunk(self, batch):
        '''PI0Policy.predict_action_chunk with the session's noise, then select_action's
        first n_action_steps, unnormalised.'''
        lerobot = self.lerobot
        images, img_masks = lerobot._preprocess_images(batch)
        state = (lerobot.prepare_state(batch),) if self.state_input else ()
        actions = lerobot.model.sample_actions(images, img_masks, batch[TOKENS], batch[MASK],
                                               *state, noise=self.noise(self._chunk_rng))
        return {'queue': self._normalised('action', actions[0, :self.steps, :self.act_dim],
                                          True)}


class Pi05ChunkPolicy(Pi0ChunkPolicy):
    '''A lerobot PI05Policy (LeRobot >= 0.6): the state reaches the model in the prompt's
    tokens (the module's note says what that asks of the observation).'''

    kind = 'pi05'
    state_input = False
