'''Policies and the registry from policy kind to (class, typed config).

A new kind costs one class (state_specs, step, reset_state; see base.Policy) and one line in
KINDS. make_policy() builds any kind from keyword arguments; build_policy() from a config.
'''

import torch

from ..config import ACTConfig, DiffusionConfig, HistoryConfig, MLPConfig, Pi05Config, \
    Pi0Config, RecurrentConfig, SmolVLAConfig
from ..enums import PolicyKind
from ..errors import InvalidConfig
from .base import ACTIVATIONS, gaussian_noise, ObservationHistory, Policy, TermHistory
from .feedforward import FeedForwardPolicy
from .history import HistoryPolicy, linear_scan
from .lerobot_checkpoint import checkpoint_type
from .lerobot_chunk import ACTChunkPolicy
from .lerobot_diffusion import DiffusionChunkPolicy
from .lerobot_pi0 import Pi05ChunkPolicy, Pi0ChunkPolicy
from .lerobot_smolvla import SmolVLAChunkPolicy
from .loaders import from_file, weights
from .recurrent import RecurrentPolicy
from .scripted import ScriptedPolicy

# kind -> (policy class built for the seeded demo and from state_dicts, its config)
KINDS = {
    PolicyKind.MLP: (FeedForwardPolicy, MLPConfig),
    PolicyKind.RECURRENT: (RecurrentPolicy, RecurrentConfig),
    PolicyKind.HISTORY: (HistoryPolicy, HistoryConfig),
    PolicyKind.SMOLVLA: (SmolVLAChunkPolicy, SmolVLAConfig),
    PolicyKind.ACT: (ACTChunkPolicy, ACTConfig),
    PolicyKind.DIFFUSION: (DiffusionChunkPolicy, DiffusionConfig),
    PolicyKind.PI0: (Pi0ChunkPolicy, Pi0Config),
    PolicyKind.PI05: (Pi05ChunkPolicy, Pi05Config),
}
LEROBOT_KINDS = (PolicyKind.SMOLVLA, PolicyKind.ACT,      # policy_file: a checkpoint folder
                 PolicyKind.DIFFUSION, PolicyKind.PI0, PolicyKind.PI05)

__all__ = ['ACTChunkPolicy', 'ACTIVATIONS', 'build_policy', 'DiffusionChunkPolicy',
           'FeedForwardPolicy', 'gaussian_noise', 'HistoryPolicy', 'KINDS', 'LEROBOT_KINDS',
           'linear_scan', 'make_policy', 'ObservationHistory', 'option_kinds', 'Pi05ChunkPolicy',
           'Pi0ChunkPolicy', 'Policy', 'RecurrentPolicy', 'ScriptedPolicy',
           'SmolVLAChunkPolicy', 'TermHistory']


def option_kinds():
    '''{checkpoint option (vision_dtype, rtc_*): the kinds whose policy class takes it}: what
    the node and the launch refuse for the other kinds, where the option would be ignored.'''
    out = {}
    for kind, (cls, _) in KINDS.items():
        for option in getattr(cls, 'checkpoint_options', ()):
            out.setdefault(option, []).append(kind)
    return {option: sorted(kinds) for option, kinds in out.items()}


