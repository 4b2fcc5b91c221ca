'''Feed-forward actor: [normalizer] -> MLP (rsl_rl / Isaac Lab ActorCritic, legged_gym,
rl_sar), built from checkpoints and state_dicts (TorchScript files run as they are: see
scripted.py).'''

import torch

from ..enums import PolicyKind
from .base import mlp, Policy
from .invariant import sequential


class FeedForwardPolicy(Policy):
    '''[normalizer] -> MLP actor (ActorCritic.act_inference). Keys follow rsl_rl: 'actor.*',
    'norm_mean' / 'norm_std' for EmpiricalNormalization's _mean / _std.

    State: only 'rng' (seed, counter) for optional Gaussian action noise; with obs_history
    the stacked window is state too (ObservationHistory). Nothing else decides the action.
    '''

    kind = PolicyKind.MLP
    batched = True

    def __init__(self, obs_dim, act_dim, *, actor_hidden_dims=(256, 128, 64), activation='elu',
                 normalize=False, norm_eps=1e-2, noise_std=0.0, seed=0):
        super().__init__(obs_dim, act_dim, 0, noise_std, seed)
        self.activation, self.actor_hidden_dims = activation, tuple(actor_hidden_dims)
        self.normalize, self.norm_eps = bool(normalize), float(norm_eps)
        if self.normalize:
            self.register_buffer('norm_mean', torch.zeros(1, obs_dim))
            self.register_buffer('norm_std', torch.ones(1, obs_dim))
        self.actor = mlp(obs_dim, self.actor_hidden_dims, act_dim, activation)
        self.requires_grad_(False)
        self.eval()

    def config(self):
        return {**super().config(), 'activation': self.activation,
                'actor_hidden_dims': self.actor_hidden_dims, 'normalize': self.normalize,
                'norm_eps': self.norm_eps}

    def state_specs(self):
        return [self._rng_spec()]

    @torch.no_grad()
    def step(self, obs, action):
        # [sessions, obs]; one session is the exporter's own input shape [1, obs]
        x = obs.view(-1, self.obs_dim).to(self.actor[0].weight.dtype)
        if self.normalize:
            x = (x - self.norm_mean) / (self.norm_std + self.norm_eps)
        out = sequential(self.actor, x) if self.kernels == 'batch_invariant' \
            else self.actor(x)
        self._act(out.view(action.shape), action)
