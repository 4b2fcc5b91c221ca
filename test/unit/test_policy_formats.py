'''Every real policy file format, through the engine, bit for bit against the file itself.

The files are made by the code that defines each format (test/support/policy_exports.py: rsl_rl
3.x and >= 4 runners, Isaac Lab's and legged_gym's exporters) plus Unitree's shipped G1 policy.
For each: 200 seeded observations through PolicyEngine give exactly the actions of the file
run directly (TorchScript under torch.no_grad(), checkpoints through rsl_rl's own inference
policy); a snapshot/restore replays exactly; reset_episode gives the first episode again; on
CUDA the captured graph gives exactly the eager engine's actions. Refusals name the problem.
'''

import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from support import policy_exports

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.errors import InvalidConfig
from flashrt_ros.runtime.policies import make_policy

NAMES = policy_exports.format_names()
FILE_STATED = [n for n in NAMES if '_ckpt_' not in n and '_state_dict_' not in n]
NOT_STATED = [n for n in NAMES if n not in FILE_STATED]


@pytest.fixture(scope='module')
def export_for(tmp_path_factory):
    '''name -> Export; the rsl_rl formats are built once per module, on first use.'''
    built = {}

    def get(name):
        if name == 'unitree_g1_motion':
            if not policy_exports.G1_FILE.is_file():
                pytest.skip(f'{policy_exports.G1_FILE} is absent (the ../shared folder beside '
                            'the repository holds the real Unitree G1 policy)')
            return policy_exports.g1_export()
        reason = policy_exports.missing_reason()
        if reason:
            pytest.skip(reason)
        if not built:
            built.update(policy_exports.build_all(tmp_path_factory.mktemp('exports')))
        return built[name]
    return get


def make(export, **overrides):
    '''The policy as a user configures it: activation only where the file does not state it.'''
    kwargs = dict(file=export.path, seed=0)
    if not export.states_activation:
        kwargs['activation'] = export.activation
    kwargs.update(overrides)
    return make_policy(export.kind, export.obs_dim, export.act_dim, **kwargs)


def run(engine, observations):
    actions = [engine.step(obs) for obs in observations]
    for a in actions[:1]:
        assert a.dtype == torch.float32 and a.device.type == 'cpu'
    return torch.stack(actions)


def assert_same(got, want, what):
    assert got.shape == want.shape, f'{what}: shape {tuple(got.shape)} != {tuple(want.shape)}'
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs()
        first = int(torch.nonzero(diff.amax(dim=1))[0])
        pytest.fail(f'{what}: not bit-identical, max abs diff {diff.max().item():.3g} '
                    f'(first differing step {first} of {len(got)})')


@pytest.mark.parametrize('name', [pytest.param(n, marks=pytest.mark.slow)  # 3-25 s each
                                  if 'lstm' in n or 'gru' in n else n for n in NAMES])
def test_engine_gives_the_files_actions_and_replays_them(name, export_for, tmp_path):
    export = export_for(name)
    obs = policy_exports.observations(export.obs_dim)
    want = export.reference(obs)
    assert torch.isfinite(want).all() and want.abs().max() > 0, 'degenerate reference'
    engine = PolicyEngine(make(export), device='cpu', cuda_graph=True,
                          capsule_dir=str(tmp_path))
    check_episode(engine, obs, want, f'{name}: engine vs the file run directly')


def check_episode(engine, obs, want, label):
    """The run equals `want`; snapshot at 100, restore, the same 50 again; reset_episode,
    the whole episode again."""
    engine.snapshot('episode_start', pin=True)
    first = run(engine, obs[:100])
    engine.snapshot('step100')
    got = torch.cat([first, run(engine, obs[100:])])
    assert_same(got, want, label)
    engine.restore('step100')
    assert_same(run(engine, obs[100:150]), got[100:150], f'{label}: replay after restore')
    engine.reset_episode()
    assert_same(run(engine, obs), want, f'{label}: first episode again after reset_episode')


@pytest.mark.cuda
@pytest.mark.parametrize('name', NAMES)
def test_captured_graph_matches_eager_on_cuda(name, export_for, tmp_path):
    export = export_for(name)
    obs = policy_exports.observations(export.obs_dim)
    graph = PolicyEngine(make(export), device='cuda', cuda_graph=True,
                         capsule_dir=str(tmp_path / 'graph'))
    eager = PolicyEngine(make(export), device='cuda', cuda_graph=False,
                         capsule_dir=str(tmp_path / 'eager'))
    assert graph.graph_captured and not eager.graph_captured
    want = run(eager, obs)
    assert torch.isfinite(want).all()
    check_episode(graph, obs, want, f'{name}: CUDA graph vs eager CUDA')


@pytest.mark.parametrize('name', NOT_STATED)
def test_checkpoint_without_activation_is_refused(name, export_for):
    export = export_for(name)
    with pytest.raises(InvalidConfig, match='activation'):
        make_policy(export.kind, export.obs_dim, export.act_dim, file=export.path, seed=0)


