'''LeRobot's Diffusion Policy on the engine: the last n_obs_steps observations (cameras and
state) condition a denoising of `horizon` actions (the config's DDPM or DDIM scheduler and its
inference steps), of which n_action_steps, from the current observation on, are the chunk.

Its execution state, all in the arena: the observation history (the raw observation vectors,
oldest first; at an episode's first step filled with that observation, as LeRobot's
populate_queues does), the chunk and how many of its actions are left, and the rng buffer the
chunk's noise comes from. LeRobot draws that noise from torch's generator (the prior and, with
DDPM, every step's variance): here the device's generator is seeded for each chunk from the
session's rng buffer (chunk_seed(seed, counter)) inside torch.random.fork_rng, so that no other
user of the generator sees it move and a restored capsule draws the same noise. On CUDA the
chunk is one captured graph, whose random draws take the seed the generator holds at each
replay. Given the same inputs and that seed, the actions are LeRobot's pipeline bit for bit on
the same device (test/unit/test_lerobot_chunk.py).
'''

import torch

from ..state import BufferSpec
from .lerobot_checkpoint import STATE
from .lerobot_chunk import LeRobotChunkPolicy

IMAGES = 'observation.images'       # LeRobot's key for the cameras stacked


def chunk_seed(seed, counter):
    '''The generator's seed for the chunk drawn at rng buffer (seed, counter): splitmix64 of
    both, so that every bit of each reaches the low 32 bits (all the CPU generator keeps).'''
    mask = (1 << 64) - 1
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(counter) + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


class DiffusionChunkPolicy(LeRobotChunkPolicy):
    '''A lerobot DiffusionPolicy (cameras and state; no environment-state input yet).'''

    kind = 'diffusion'
    computation = ('n_obs_steps', 'horizon', 'vision_backbone', 'resize_shape', 'crop_ratio',
                   'crop_shape', 'use_group_norm', 'spatial_softmax_num_keypoints',
                   'use_separate_rgb_encoder_per_camera', 'down_dims', 'kernel_size',
                   'n_groups', 'diffusion_step_embed_dim', 'use_film_scale_modulation',
                   'noise_scheduler_type', 'num_train_timesteps', 'beta_schedule',
                   'beta_start', 'beta_end', 'prediction_type', 'clip_sample',
                   'clip_sample_range', 'num_inference_steps')

    def __init__(self, lerobot_policy, stats=None, cameras=None, seed=0):
        cfg = lerobot_policy.config
        super().__init__(lerobot_policy, stats, cameras, seed)
        self.history = self.chunk_inputs = int(cfg.n_obs_steps)
        # LeRobot queues the horizon's actions from the current observation on, at most
        # n_action_steps: fewer where n_action_steps > horizon - n_obs_steps + 1 (its config
        # accepts that; the next chunk then comes sooner)
        self.steps = min(self.steps, self.chunk - self.history + 1)
        self.order = list(cfg.image_features)       # how LeRobot stacks the cameras

    def state_specs(self):
        return super().state_specs() + [
            BufferSpec('history', (self.history, self.obs_dim), torch.float32, 'history'),
            BufferSpec('begun', (1,), torch.int64, 'history'), self._rng_spec()]

    def device_generator(self):
        '''The generator LeRobot's draws on the policy's device use, and a fork_rng that
        keeps it (and the CPU's) as they were.'''
        if self.device.type == 'cuda':
            index = self.device.index if self.device.index is not None else \
                torch.cuda.current_device()
            return torch.cuda.default_generators[index], torch.random.fork_rng([index])
        return torch.default_generator, torch.random.fork_rng([])

    def capture(self, enabled):
        # warm-up and capture draw noise: from a forked generator, as every chunk
        with self.device_generator()[1]:
            super().capture(enabled)

    @torch.no_grad()
    def _chunk_fn(self):
        # LeRobot's queues hold each observation normalised as it came; normalising the raw
        # history here runs the same elementwise operations on the same values
        with self.autocast():
            rows = [self._inputs(o) for o in self._chunk_obs.view(self.history, -1)]
            batch = {STATE: torch.stack([r[STATE] for r in rows], dim=1),
                     IMAGES: torch.stack([torch.stack([r[k] for k in self.order], dim=-4)
                                          for r in rows], dim=1)}
            actions = self.lerobot.diffusion.generate_actions(batch)[0]
            self._chunk_out = {'queue': self._normalised('action', actions, True)}

    def _replay(self, history):
        seed, counter = self.views['rng'].tolist()      # one read of the device, per chunk
        generator, forked = self.device_generator()
        with forked:
            generator.manual_seed(chunk_seed(seed, counter))
            return super()._replay(history)

    @torch.no_grad()
    def step(self, obs, action):
        v = self.views
        history, begun = v['history'], v['begun']
        # populate_queues on the device, no host branch: the first observation of an episode
        # fills the history, each later one moves it along
        moved = torch.cat([history[1:], obs.view(1, -1)])
        history.copy_(torch.where(begun == 0, obs.view(1, -1).expand_as(history), moved))
        begun.fill_(1)
        super().step(history.view(-1), action)
