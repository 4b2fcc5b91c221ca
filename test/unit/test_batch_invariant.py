'''Batch-invariant kernels (policies/invariant.py): each row of a batched step is bit for bit
the same row stepped alone, for every batch size; so a fleet stepped as one batch equals
single-session engines exactly, through every capsule operation, across engines and across
processes. The kernels stay within float rounding (1e-5) of the default kernels, are refused
where they cannot hold, and the model digest keeps their capsules apart from the default ones.
CPU here; the same checks, smaller, run on CUDA (Triton, captured graphs) with the cuda marker.
'''

import ast
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

import flashrt_ros
from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.errors import IncompatibleCapsule, InvalidConfig
from flashrt_ros.runtime.policies import invariant, make_policy, ScriptedPolicy
from support.rsl_models import ExportedLSTM, rsl_actor

OBS, ACT, N = 47, 12, 5
BOUND = 1e-5        # |batch_invariant - default| on the same weights and inputs

# (label, kind, sizes): make_policy(kind, OBS, ACT, seed=0, **sizes)
SPECS = [
    ('mlp-512', 'mlp', dict(actor_hidden_dims=(512, 256, 128))),
    ('mlp-odd', 'mlp', dict(actor_hidden_dims=(500, 250, 130))),
    ('lstm-encoder', 'recurrent', dict(rnn_hidden_dim=64, actor_hidden_dims=(32,),
                                       encoder_dims=(64,))),
    ('gru-2layers', 'recurrent', dict(rnn_type='gru', rnn_num_layers=2, rnn_hidden_dim=50,
                                      actor_hidden_dims=(32,))),     # odd width: vector tails
    ('mlp-noise', 'mlp', dict(actor_hidden_dims=(64, 32), noise_std=0.5)),
    ('mlp-history3', 'mlp', dict(actor_hidden_dims=(64, 32), obs_history=3)),
]
IDS = [s[0] for s in SPECS]
ROWS = (1, 2, 3, 17, 64, 513, 4096)
CUDA_SPECS, CUDA_IDS = [SPECS[0], SPECS[2], SPECS[4]], ['mlp-512', 'lstm-encoder', 'mlp-noise']


def _needs_cuda():     # the cuda marker skips with its reason first (conftest.py)
    if not torch.cuda.is_available():
        pytest.skip('needs CUDA')


def _policy(spec, device='cpu', kernels='batch_invariant'):
    _, kind, sizes = spec
    return make_policy(kind, OBS, ACT, seed=0, device=device, **sizes).set_kernels(kernels)


def _engine(spec, tmp_path, sessions=1, device='cpu', kernels='batch_invariant', **kw):
    return PolicyEngine(_policy(spec, device, kernels), device=device, sessions=sessions,
                        capsule_dir=str(tmp_path / 'capsules'), debug=True, **kw)


def _streams(steps, sessions=N, seed=0):
    return (2 * np.random.default_rng(seed).standard_normal((steps, sessions, OBS))).astype(
        np.float32)


# ---------------------------------------------------------------- 1. the kernels
def _random_views(policy, rows, gen, device):
    # batched views [rows, *shape]: floats ~ N(0, 0.5), the rng a random (seed, counter) a row
    views = {}
    for s in policy.state_specs():
        if s.dtype.is_floating_point:
            v = torch.randn((rows, *s.shape), generator=gen) * 0.5
        else:
            v = torch.randint(0, 1 << 40, (rows, *s.shape), generator=gen)
        views[s.name] = v.to(s.dtype)
    views['meta'] = torch.zeros(rows, 4, dtype=torch.int64)
    return {k: v.to(device) for k, v in views.items()}


def _rows_as_if_alone(spec, rows, device):
    policy, gen = _policy(spec, device), torch.Generator().manual_seed(1000 + rows)
    batch = _random_views(policy, rows, gen, device)
    start = {k: v.clone() for k, v in batch.items()}
    obs = (2 * torch.randn(rows, policy.obs_dim, generator=gen)).to(device)
    act = torch.full((rows, ACT), float('nan'), device=device)
    policy.bind(batch, rows)
    policy.step(obs, act)
    assert torch.isfinite(act).all()
    for name in start:      # the step wrote every state buffer it uses
        if name != 'meta' and (name != 'rng' or policy.noise_std > 0):
            assert not torch.equal(start[name], batch[name]), (spec[0], name)
    picks = sorted({0, rows - 1, *torch.randint(rows, (6,), generator=gen).tolist()})
    for i in picks:
        alone = {k: v[i].clone() for k, v in start.items()}
        out = torch.full((ACT,), float('nan'), device=device)
        policy.bind(alone)
        policy.step(obs[i].clone(), out)
        assert torch.equal(out, act[i]), (spec[0], rows, i, float((out - act[i]).abs().max()))
        for name in alone:
            if name != 'meta':
                assert torch.equal(alone[name], batch[name][i]), (spec[0], rows, i, name)