@pytest.mark.parametrize('name', ['rsl3_ckpt_mlp_tanh_norm', 'rsl5_ckpt_gru_tanh_norm'])
def test_activation_parameter_is_honoured(name, export_for, tmp_path):
    # the silent failure: a tanh checkpoint run as ELU. With the wrong name given the
    # actions must change (the parameter is used), with the right one they match exactly
    export = export_for(name)
    obs = policy_exports.observations(export.obs_dim)
    want = export.reference(obs)[:20]    # the standard run: rsl_rl ran it at build time
    obs = obs[:20]
    wrong = 'elu' if export.activation != 'elu' else 'tanh'
    engine = PolicyEngine(make(export, activation=wrong), device='cpu',
                          capsule_dir=str(tmp_path))
    assert not torch.equal(run(engine, obs), want), f'activation={wrong!r} was ignored'


@pytest.mark.parametrize('name', ['rsl3_jit_lstm_elu_norm', 'rsl5_jit_mlp_tanh_norm',
                                  'legged_gym_mlp_elu', 'rsl3_ckpt_gru_tanh_norm',
                                  'rsl5_ckpt_lstm_elu_norm', 'unitree_g1_motion'])
def test_observation_size_mismatch_names_both_sizes(name, export_for):
    export = export_for(name)
    wrong = export.obs_dim + 3
    activation = {} if export.states_activation else {'activation': export.activation}
    with pytest.raises(InvalidConfig) as info:
        make_policy(export.kind, wrong, export.act_dim, file=export.path, seed=0, **activation)
    message = str(info.value)
    for number in (export.obs_dim, wrong):
        assert re.search(rf'\b{number}\b', message), f'{number} not named in: {message}'


class _GainOnly(nn.Module):
    # scripted, but no Linear and no weights at all: nothing a policy loader understands
    def __init__(self):
        super().__init__()
        self.register_buffer('gain_vector', torch.linspace(0.5, 1.5, 10))
        self.squash = nn.Tanh()

    def forward(self, x):
        return self.squash(x * self.gain_vector)


class _TwoInputs(nn.Module):
    # the ONNX-style recurrent signature (state passed in and out), scripted
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(10, 4)

    def forward(self, x, h_in):
        return self.head(x + h_in)


@pytest.mark.parametrize('module,found', [(_GainOnly, 'gain_vector'), (_TwoInputs, 'h_in')])
@pytest.mark.parametrize('kind', ['mlp', 'recurrent'])
def test_unknown_torchscript_layout_is_refused_naming_what_it_found(module, found, kind,
                                                                    tmp_path):
    path = tmp_path / 'policy.pt'
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', DeprecationWarning)   # torch.jit.script's notice
        torch.jit.script(module()).save(str(path))
    with pytest.raises(InvalidConfig) as info:
        make_policy(kind, 10, 4, file=str(path), seed=0)
    assert found in str(info.value), f'{found!r} not named in: {info.value}'


def test_fixtures_are_the_pinned_formats(export_for):
    # guards the fixture builder itself: every listed format is built with the facts the
    # tests rely on, and checkpoints and their TorchScript exports agree exactly
    exports = {name: export_for(name) for name in NAMES if name != 'unitree_g1_motion'}
    for name, export in exports.items():
        assert export.kind in ('mlp', 'recurrent') and export.activation in ('elu', 'tanh')
        assert export.states_activation == (export.facts['format'] == 'torchscript'), name
        twin = name.replace('_ckpt_', '_jit_').replace('_state_dict_', '_jit_')
        if twin != name:
            obs = policy_exports.observations(export.obs_dim)
            assert np.array_equal(export.reference(obs).numpy(),
                                  exports[twin].reference(obs).numpy()), name


@pytest.mark.parametrize('name,enters', [
    ('rsl3_jit_lstm_elu_norm', 'the normalizer'),     # Isaac Lab _TorchPolicyExporter
    ('rsl5_jit_lstm_elu_norm', 'the normalizer'),     # rsl_rl >= 4 export_policy_to_jit
    ('legged_gym_lstm_elu', 'the rnn'),               # PolicyExporterLSTM, no normalizer
])
def test_width_refusal_names_the_width_the_observation_enters(name, enters, export_for):
    # Isaac Lab registers the actor before the normalizer and the rnn: reading the first
    # weight named the actor's input (the rnn's hidden size), not what the file takes
    export = export_for(name)
    wrong = export.obs_dim + 1
    with pytest.raises(InvalidConfig) as info:
        make_policy(export.kind, wrong, export.act_dim, file=export.path, seed=0)
    message = str(info.value)
    assert f'the file takes [1, {export.obs_dim}]' in message, f'{enters}: {message}'
    assert f'[1, {policy_exports.RNN_HIDDEN}]' not in message, message
