'''Sessions: many policy states in one engine, stepped in one replay, each with its own
capsules. Every claim is checked against single-session engines of the same model, bit for bit.

CPU here; the same tests run on CUDA (captured graphs) with the cuda marker.'''

import numpy as np
import pytest
import torch

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.errors import InvalidConfig, InvalidObservation, RollbackUnavailable
from flashrt_ros.runtime.policies import make_policy, ScriptedPolicy
from support.rsl_models import ExportedLSTM, rsl_actor

OBS, ACT, N = 12, 4, 5
SMALL = dict(actor_hidden_dims=(32, 16))
REC = dict(rnn_hidden_dim=32, actor_hidden_dims=(32, 16))
HIST = dict(d_model=32, n_layers=2, heads=4, capacity=64, chunk=4)

# (label, kind, sizes, obs_history): batched kinds first, then kinds stepped session by session
POLICIES = [
    ('mlp', 'mlp', dict(SMALL), 1),
    ('mlp-noise', 'mlp', dict(SMALL, noise_std=0.3), 1),
    ('mlp-history3', 'mlp', dict(SMALL), 3),
    ('lstm', 'recurrent', dict(REC), 1),
    ('gru-noise', 'recurrent', dict(REC, rnn_type='gru', noise_std=0.2), 1),
    ('lstm-2layers', 'recurrent', dict(REC, rnn_num_layers=2), 1),
    ('history', 'history', dict(HIST, noise_std=0.2), 1),
    ('torchscript', 'scripted', {}, 1),
]
IDS = [p[0] for p in POLICIES]
BATCHABLE = [p for p in POLICIES if p[1] in ('mlp', 'recurrent')]


def _policy(kind, sizes, obs_history, tmp_path):
    if kind == 'scripted':
        # a real TorchScript export in the exporters' pattern (state in buffers forward writes)
        path = tmp_path / 'policy.pt'
        if not path.exists():
            torch.manual_seed(9)
            module = ExportedLSTM(rsl_actor('elu', ACT), torch.nn.LSTM(OBS, 32, 1),
                                  torch.nn.Identity())
            torch.jit.script(module).save(str(path))
        policy = make_policy('recurrent', OBS, ACT, file=str(path))
        assert isinstance(policy, ScriptedPolicy)
        return policy
    return make_policy(kind, OBS, ACT, seed=3, obs_history=obs_history, **sizes)


def _engine(spec, tmp_path, sessions=1, device='cpu', **kw):
    _, kind, sizes, hist = spec
    return PolicyEngine(_policy(kind, sizes, hist, tmp_path), device=device,
                        capsule_dir=str(tmp_path / 'capsules'), sessions=sessions, debug=True,
                        **kw)


def _streams(steps, sessions=N, seed=0):
    return np.random.default_rng(seed).standard_normal((steps, sessions, OBS)).astype(
        np.float32)


def _blocks(engine):
    """Each session's live bytes (the state a capsule holds; an append row past a session's
    position may be scratch, as in a single-session engine)."""
    return [b[:engine.arena.live_nbytes(engine.session(i).position)].clone()
            for i, b in enumerate(engine.arena.blocks)]


@pytest.fixture(params=POLICIES, ids=IDS)
def spec(request):
    return request.param


def _batched_equals_single(spec, tmp_path, device):
    fleet = _engine(spec, tmp_path, N, device)
    singles = [_engine(spec, tmp_path, 1, device) for _ in range(N)]
    assert fleet.policy.batched == (spec in BATCHABLE)
    obs = _streams(12)
    for t in range(12):
        actions = fleet.step_all(obs[t])
        for i, single in enumerate(singles):
            assert torch.equal(actions[i], single.step(obs[t, i])), (spec[0], t, i)
    # the whole state too, session by session, against the single engines' arenas
    live = fleet.arena.live_nbytes(fleet.session(0).position)
    for i, single in enumerate(singles):
        assert torch.equal(fleet.arena.blocks[i][:live], single.arena.storage[:live])


