'''Recurrent actor: [normalizer] -> [MLP encoder] -> LSTM/GRU -> MLP head (rsl_rl / Isaac Lab
ActorCriticRecurrent), built from checkpoints and state_dicts (TorchScript files run as
they are: see scripted.py).'''

import contextlib
import inspect

import torch
import torch.nn as nn

from ..enums import PolicyKind
from ..errors import InvalidConfig
from ..state import BufferSpec
from .base import mlp, Policy
from .invariant import rnn_step, sequential


# what torch.backends.cudnn.flags() sets (its parameters differ between torch versions)
_CUDNN_FLAGS = tuple(inspect.signature(torch.backends.cudnn.flags).parameters)


def _fp32_for_batches(x):
    '''cuDNN may run a batched LSTM/GRU in TF32 (torch.backends.cudnn.allow_tf32 is on by
    default): measured on the H200, a fleet's actions then differ from one session's by ~1e-4.
    A batch of sessions (x [1, B > 1, in] on CUDA) keeps float32 (the flag is read when the
    kernels are chosen, i.e. at capture); a single session runs exactly as the exporter does
    under the user's settings, and the CPU never uses cuDNN.'''
    if x.shape[1] == 1 or not x.is_cuda:
        return contextlib.nullcontext()
    c = torch.backends.cudnn
    # flags() sets every flag it names (its defaults would turn cuDNN off): pass the current
    # values, with float32 asked for in both the old and the new (fp32_precision) spelling
    names = _CUDNN_FLAGS
    current = {name: getattr(c, name) for name in names if hasattr(c, name)}
    current['allow_tf32'] = False
    if 'fp32_precision' in names:
        current['fp32_precision'] = 'ieee'
    return c.flags(**current)


class RecurrentPolicy(Policy):
    '''[normalizer] -> [MLP encoder] -> LSTM/GRU -> MLP head: the rsl_rl / Isaac Lab
    recurrent actor (ActorCriticRecurrent.act_inference). Submodule names follow the
    exporter's policy.pt ('rnn', 'actor'), so its weights load by name.

    State: 'hidden_state' (and 'cell_state' for LSTM) [num_layers, hidden] (batch 1 folded),
    'rng' (seed, counter) for optional Gaussian action noise of std `noise_std`.
    '''

    kind = PolicyKind.RECURRENT
    batched = True

    def __init__(self, obs_dim, act_dim, *, rnn_type='lstm', rnn_hidden_dim=256,
                 rnn_num_layers=1, encoder_dims=(), actor_hidden_dims=(256, 128, 64),
                 activation='elu', normalize=False, norm_eps=1e-2, noise_std=0.0, seed=0):
        super().__init__(obs_dim, act_dim, 0, noise_std, seed)
        rnn_type = rnn_type.lower()
        if rnn_type not in ('lstm', 'gru'):
            raise InvalidConfig(f"rnn_type must be 'lstm' or 'gru', got {rnn_type!r}")
        self.rnn_type, self.activation = rnn_type, activation
        self.encoder_dims, self.actor_hidden_dims = tuple(encoder_dims), tuple(actor_hidden_dims)
        self.normalize, self.norm_eps = bool(normalize), float(norm_eps)
        if self.normalize:
            # EmpiricalNormalization: (x - _mean) / (_std + eps), [1, obs_dim] buffers
            self.register_buffer('norm_mean', torch.zeros(1, obs_dim))
            self.register_buffer('norm_std', torch.ones(1, obs_dim))
        self.encoder = mlp(obs_dim, self.encoder_dims, None, activation)
        rnn_in = self.encoder_dims[-1] if self.encoder_dims else obs_dim
        cls = nn.LSTM if rnn_type == 'lstm' else nn.GRU
        self.rnn = cls(rnn_in, rnn_hidden_dim, rnn_num_layers)
        self.actor = mlp(rnn_hidden_dim, self.actor_hidden_dims, act_dim, activation)
        self.requires_grad_(False)
        self.eval()

    def config(self):
        return {**super().config(), 'rnn_type': self.rnn_type, 'activation': self.activation,
                'normalize': self.normalize, 'norm_eps': self.norm_eps}

    def state_specs(self):
        shape = (self.rnn.num_layers, self.rnn.hidden_size)
        dtype = self.rnn.weight_hh_l0.dtype
        specs = [BufferSpec('hidden_state', shape, dtype, 'recurrent')]
        if self.rnn_type == 'lstm':
            specs.append(BufferSpec('cell_state', shape, dtype, 'recurrent'))
        return specs + [self._rng_spec()]

    @torch.no_grad()
    def step(self, obs, action):
        # same op sequence and shapes as the exporter's forward on x [1, obs_dim], so the
        # actions match it bit for bit on the same device
        # and a batch of sessions is the same computation with batch B > 1
        x = obs.view(-1, self.obs_dim).to(self.rnn.weight_hh_l0.dtype)     # [B, obs]
        if self.normalize:
            x = (x - self.norm_mean) / (self.norm_std + self.norm_eps)
        hidden = self.views['hidden_state']                       # [L, H] or [B, L, H]
        if self.kernels == 'batch_invariant':
            self._act(self._invariant_step(x, hidden).view(action.shape), action)
            return
        x = self.encoder(x).unsqueeze(0)                                     # [1, B, in]

        def as_rnn(state):      # -> [L, B, H], the rnn's layout (a copy only when B > 1)
            return (state.unsqueeze(1) if state.dim() == 2 else state.transpose(0, 1)
                    ).contiguous()

        def write(state, new):  # [L, B, H] back into the arena's layout
            state.copy_(new.view_as(state) if state.dim() == 2 else new.transpose(0, 1))

        with _fp32_for_batches(x):
            if self.rnn_type == 'lstm':
                cell = self.views['cell_state']
                out, (h, c) = self.rnn(x, (as_rnn(hidden), as_rnn(cell)))
                write(cell, c)
            else:
                out, h = self.rnn(x, as_rnn(hidden))
        write(hidden, h)
        self._act(self.actor(out.squeeze(0)).view(action.shape), action)

    def _invariant_step(self, x, hidden):
        """The same step on invariant.py's kernels: every row as if alone. State views as
        [B, L, H] (one session: [1, L, H], a view)."""
        def rows(state):
            return state.unsqueeze(0) if state.dim() == 2 else state

        cell = rows(self.views['cell_state']) if self.rnn_type == 'lstm' else None
        x = sequential(self.encoder, x) if len(self.encoder) else x
        out = rnn_step(self.rnn, x, rows(hidden), cell)
        return sequential(self.actor, out)
