'''Policy files -> policies: TorchScript exports (adopted, see scripted.py), rsl_rl
checkpoints of every version, plain state_dicts (.pt / .safetensors), ONNX (onnx.py).

Nothing is guessed that changes actions: sizes come from weight shapes; an activation that
a file does not record must be given (InvalidConfig names the parameter otherwise); a
parameter that contradicts the file is refused.
'''

import warnings

import torch

from ..enums import PolicyKind
from ..errors import InvalidConfig
from .base import ACTIVATIONS
from .feedforward import FeedForwardPolicy
from .recurrent import RecurrentPolicy
from .scripted import ScriptedPolicy

# checkpoint key prefixes of rsl_rl 2.x/3.x (ActorCritic[Recurrent], StudentTeacher*), rsl_rl
# >= 4 (actor_state_dict: 'mlp', 'rnn.rnn', 'obs_normalizer') and legged_gym -> ours
_PREFIXES = (
    ('memory_a.rnn.', 'rnn.'), ('memory_s.rnn.', 'rnn.'), ('rnn.rnn.', 'rnn.'),
    ('actor.', 'actor.'), ('student.', 'actor.'), ('mlp.', 'actor.'),
    ('actor_obs_normalizer._mean', 'norm_mean'), ('actor_obs_normalizer._std', 'norm_std'),
    ('student_obs_normalizer._mean', 'norm_mean'), ('student_obs_normalizer._std', 'norm_std'),
    ('obs_normalizer._mean', 'norm_mean'), ('obs_normalizer._std', 'norm_std'),
    ('normalizer._mean', 'norm_mean'), ('normalizer._std', 'norm_std'),
)
_OURS = ('rnn.', 'encoder.', 'norm_mean', 'norm_std')


def _canonical(state_dict):
    '''rsl_rl / legged_gym / our own keys -> ours; everything else (critic, std, optimiser)
    is dropped.'''
    out = {}
    for key, value in state_dict.items():
        if not torch.is_tensor(value):
            continue
        for old, new in _PREFIXES:
            if key.startswith(old):
                out[new + key[len(old):]] = value
                break
        else:
            if key.startswith(_OURS):
                out[key] = value
    return out


def _linears(state_dict, prefix):
    keys = sorted((int(k.split('.')[1]), k) for k in state_dict
                  if k.startswith(prefix) and k.endswith('.weight')
                  and k.split('.')[1].isdigit())
    return [tuple(state_dict[k].shape) for _, k in keys]


def _read_state_dict(path):
    if str(path).endswith('.safetensors'):
        from safetensors.torch import load_file
        return load_file(path)
    try:
        data = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as exc:  # noqa: B902 - pickle, zip and format errors all mean "not this"
        raise InvalidConfig(f'{path}: neither TorchScript nor a torch state_dict/checkpoint '
                            f'({exc.__class__.__name__}: {str(exc)[:200]})') from exc
    if not isinstance(data, dict):
        raise InvalidConfig(f'{path}: holds a {type(data).__name__}, not a state_dict')
    # rsl_rl <= 3 (and Isaac Lab) checkpoints: 'model_state_dict'; rsl_rl >= 4: one dict per
    # model, the actor's under 'actor_state_dict'
    for key in ('actor_state_dict', 'model_state_dict', 'state_dict'):
        if isinstance(data.get(key), dict):
            return data[key]
    return data


def _describe(state_dict):
    shown = [f'{k} {list(v.shape)}' for k, v in list(state_dict.items())[:12]]
    more = len(state_dict) - len(shown)
    return ', '.join(shown) + (f' and {more} more' if more > 0 else '')


def _io_dims(sd, recurrent):
    if recurrent:
        encoder = _linears(sd, 'encoder.')
        obs = encoder[0][1] if encoder else sd['rnn.weight_ih_l0'].shape[1]
    else:
        obs = _linears(sd, 'actor.')[0][1]
    return int(obs), int(_linears(sd, 'actor.')[-1][0])