def test_batched_step_equals_single_session_steps(spec, tmp_path):
    _batched_equals_single(spec, tmp_path, 'cpu')


@pytest.mark.cuda
def test_batched_step_equals_single_session_steps_cuda(spec, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip('needs CUDA')
    _batched_equals_single(spec, tmp_path, 'cuda')


@pytest.mark.parametrize('spec,batch', [(p, False) for p in POLICIES] +
                         [(p, True) for p in BATCHABLE],
                         ids=IDS + [f'{p[0]}-batch' for p in BATCHABLE])
def test_every_op_on_one_session_leaves_the_others_bit_identical(spec, batch, tmp_path):
    fleet = _engine(spec, tmp_path, N, batch_sessions=batch)
    obs = _streams(10)
    for t in range(6):
        fleet.step_all(obs[t])
    target = 2
    others = [i for i in range(N) if i != target]

    def check_others(op):
        before = _blocks(fleet)
        op()
        after = _blocks(fleet)
        for i in others:
            assert torch.equal(before[i], after[i]), (op, i)
        return before[target], after[target]

    check_others(lambda: fleet.snapshot('a', session=target))
    check_others(lambda: fleet.fork('', 'b', session=target))
    check_others(lambda: fleet.step(obs[6, target], session=target))
    check_others(lambda: fleet.rollback(1, session=target))
    check_others(lambda: fleet.restore('a', session=target))
    check_others(lambda: fleet.reset_episode(session=target))
    # and one session stepping alone changes only itself; the others' next actions are
    # those of an engine that never saw the operations above
    ref = _engine(spec, tmp_path, N, batch_sessions=batch)
    for t in range(6):
        ref.step_all(obs[t])
    mine, theirs = fleet.step_all(obs[7]), ref.step_all(obs[7])
    assert torch.equal(mine[others], theirs[others])
    assert fleet.session(target).episode == 1 and fleet.session(others[0]).episode == 0


def test_inactive_sessions_keep_their_state_and_lose_one_rollback_slot(spec, tmp_path):
    fleet = _engine(spec, tmp_path, N, rollback_depth=4)
    obs = _streams(8)
    for t in range(4):
        fleet.step_all(obs[t])
    active = np.array([True, False, True, False, True])
    before = _blocks(fleet)
    fleet.step_all(obs[4], active=active)
    after = _blocks(fleet)
    for i in range(N):
        assert torch.equal(before[i], after[i]) != active[i], i
        assert fleet.session(i).step_index == 4 + active[i]
        assert fleet.session(i).rollback_available == (4 if active[i] else 3)
    with pytest.raises(RollbackUnavailable):
        fleet.rollback(4, session=1)
    fleet.rollback(3, session=1)            # the three remaining slots are intact
    ref = _engine(spec, tmp_path, 1)
    ref.step(obs[0, 1])
    assert torch.equal(fleet.arena.blocks[1][:fleet.arena.static_nbytes],
                       ref.arena.storage[:fleet.arena.static_nbytes])


def test_a_capsule_of_one_session_restores_into_another(spec, tmp_path):
    fleet = _engine(spec, tmp_path, N)
    obs = _streams(10)
    for t in range(5):
        fleet.step_all(obs[t], active=[True, True, False, True, True])
    fleet.snapshot('robot0', session=0)
    fleet.restore('robot0', session=2)      # clone robot 0's state onto robot 2
    pos = fleet.session(0).position
    live = fleet.arena.live_nbytes(pos)
    assert torch.equal(fleet.arena.blocks[2][:live], fleet.arena.blocks[0][:live])
    assert fleet.session(2).step_index == fleet.session(0).step_index == 5
    same = obs[5].copy()
    same[2] = same[0]
    actions = fleet.step_all(same)
    assert torch.equal(actions[2], actions[0])


def test_capsule_files_move_between_single_and_multi_session_engines(spec, tmp_path):
    fleet = _engine(spec, tmp_path, N)
    single = _engine(spec, tmp_path, 1)
    assert fleet.arena.schema_digest == single.arena.schema_digest
    obs = _streams(12)
    for t in range(4):
        fleet.step_all(obs[t])
    fleet.snapshot('s3', session=3)
    path = fleet.save('s3').path
    single.load(path, 'from-fleet')
    single.restore('from-fleet')
    for t in range(4, 8):
        assert torch.equal(single.step(obs[t, 3]), fleet.step_all(obs[t])[3])
    # and back: the single engine's state into session 1
    single.snapshot('back')
    fleet.load(single.save('back').path, 'from-single')
    fleet.restore('from-single', session=1)
    for t in range(8, 12):
        assert torch.equal(single.step(obs[t, 1]), fleet.step_all(obs[t])[1])


def test_sessions_are_addressed_by_index_or_name_and_never_guessed(tmp_path):
    names = ['g1-a', 'g1-b', 'g1-c']
    fleet = _engine(POLICIES[0], tmp_path, 3, session_names=names)
    assert fleet.session('g1-b').index == 1 and fleet.session('2').index == 2
    assert fleet.session(0).name == 'g1-a'
    # indices are ASCII digits: str.isdigit() also takes other scripts' digits, which int()
    # reads ('\u0661' Arabic-Indic one, '\uff11' fullwidth one) or refuses ('\u00b2')
    for key in ('\u0661', '\uff11', '\u00b2', '1\u0661'):
        with pytest.raises(InvalidConfig, match='ASCII digits 0-9'):
            fleet.session(key)
        with pytest.raises(InvalidConfig, match='ASCII digits 0-9'):
            fleet.snapshot('x', session=key)
    assert fleet.store.list() == []
    assert fleet.session('01').index == 1
    # such a name is a name, never an index (it once raised ValueError at construction)
    odd = _engine(POLICIES[0], tmp_path, 2, session_names=['\u00b2', '\uff11'])
    assert odd.session('\uff11').index == 1 and odd.session('1').index == 1
    with pytest.raises(InvalidConfig, match='runs 3 sessions: name one'):
        fleet.snapshot('x')
    with pytest.raises(InvalidConfig, match="no session 'g1-z'"):
        fleet.restore('x', session='g1-z')
    with pytest.raises(InvalidConfig, match='no session 3'):
        fleet.step(np.zeros(OBS, np.float32), session=3)
    with pytest.raises(InvalidConfig, match='distinct'):
        _engine(POLICIES[0], tmp_path, 2, session_names=['a', 'a'])
    with pytest.raises(InvalidConfig, match='index of another session'):
        _engine(POLICIES[0], tmp_path, 2, session_names=['1', '0'])
    # a single-session engine keeps its calls unchanged
    single = _engine(POLICIES[0], tmp_path, 1)
    single.step(np.zeros(OBS, np.float32))
    assert single.snapshot('x').manifest.step == 1


def _batch_matches_single_to_rounding(spec, tmp_path, device):
    fleet = _engine(spec, tmp_path, N, device, batch_sessions=True)
    singles = [_engine(spec, tmp_path, 1, device) for _ in range(N)]
    obs = _streams(20)
    worst = 0.0
    fleet.snapshot('start', session=1)
    first = []
    for t in range(20):
        actions = fleet.step_all(obs[t])
        first.append(actions[1])
        for i, single in enumerate(singles):
            expected = single.step(obs[t, i])
            worst = max(worst, float((actions[i] - expected).abs().max()))
            assert torch.allclose(actions[i], expected, rtol=1e-4, atol=1e-5), (t, i)
    # deterministic: the same capsule in the same session, with the others elsewhere in
    # their episodes, gives the same actions bit for bit
    fleet.restore('start', session=1)
    for t in range(20):
        mixed = _streams(1, seed=100 + t)[0]
        mixed[1] = obs[t, 1]
        assert torch.equal(fleet.step_all(mixed)[1], first[t]), t
    return worst


@pytest.mark.parametrize('spec', BATCHABLE, ids=[p[0] for p in BATCHABLE])
def test_one_batch_for_the_fleet_matches_single_sessions_to_float_rounding(spec, tmp_path):
    _batch_matches_single_to_rounding(spec, tmp_path, 'cpu')


@pytest.mark.cuda
@pytest.mark.parametrize('spec', BATCHABLE, ids=[p[0] for p in BATCHABLE])
def test_one_batch_for_the_fleet_matches_single_sessions_cuda(spec, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip('needs CUDA')
    _batch_matches_single_to_rounding(spec, tmp_path, 'cuda')


def test_batch_sessions_is_refused_for_policies_that_step_alone(tmp_path):
    with pytest.raises(InvalidConfig, match='steps one session at a time'):
        _engine(POLICIES[-1], tmp_path, 2, batch_sessions=True)


def _resident_equals_host(spec, tmp_path, device):
    """Observations already on the engine's device (a GPU-resident farm) step exactly as the
    same observations given from the host, active masks and tags included; the actions come
    back on that device, contiguous; and bad input there is refused before the state moves."""
    host, resident = _engine(spec, tmp_path, N, device), _engine(spec, tmp_path, N, device)
    obs = _streams(10)
    for t in range(10):
        active = None if t % 3 else [i != t % N for i in range(N)]
        tags = [t * N + i + 1 for i in range(N)]
        want = host.step_all(obs[t], active, tags)
        got = resident.step_all(torch.from_numpy(obs[t]).to(device), active, tags)
        assert got.device.type == torch.device(device).type and got.is_contiguous()
        assert want.device.type == 'cpu'
        assert torch.equal(got.cpu(), want), (spec[0], t)
        assert np.array_equal(resident.last_finite, host.last_finite)
    assert all(b.equal(c) for b, c in zip(_blocks(host), _blocks(resident)))
    before, refused = _blocks(resident), resident.rejected_observations
    good = torch.from_numpy(obs[0]).to(device)
    bad = good.clone()
    bad[N - 1, OBS - 2] = float('nan')
    for wrong in (bad, good[:, :-1], good.to(torch.complex64), good > 0):
        with pytest.raises(InvalidObservation):
            resident.step_all(wrong)
    with pytest.raises(InvalidObservation, match=rf'first at index \[{N - 1}, {OBS - 2}\]'):
        resident.step_all(bad)      # (numpy's check on the CPU, torch's on CUDA: the same words)
    assert resident.rejected_observations == refused + 5
    assert all(b.equal(c) for b, c in zip(before, _blocks(resident)))
    # from the host, the check runs while the observations are on their way to the device:
    # refused the same, nothing of the state moved, and the next tick is untouched by them
    before, refused = _blocks(host), host.rejected_observations
    bad_host = obs[0].copy()
    bad_host[N - 1, OBS - 2] = np.inf
    with pytest.raises(InvalidObservation, match='NaN or Inf'):
        host.step_all(bad_host)
    assert host.rejected_observations == refused + 1
    assert all(b.equal(c) for b, c in zip(before, _blocks(host)))
    # float64 on the device is taken as numpy takes it from the host: rounded to float32
    assert torch.equal(resident.step_all(good.double()).cpu(), host.step_all(obs[0]))


@pytest.mark.parametrize('spec', POLICIES[:4], ids=IDS[:4])
def test_device_resident_observations_step_as_host_ones(spec, tmp_path):
    _resident_equals_host(spec, tmp_path, 'cpu')


@pytest.mark.cuda
@pytest.mark.parametrize('spec', POLICIES, ids=IDS)
def test_device_resident_observations_step_as_host_ones_cuda(spec, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip('needs a CUDA device: run on the GPU machine')
    _resident_equals_host(spec, tmp_path, 'cuda')