@pytest.mark.parametrize('rows', ROWS)
@pytest.mark.parametrize('spec', SPECS, ids=IDS)
def test_each_row_of_a_batch_is_the_row_stepped_alone(spec, rows):
    _rows_as_if_alone(spec, rows, 'cpu')


@pytest.mark.cuda
@pytest.mark.parametrize('rows', (1, 3, 513, 4096))
@pytest.mark.parametrize('spec', SPECS, ids=IDS)
def test_each_row_of_a_batch_is_the_row_stepped_alone_cuda(spec, rows):
    _needs_cuda()
    _rows_as_if_alone(spec, rows, 'cuda')


# ---------------------------------------------------------------- 2. fleet == single engines
EXTRA = _streams(1, seed=99)[0]     # the observation of a step of one session alone

# (name, op(engine, session)): each done on one session of the fleet and on its single engine
OPS = [
    ('snapshot', lambda e, s: e.snapshot('a', session=s)),
    ('step', lambda e, s: e.step(EXTRA[2], session=s)),
    ('fork', lambda e, s: e.fork('', 'b', session=s)),
    ('rollback', lambda e, s: e.rollback(1, session=s)),
    ('restore', lambda e, s: e.restore('a', session=s)),
    ('reset_episode', lambda e, s: e.reset_episode(session=s)),
]


def _same_state(fleet, singles, where):
    live = fleet.arena.live_nbytes(fleet.session(0).position)
    for i, single in enumerate(singles):
        assert torch.equal(fleet.arena.blocks[i][:live], single.arena.storage[:live]), \
            (where, i)
        assert fleet.session(i).episode == single.episode, (where, i)


def _fleet_equals_singles(spec, tmp_path, device, steps=20):
    fleet = _engine(spec, tmp_path, N, device)
    singles = [_engine(spec, tmp_path, 1, device) for _ in range(N)]
    assert fleet.exact is True and fleet.program.batched is True
    assert all(s.exact and not s.program.batched for s in singles)
    assert fleet.model_digest == singles[0].model_digest
    obs, target = _streams(steps), 2
    ops = {3 + 2 * j: op for j, op in enumerate(OPS)}     # t = 3, 5, ..., 13
    for t in range(steps):
        actions = fleet.step_all(obs[t])
        for i, single in enumerate(singles):
            assert torch.equal(actions[i], single.step(obs[t, i])), (spec[0], t, i)
        if t in ops:
            name, op = ops[t]
            mine, theirs = op(fleet, target), op(singles[target], None)
            if name == 'step':
                assert torch.equal(mine, theirs), (spec[0], t, name)
            _same_state(fleet, singles, (spec[0], t, name))
    _same_state(fleet, singles, (spec[0], 'end'))
    assert fleet.session(target).episode == 1 and fleet.session(0).episode == 0


@pytest.mark.parametrize('spec', SPECS, ids=IDS)
def test_exact_fleet_equals_single_engines_through_capsule_ops(spec, tmp_path):
    _fleet_equals_singles(spec, tmp_path, 'cpu')


@pytest.mark.cuda
@pytest.mark.parametrize('spec', CUDA_SPECS, ids=CUDA_IDS)
def test_exact_fleet_equals_single_engines_through_capsule_ops_cuda(spec, tmp_path):
    _needs_cuda()
    _fleet_equals_singles(spec, tmp_path, 'cuda', steps=15)


def test_exact_is_reported_only_where_it_holds(tmp_path):
    spec = SPECS[4]
    assert _engine(spec, tmp_path, N, kernels='default').exact is True      # one by one
    rounded = _engine(spec, tmp_path, N, kernels='default', batch_sessions=True)
    assert rounded.exact is False and rounded.program.batched is True
    both = _engine(spec, tmp_path, N, batch_sessions=True)
    assert both.exact is True and both.program.batched is True


