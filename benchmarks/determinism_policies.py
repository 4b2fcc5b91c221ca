"""The policies the determinism benchmark replays: every kind and dtype the package ships
(KINDS), built from fixed seeds (build), the two exported file formats written on the spot
(TorchScript, ONNX: an LSTM actor as Isaac Lab exports it), and the seeded observations.
"""

import os

import numpy as np
import torch

from flashrt_ros.runtime.policies import make_policy

OBS, ACT = 48, 12
KINDS = ('mlp', 'recurrent-lstm', 'recurrent-gru', 'history-float32', 'history-bfloat16',
         'history-float16', 'torchscript', 'onnx')


class _LstmActor(torch.nn.Module):
    """An exported recurrent actor as Isaac Lab writes it for ONNX: the memory goes in as
    inputs and comes back as outputs."""

    def __init__(self, hidden):
        super().__init__()
        self.rnn = torch.nn.LSTM(OBS, hidden)
        self.actor = torch.nn.Sequential(torch.nn.Linear(hidden, 128), torch.nn.ELU(),
                                         torch.nn.Linear(128, ACT))
        self.register_buffer('hidden_state', torch.zeros(1, 1, hidden))
        self.register_buffer('cell_state', torch.zeros(1, 1, hidden))

    def forward(self, x, h, c):
        y, (h2, c2) = self.rnn(x.unsqueeze(0), (h, c))
        return self.actor(y.squeeze(0)), h2, c2


class _ScriptedActor(_LstmActor):
    """The same for TorchScript: the memory lives in buffers that forward overwrites."""

    def forward(self, x):
        y, (h2, c2) = self.rnn(x.unsqueeze(0), (self.hidden_state, self.cell_state))
        self.hidden_state[:] = h2
        self.cell_state[:] = c2
        return self.actor(y.squeeze(0))


def policy_file(kind, hidden, folder):
    torch.manual_seed(3)
    if kind == 'torchscript':
        path = os.path.join(folder, 'policy.pt')
        torch.jit.script(_ScriptedActor(hidden)).save(path)
        return path
    path = os.path.join(folder, 'policy.onnx')
    z = torch.zeros(1, 1, hidden)
    torch.onnx.export(_LstmActor(hidden), (torch.zeros(1, OBS), z, z), path,
                      input_names=['obs', 'h_in', 'c_in'],
                      output_names=['actions', 'h_out', 'c_out'], dynamo=False)
    return path


def build(kind, cfg, device, folder):
    if kind in ('torchscript', 'onnx'):
        path = policy_file(kind, cfg['file_hidden'], folder)
        return make_policy('recurrent', OBS, ACT, file=path, device=device)
    if kind.startswith('history'):
        return make_policy('history', OBS, ACT, seed=1, device=device,
                           dtype=kind.split('-')[1], **cfg['history'])
    if kind.startswith('recurrent'):
        return make_policy('recurrent', OBS, ACT, seed=1, device=device,
                           rnn_type=kind.split('-')[1], **cfg['recurrent'])
    return make_policy('mlp', OBS, ACT, seed=1, device=device, **cfg['mlp'])


def observations(n, seed):
    return np.random.default_rng(seed).normal(0, 1, (n, OBS)).astype(np.float32)