def from_state_dict(kind, raw, obs_dim, act_dim, *, activation, source='state_dict',
                    **options):
    '''FeedForwardPolicy or RecurrentPolicy from a checkpoint's or plain state_dict.'''
    sd = _canonical(raw)
    recurrent = 'rnn.weight_ih_l0' in sd
    if not _linears(sd, 'actor.'):
        raise InvalidConfig(f'{source}: no actor weights found (expected rsl_rl / legged_gym '
                            "keys 'actor.N.weight', 'mlp.N.weight', 'memory_a.rnn.*' or "
                            f"'rnn.rnn.*'); it holds {_describe(raw)}")
    if kind == PolicyKind.MLP and recurrent:
        raise InvalidConfig(f'{source}: holds recurrent weights (rnn.*): set policy_type '
                            "'recurrent'")
    if kind == PolicyKind.RECURRENT and not recurrent:
        raise InvalidConfig(f'{source}: holds no recurrent weights (memory_a.rnn.* or '
                            "rnn.rnn.*): set policy_type 'mlp'")
    if not activation:
        raise InvalidConfig(f'{source}: a state_dict does not record its activation: set the '
                            f"parameter 'activation' (one of {sorted(ACTIVATIONS)}; rsl_rl "
                            "and Isaac Lab default to 'elu')")
    file_obs, file_act = _io_dims(sd, recurrent)
    if (file_obs, file_act) != (obs_dim, act_dim):
        raise InvalidConfig(f'{source}: the weights take {file_obs} observations and give '
                            f'{file_act} actions; configured {obs_dim} and {act_dim}')
    actor = _linears(sd, 'actor.')
    # EmpiricalNormalization's eps is fixed at 1e-2 by every rsl_rl version's runner
    sizes = {'actor_hidden_dims': tuple(s[0] for s in actor[:-1]),
             'normalize': 'norm_mean' in sd, 'activation': activation,
             'noise_std': options.get('noise_std', 0.0), 'seed': options.get('seed', 0)}
    if recurrent:
        w_ih, w_hh = sd['rnn.weight_ih_l0'], sd['rnn.weight_hh_l0']
        gates = w_ih.shape[0] // w_hh.shape[1]
        if gates not in (3, 4):
            raise InvalidConfig(f'{source}: rnn.weight_ih_l0 {list(w_ih.shape)} is neither '
                                'LSTM nor GRU')
        layers = 1 + max(int(k.rsplit('_l', 1)[1]) for k in sd
                         if k.startswith('rnn.weight_ih_l'))
        sizes.update(rnn_type='lstm' if gates == 4 else 'gru', rnn_hidden_dim=w_hh.shape[1],
                     rnn_num_layers=layers,
                     encoder_dims=tuple(s[0] for s in _linears(sd, 'encoder.')))
        policy = RecurrentPolicy(obs_dim, act_dim, **sizes)
    else:
        policy = FeedForwardPolicy(obs_dim, act_dim, **sizes)
    ours = policy.state_dict()
    for key in ('norm_mean', 'norm_std'):
        if key in sd:          # EmpiricalNormalization keeps [1, obs]; accept [obs] too
            sd[key] = sd[key].reshape(ours[key].shape)
    missing = sorted(set(ours) - set(sd))
    if missing:
        raise InvalidConfig(f'{source}: lacks {missing[:4]}; it holds {_describe(raw)}')
    policy.load_state_dict({k: sd[k] for k in ours})
    return policy


def load_torchscript(path):
    '''The scripted module in `path`, or None when the file is not TorchScript.'''
    try:
        with warnings.catch_warnings():
            # rsl_rl / Isaac Lab still export TorchScript; torch's deprecation notice is noise
            warnings.simplefilter('ignore', DeprecationWarning)
            return torch.jit.load(path, map_location='cpu')
    except (RuntimeError, ValueError):
        return None


def from_file(kind, path, obs_dim, act_dim, *, activation='', **options):
    '''A policy of `kind` ('mlp' | 'recurrent') from any supported file.'''
    if str(path).endswith('.onnx'):
        from .onnx import from_onnx
        return from_onnx(kind, path, obs_dim, act_dim, activation=activation, **options)
    module = load_torchscript(path)
    if module is not None:
        return ScriptedPolicy(module, obs_dim, act_dim, kind=kind, activation=activation,
                              noise_std=options.get('noise_std', 0.0),
                              seed=options.get('seed', 0), source=str(path))
    return from_state_dict(kind, _read_state_dict(path), obs_dim, act_dim,
                           activation=activation, source=str(path), **options)


def weights(path):
    '''A plain state_dict (history policies load their own keys).'''
    return _read_state_dict(path)