def make_policy(kind, obs_dim, act_dim, *, file='', seed=0, device='cpu', activation='',
                obs_history=1, history_order='oldest_first', term_history=None, **sizes):
    '''Build a policy of `kind`: from `file` when given, else a seeded random initialisation
    (the global torch RNG is left untouched). With obs_history N > 1 the policy takes N
    stacked observations of obs_dim each (ObservationHistory). term_history: [(size,
    history_length)] per observation term (ObservationLayout.term_history()), or None: the
    policy takes each term's own window (TermHistory). Raises InvalidConfig.'''
    if kind not in KINDS:
        raise InvalidConfig(f'unknown policy kind {kind!r}; one of {sorted(KINDS)}')
    cls = KINDS[kind][0]
    if kind in LEROBOT_KINDS:
        extra = {k: v for k, v in sizes.items() if k not in cls.checkpoint_options}
        if extra or activation:
            raise InvalidConfig(f'a {kind} policy takes its sizes, activation and noise from '
                                f'its checkpoint, not {dict(extra, activation=activation)}')
        return _lerobot(cls, obs_dim, act_dim, file, seed, obs_history, term_history,
                        sizes).to(device)
    in_dim = obs_dim * obs_history
    if term_history:
        frame = sum(size for size, _ in term_history)
        if obs_history > 1:
            raise InvalidConfig('obs_history stacks whole observations; the observation '
                                'terms set their own history_length: use one or the other')
        if frame != obs_dim:
            raise InvalidConfig(f'the observation terms add up to {frame} values, obs_dim '
                                f'is {obs_dim}')
        in_dim = sum(size * frames for size, frames in term_history)
    try:
        if file and kind != PolicyKind.HISTORY:
            policy = from_file(kind, file, in_dim, act_dim, activation=activation, seed=seed,
                               **sizes)
        else:
            if activation and kind != PolicyKind.HISTORY:
                sizes['activation'] = activation
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                policy = cls(in_dim, act_dim, seed=seed, **sizes)
            if file:
                policy.load_state_dict(weights(file))
    except TypeError as exc:
        raise InvalidConfig(f'{kind} policy: {exc}') from exc
    if obs_history > 1:
        policy = ObservationHistory(policy, obs_history, history_order)
    elif term_history:
        policy = TermHistory(policy, term_history)
    return policy.to(device)


def _lerobot(cls, obs_dim, act_dim, folder, seed, obs_history, term_history, options):
    '''A LeRobot checkpoint folder's policy (options: the class's checkpoint_options); its
    sizes must be the ones asked for.'''
    if not folder:
        raise InvalidConfig(f'a {cls.kind} policy needs policy_file: a LeRobot checkpoint '
                            'folder (config.json, model.safetensors, the processor files)')
    if obs_history > 1 or term_history:
        raise InvalidConfig(f'a {cls.kind} policy takes one observation: no obs_history or '
                            'observation terms')
    found = checkpoint_type(folder)
    if found != cls.kind:   # (LeRobot would build one policy class on another's config)
        served = sorted(k.value for k in LEROBOT_KINDS)
        fix = f'set policy_type {found}' if found in served else \
            f'a policy this package does not serve (it serves {", ".join(served)})'
        raise InvalidConfig(f'{folder} holds a LeRobot {found} policy (its config.json), not '
                            f'{cls.kind}: {fix}')
    policy = cls.from_pretrained(folder, seed=seed, **options)
    if (policy.obs_dim, policy.act_dim) != (obs_dim, act_dim):
        raise InvalidConfig(f'{folder}: the checkpoint takes obs_dim {policy.obs_dim} (state '
                            f'{policy.state_dim}, cameras {policy.cameras}, {policy.tokens} '
                            f'tokens and their mask) and gives act_dim {policy.act_dim}, not '
                            f'{obs_dim} and {act_dim}')
    return policy


def build_policy(config, device='cpu', term_history=None):
    '''make_policy from a typed config (MLPConfig, RecurrentConfig, HistoryConfig);
    term_history: the observation terms' windows (make_policy).'''
    kind = next(k for k, (_, c) in KINDS.items() if type(config) is c)
    options = config.options()
    if config.noise_std > 0:
        options['noise_std'] = config.noise_std
    if config.policy_file and kind not in (PolicyKind.HISTORY, *LEROBOT_KINDS):
        options = {k: v for k, v in options.items() if k == 'noise_std'}   # the file's sizes
    return make_policy(kind, config.obs_dim, config.act_dim, file=config.policy_file,
                       seed=config.seed, device=device, activation=config.activation,
                       obs_history=config.obs_history, history_order=config.history_order,
                       term_history=term_history, **options)