# ---------------------------------------------------------------- 3. capsules across engines
def _capsule_replays(spec, tmp_path, device, replays=8):
    fleet, single = _engine(spec, tmp_path, N, device), _engine(spec, tmp_path, 1, device)
    obs = _streams(12)
    for t in range(4):
        fleet.step_all(obs[t])
    fleet.snapshot('s3', session=3)
    path = fleet.save('s3').path
    expected = torch.stack([fleet.step_all(obs[t])[3] for t in range(4, 12)])
    single.load(path, 'from-fleet')
    for r in range(replays):
        single.restore('from-fleet')
        got = torch.stack([single.step(obs[t, 3]) for t in range(4, 12)])
        assert torch.equal(got, expected), (spec[0], r, float((got - expected).abs().max()))
    # and into another session of the fleet, its neighbours elsewhere in their episodes
    fleet.restore('s3', session=0)
    for t in range(4, 12):
        mixed = _streams(1, seed=200 + t)[0]
        mixed[0] = obs[t, 3]
        assert torch.equal(fleet.step_all(mixed)[0], expected[t - 4]), (spec[0], t)


@pytest.mark.parametrize('spec', SPECS, ids=IDS)
def test_a_fleet_capsule_replays_bit_for_bit_in_a_single_engine(spec, tmp_path):
    _capsule_replays(spec, tmp_path, 'cpu')


@pytest.mark.cuda
@pytest.mark.parametrize('spec', CUDA_SPECS, ids=CUDA_IDS)
def test_a_fleet_capsule_replays_bit_for_bit_in_a_single_engine_cuda(spec, tmp_path):
    _needs_cuda()
    _capsule_replays(spec, tmp_path, 'cuda', replays=3)


# ---------------------------------------------------------------- 4. a fresh process
CHILD = '''
import ast, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.policies import make_policy
specs, device, tmp = ast.literal_eval(sys.argv[2]), sys.argv[3], sys.argv[4]
obs = np.load(tmp + '/obs.npy')
for label, kind, sizes in specs:
    policy = make_policy(kind, obs.shape[2], {act}, seed=0, device=device, **sizes)
    engine = PolicyEngine(policy.set_kernels('batch_invariant'), device=device,
                          capsule_dir=tmp + '/child', sessions=obs.shape[1])
    assert engine.exact and engine.program.batched
    np.save(tmp + '/' + label + '.npy', np.stack([engine.step_all(o).numpy() for o in obs]))
    print(label, engine.model_digest)
'''.format(act=ACT)


