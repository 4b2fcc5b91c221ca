'''Policy files that take a stacked window of observations, made by the libraries that define
the formats (torch.jit.script, torch.onnx.export), as the projects that ship them export them.

- humanoid-gym (roboterax/humanoid-gym, humanoid/utils/helpers.py export_policy_as_jit): the
  bare rsl_rl actor scripted; 15 frames of 47 observations, oldest first (a deque filled with
  zeros at reset, the newest frame appended last), 12 actions.
- HIMLoco (OpenRobotLab/HIMLoco, legged_gym/utils/helpers.py PolicyExporterHIM): the
  estimator's encoder and the actor in one module; 6 frames of 45, newest first (the actor
  reads the current frame as obs_history[:, 0:45]), 12 actions. Its ONNX export traces the
  same module with torch.onnx.export on a [1, 270] input.

Neither project is installable from PyPI: the modules are rebuilt from their source (the
actor an rsl_rl-style Sequential of Linear and ELU), with seeded weights; nothing is trained.
Each file is written once per output folder and reused.
'''

import copy
import pathlib
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# name -> (frame_dim, frames, order, act_dim)
LAYOUTS = {
    'humanoid_gym': (47, 15, 'oldest_first', 12),
    'himloco': (45, 6, 'newest_first', 12),
}
ONNX_EXPORTERS = {'dynamo18': (True, 18), 'legacy11': (False, 11)}


def _actor(in_dim, hidden, out_dim):
    # rsl_rl ActorCritic.actor: Linear, ELU, ..., Linear
    layers, dims = [], [in_dim, *hidden]
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.ELU()]
    return nn.Sequential(*layers, nn.Linear(dims[-1], out_dim))


class PolicyExporterHIM(nn.Module):
    '''HIMLoco's PolicyExporterHIM: the estimator encoder gives velocity (3) and a latent (16,
    normalised); the actor takes the current frame, the velocity and the latent.'''

    def __init__(self, actor, encoder, frame_dim):
        super().__init__()
        self.actor = copy.deepcopy(actor)
        self.estimator = copy.deepcopy(encoder)
        self.frame_dim = frame_dim

    def forward(self, obs_history):
        parts = self.estimator(obs_history)[:, 0:19]
        vel, z = parts[..., :3], parts[..., 3:]
        z = F.normalize(z, dim=-1, p=2.0)
        return self.actor(torch.cat((obs_history[:, 0:self.frame_dim], vel, z), dim=1))


def module(name, seed=0):
    '''The torch module the project exports for layout `name`, seeded weights, eval mode.'''
    frame_dim, frames, _, act_dim = LAYOUTS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == 'humanoid_gym':
            built = _actor(frame_dim * frames, [512, 256, 128], act_dim)
        else:
            encoder = _actor(frame_dim * frames, [128, 64], 19)
            built = PolicyExporterHIM(_actor(frame_dim + 19, [512, 256, 128], act_dim),
                                      encoder, frame_dim)
    return built.eval().requires_grad_(False)


def torchscript(name, folder):
    '''The TorchScript file (torch.jit.script of the module, as both projects save it).'''
    path = pathlib.Path(folder) / f'{name}_policy.pt'
    if not path.is_file():
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', DeprecationWarning)     # torch.jit's notice
            torch.jit.script(module(name)).save(str(path))
    return str(path)


def onnx_file(name, folder, exporter='dynamo18'):
    '''The ONNX file torch.onnx.export writes for the module on a [1, frames * frame_dim]
    input (HIMLoco's export_policy_as_onnx), with torch's dynamo exporter (its default since
    2.9) or the TorchScript-based one at opset 11.'''
    dynamo, opset = ONNX_EXPORTERS[exporter]
    path = pathlib.Path(folder) / f'{name}_{exporter}.onnx'
    if not path.is_file():
        frame_dim, frames, _, _ = LAYOUTS[name]
        extra = {} if dynamo else {'dynamo': False}
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')     # exporter chatter (deprecations, opset notes)
            torch.onnx.export(module(name), (torch.zeros(1, frames * frame_dim),), str(path),
                              export_params=True, opset_version=opset, input_names=['obs'],
                              output_names=['actions'], dynamic_axes={}, **extra)
    return str(path)


def windows(frames_seen, frames, order):
    '''What the project's deploy loop feeds the file, built by hand: for each step t the last
    `frames` observations of `frames_seen` [T, frame_dim], zeros before the first, oldest or
    newest first, flattened: [T, frames * frame_dim].'''
    frames_seen = np.asarray(frames_seen, dtype=np.float32)
    padded = np.concatenate([np.zeros((frames - 1, frames_seen.shape[1]), np.float32),
                             frames_seen])
    out = []
    for t in range(len(frames_seen)):
        window = padded[t:t + frames]            # oldest first: the newest is the last row
        if order == 'newest_first':
            window = window[::-1]
        out.append(window.reshape(-1))
    return np.stack(out)
