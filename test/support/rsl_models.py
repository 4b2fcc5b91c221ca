"""The module layouts rsl_rl / Isaac Lab export a recurrent actor in (TorchScript policy.pt),
rebuilt in torch: the empirical normalizer, the LSTM and GRU exporters' modules and the actor
MLP (32 inputs: the RNN's hidden size)."""
import torch
import torch.nn as nn


class Normalizer(nn.Module):
    # rsl_rl EmpiricalNormalization's inference path: (x - _mean) / (_std + eps)
    def __init__(self, n):
        super().__init__()
        self.eps = 1e-2
        self.register_buffer('_mean', torch.randn(1, n))
        self.register_buffer('_var', torch.rand(1, n) + 0.5)
        self.register_buffer('_std', self._var.sqrt())
        self.register_buffer('count', torch.tensor(100, dtype=torch.long))

    def forward(self, x):
        return (x - self._mean) / (self._std + self.eps)


class ExportedLSTM(nn.Module):
    # the layout rsl_rl / Isaac Lab's _TorchPolicyExporter scripts into policy.pt
    def __init__(self, actor, rnn, normalizer):
        super().__init__()
        self.actor, self.rnn, self.normalizer = actor, rnn, normalizer
        self.register_buffer('hidden_state', torch.zeros(rnn.num_layers, 1, rnn.hidden_size))
        self.register_buffer('cell_state', torch.zeros(rnn.num_layers, 1, rnn.hidden_size))

    def forward(self, x):
        x = self.normalizer(x)
        x, (h, c) = self.rnn(x.unsqueeze(0), (self.hidden_state, self.cell_state))
        self.hidden_state[:] = h
        self.cell_state[:] = c
        return self.actor(x.squeeze(0))

    @torch.jit.export
    def reset(self):
        self.hidden_state[:] = 0.0
        self.cell_state[:] = 0.0


class ExportedGRU(ExportedLSTM):
    def forward(self, x):
        x = self.normalizer(x)
        x, h = self.rnn(x.unsqueeze(0), self.hidden_state)
        self.hidden_state[:] = h
        return self.actor(x.squeeze(0))


def rsl_actor(activation, act_dim):
    act = {'elu': nn.ELU, 'tanh': nn.Tanh}[activation]
    return nn.Sequential(nn.Linear(32, 32), act(), nn.Linear(32, 16), act(),
                         nn.Linear(16, act_dim))