def _fresh_process_replays(specs, tmp_path, device):
    obs = _streams(10)
    np.save(tmp_path / 'obs.npy', obs)
    root = str(pathlib.Path(flashrt_ros.__file__).resolve().parents[1])   # this checkout
    done = subprocess.run([sys.executable, '-c', CHILD, root, repr(specs), device,
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    digests = dict(line.split() for line in done.stdout.splitlines())
    for spec in specs:
        fleet = _engine(spec, tmp_path, N, device)
        assert digests[spec[0]] == fleet.model_digest, spec[0]
        mine = np.stack([fleet.step_all(o).numpy() for o in obs])
        theirs = np.load(tmp_path / f'{spec[0]}.npy')
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        assert np.array_equal(mine.view(np.uint32), theirs.view(np.uint32)), \
            (spec[0], float(np.abs(mine - theirs).max()))


def test_a_fresh_process_steps_the_same_actions_bit_for_bit(tmp_path):
    assert ast.literal_eval(repr(SPECS)) == SPECS       # the child gets the specs as written
    _fresh_process_replays(SPECS, tmp_path, 'cpu')


@pytest.mark.cuda
def test_a_fresh_process_steps_the_same_actions_bit_for_bit_cuda(tmp_path):
    _needs_cuda()
    _fresh_process_replays(CUDA_SPECS, tmp_path, 'cuda')


# ---------------------------------------------------------------- 5. accuracy
def _close_to_default_kernels(spec, tmp_path, device, steps=20):
    exact = _engine(spec, tmp_path, N, device)
    default = _engine(spec, tmp_path, N, device, kernels='default')
    weights = default.policy.state_dict()      # the same weights
    assert all(torch.equal(v, weights[k]) for k, v in exact.policy.state_dict().items())
    obs, worst = _streams(steps, seed=7), 0.0
    for t in range(steps):
        a, b = exact.step_all(obs[t]), default.step_all(obs[t])
        worst = max(worst, float((a - b).abs().max()))
        assert torch.allclose(a, b, rtol=0, atol=BOUND), \
            f'{spec[0]} step {t}: batch_invariant vs default kernels differ by ' \
            f'{float((a - b).abs().max()):.3g} > atol {BOUND}'
    print(f'{spec[0]} on {device}: max |batch_invariant - default| = {worst:.3g}')
    return worst


@pytest.mark.parametrize('spec', SPECS, ids=IDS)
def test_actions_stay_within_float_rounding_of_the_default_kernels(spec, tmp_path):
    _close_to_default_kernels(spec, tmp_path, 'cpu')


@pytest.mark.cuda
@pytest.mark.parametrize('spec', CUDA_SPECS, ids=CUDA_IDS)
def test_actions_stay_within_float_rounding_of_the_default_kernels_cuda(spec, tmp_path):
    _needs_cuda()
    _close_to_default_kernels(spec, tmp_path, 'cuda', steps=10)


# ---------------------------------------------------------------- 6. refusals and digests
def test_unknown_kernels_and_policies_that_step_alone_are_refused(tmp_path):
    policy = _policy(SPECS[0], kernels='default')
    with pytest.raises(InvalidConfig, match='kernels must be one of'):
        policy.set_kernels('fast')
    assert policy.kernels == 'default'
    history = make_policy('history', OBS, ACT, seed=0, d_model=32, n_layers=2, heads=4,
                          capacity=64, chunk=4)
    torch.manual_seed(9)    # a TorchScript export in the exporters' pattern (test_sessions)
    torch.jit.script(ExportedLSTM(rsl_actor('elu', ACT), torch.nn.LSTM(OBS, 32, 1),
                                  torch.nn.Identity())).save(str(tmp_path / 'policy.pt'))
    scripted = make_policy('recurrent', OBS, ACT, file=str(tmp_path / 'policy.pt'))
    assert isinstance(scripted, ScriptedPolicy)
    for alone in (history, scripted):
        assert not alone.batched
        digest = alone.model_digest()
        with pytest.raises(InvalidConfig, match='steps one session at a time'):
            alone.set_kernels('batch_invariant')
        assert alone.kernels == 'default' and alone.model_digest() == digest
        alone.set_kernels('default')    # the default kernels are always there


def test_the_kernel_set_is_part_of_the_model_digest(tmp_path):
    for spec in SPECS:
        policy = _policy(spec, kernels='default')
        digest = policy.model_digest()
        policy.set_kernels('batch_invariant')
        assert policy.model_digest() != digest, spec[0]
        assert policy.model_digest() == _policy(spec).model_digest(), spec[0]
        assert policy.config()['kernels'] == 'batch_invariant', spec[0]
        policy.set_kernels('default')
        assert policy.model_digest() == digest, spec[0]
        assert 'kernels' not in policy.config(), spec[0]   # older capsules keep their digest


@pytest.mark.parametrize('sessions', (1, N))
def test_a_capsule_of_the_other_kernels_is_refused(sessions, tmp_path):
    spec, obs = SPECS[2], _streams(3)
    default = _engine(spec, tmp_path, 1, kernels='default')
    exact = _engine(spec, tmp_path, sessions)
    assert default.model_digest != exact.model_digest
    for t in range(3):
        default.step(obs[t, 0])
        exact.step_all(obs[t, :sessions])
    default.snapshot('d')
    path = default.save('d').path
    before = exact.arena.storage.clone()
    with pytest.raises(IncompatibleCapsule, match='model digest'):
        exact.load(path, 'from-default')
    assert exact.store.list() == []
    # a capsule in the store without the load's check is still refused by restore
    exact.store.load(path, 'sneaked')
    with pytest.raises(IncompatibleCapsule, match='model digest'):
        exact.restore('sneaked', session=sessions - 1)
    assert torch.equal(exact.arena.storage, before)
    # and the other way round
    exact.snapshot('e', session=0)
    with pytest.raises(IncompatibleCapsule, match='model digest'):
        default.load(exact.save('e').path, 'from-exact')


def test_a_fleet_is_refused_where_rows_do_not_stay_independent(tmp_path, monkeypatch):
    # a linear layer that rounds by the row count (as BLAS kernels may): the engine's check at
    # construction (invariant.verify) refuses to step the fleet as one batch
    real = invariant.linear
    monkeypatch.setattr(invariant, 'linear', lambda x, layer, activation=None: real(
        x, layer, activation) + 1e-6 * (x.shape[0] > 1))
    with pytest.raises(InvalidConfig, match='do not keep rows independent'):
        _engine(SPECS[0], tmp_path, N)
    assert _engine(SPECS[0], tmp_path, 1).exact         # one session: nothing to check
