'''Policies on CPU: state specs, in-place deterministic steps, prefill, chunk playout, masking,
the counter-based sampler, rsl_rl TorchScript / state_dict loading and the model digest.'''

import pytest
import torch
import torch.nn as nn

from flashrt_ros.runtime.errors import CapacityExceeded, InvalidConfig
from flashrt_ros.runtime.policies import gaussian_noise, HistoryPolicy, linear_scan, make_policy
from flashrt_ros.runtime.state import BufferSpec, KINDS, META_POSITION, StateArena
from support.rsl_models import ExportedGRU, ExportedLSTM, Normalizer, rsl_actor

OBS, ACT = 12, 4
REC = dict(rnn_hidden_dim=32, actor_hidden_dims=(32, 16))
HIST = dict(d_model=32, n_layers=4, heads=4, capacity=64, chunk=4)


def bind(policy, device='cpu'):
    '''Allocate the policy's state in a StateArena (plus meta), bind and reset it.'''
    meta = BufferSpec('meta', (4,), torch.int64, 'meta')
    arena = StateArena(policy.state_specs() + [meta], device)
    policy.bind(arena.views)
    policy.reset_state()
    return arena.views


def run(policy, observations):
    '''Step through observations [T, OBS]; returns actions [T, ACT].'''
    action = torch.zeros(ACT, device=observations.device)
    out = []
    for obs in observations:
        policy.step(obs, action)
        out.append(action.clone())
    return torch.stack(out) if out else torch.zeros(0, ACT, device=observations.device)


def clone_state(views):
    return {name: view.clone() for name, view in views.items()}


def copy_state(views, saved):
    for name, view in views.items():
        view.copy_(saved[name])


POLICIES = [('recurrent', dict(REC)), ('recurrent', dict(REC, rnn_type='gru', noise_std=0.2)),
            ('history', dict(HIST)), ('history', dict(HIST, noise_std=0.2))]


@pytest.mark.parametrize('kind,sizes', POLICIES)
def test_specs_are_well_formed(kind, sizes):
    policy = make_policy(kind, OBS, ACT, **sizes)
    specs = policy.state_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names)) and 'meta' not in names
    assert all(s.kind in KINDS and s.growth in ('static', 'append') for s in specs)
    kinds = {s.kind for s in specs}
    if kind == 'recurrent':
        assert policy.capacity == 0 and all(s.growth == 'static' for s in specs)
        assert kinds == {'recurrent', 'rng'}
        assert ('cell_state' in names) == (sizes.get('rnn_type', 'lstm') == 'lstm')
    else:
        append = [s for s in specs if s.growth == 'append']
        assert [s.name for s in append] == ['kv'] and append[0].kind == 'kv'
        assert append[0].shape[0] == policy.capacity == HIST['capacity']
        assert kinds == {'kv', 'conv', 'recurrent', 'chunk', 'rng'}


@pytest.mark.parametrize('kind,sizes', POLICIES)
def test_step_is_deterministic_and_in_place(kind, sizes):
    observations = torch.randn(20, OBS, generator=torch.Generator().manual_seed(1))
    a = make_policy(kind, OBS, ACT, seed=3, **sizes)
    b = make_policy(kind, OBS, ACT, seed=3, **sizes)
    views_a, _ = bind(a), bind(b)
    ptrs = {name: v.data_ptr() for name, v in views_a.items()}
    before = clone_state(views_a)
    actions = run(a, observations)
    assert torch.equal(actions, run(b, observations))
    assert torch.isfinite(actions).all()
    assert {name: v.data_ptr() for name, v in a.views.items()} == \
        {name: ptrs[name] for name in a.views}
    assert a.meta.data_ptr() == ptrs['meta']
    # the step wrote its state through the bound views (a copy elsewhere would leave them)
    changed = [n for n in a.views if not torch.equal(a.views[n], before[n])]
    assert 'hidden_state' in changed if kind == 'recurrent' else \
        {'kv', 'conv', 'recurrent', 'chunk'} <= set(changed)


@pytest.mark.parametrize('start', [0, 5])
@pytest.mark.parametrize('noise_std', [0.0, 0.3])
def test_prefill_matches_stepping(start, noise_std):
    # T = 11 is not a multiple of chunk 4, so the cursor and the emitted chunk must be
    # carried exactly; start 5 exercises the masked (offset causal) prefill path
    observations = torch.randn(start + 11 + 6, OBS, generator=torch.Generator().manual_seed(2))
    stepped = make_policy('history', OBS, ACT, seed=4, noise_std=noise_std, **HIST)
    filled = make_policy('history', OBS, ACT, seed=4, noise_std=noise_std, **HIST)
    vs, vf = bind(stepped), bind(filled)
    run(stepped, observations[:start + 11])
    run(filled, observations[:start])
    filled.prefill(observations[start:start + 11])
    assert torch.equal(vs['meta'], vf['meta']) and vf['meta'][META_POSITION] == start + 11
    assert torch.equal(vs['cursor'], vf['cursor']) and torch.equal(vs['rng'], vf['rng'])
    # float32, but prefill sums in another order (batched matmuls, flash attention, conv1d,
    # a log-depth scan): per-element differences are ~1e-6 and stay below 1e-4 over 4 layers
    for name in ('conv', 'recurrent', 'chunk'):
        torch.testing.assert_close(vf[name], vs[name], atol=1e-4, rtol=1e-4)
    pos = start + 11
    torch.testing.assert_close(vf['kv'][:pos], vs['kv'][:pos], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(run(filled, observations[pos:]), run(stepped, observations[pos:]),
                               atol=1e-4, rtol=1e-4)


def test_half_precision_step_attends_like_the_float32_step():
    # bfloat16 steps attend through the fused SDPA kernel, float32 steps through two matmuls:
    # the same weights (the bfloat16 ones, widened) give the same actions up to bfloat16's
    # rounding (~2e-3 relative per operation, 4 layers: 0.6 % of the largest action here)
    observations = torch.randn(40, OBS, generator=torch.Generator().manual_seed(6))
    half = make_policy('history', OBS, ACT, seed=4, dtype='bfloat16', **HIST)
    full = make_policy('history', OBS, ACT, seed=4, **HIST)
    full.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    bind(half)
    bind(full)
    a16, a32 = run(half, observations), run(full, observations)
    scale = float(a32.abs().max())
    assert scale > 0.1
    assert float((a16 - a32).abs().max()) < 0.02 * scale


def test_prefill_refuses_beyond_capacity_and_recurrent():
    policy = make_policy('history', OBS, ACT, **HIST)
    views = bind(policy)
    policy.prefill(torch.randn(60, OBS))
    saved = clone_state(views)
    with pytest.raises(CapacityExceeded):
        policy.prefill(torch.randn(5, OBS))
    assert all(torch.equal(views[n], saved[n]) for n in views)
    recurrent = make_policy('recurrent', OBS, ACT, **REC)
    bind(recurrent)
    with pytest.raises(InvalidConfig):
        recurrent.prefill(torch.randn(3, OBS))


def test_chunk_playout_emits_once_per_chunk():
    policy = make_policy('history', OBS, ACT, **HIST)
    views = bind(policy)
    chunk, action, emitted = HIST['chunk'], torch.zeros(ACT), []
    for t in range(3 * chunk):
        previous = views['chunk'].clone()
        policy.step(torch.randn(OBS), action)
        emitted.append(not torch.equal(previous, views['chunk']))
        assert torch.equal(action, views['chunk'][t % chunk])
        assert int(views['cursor']) == (t + 1) % chunk
        assert int(views['meta'][META_POSITION]) == t + 1
    assert emitted == [t % chunk == 0 for t in range(3 * chunk)]


def test_masked_positions_do_not_reach_the_output():
    # what lets a restore copy only the live prefix: rows at and beyond position are dead
    observations = torch.randn(12, OBS, generator=torch.Generator().manual_seed(5))
    policy = make_policy('history', OBS, ACT, **HIST)
    views = bind(policy)
    run(policy, observations[:7])
    saved = clone_state(views)
    clean = run(policy, observations[7:])
    copy_state(views, saved)
    views['kv'][7:].copy_(1e3 * torch.randn_like(views['kv'][7:]))
    assert torch.equal(run(policy, observations[7:]), clean)
    # and the live rows do matter (the test can fail)
    copy_state(views, saved)
    views['kv'][:7].add_(1.0)
    assert not torch.equal(run(policy, observations[7:]), clean)


def test_sampler_is_a_function_of_seed_and_counter():
    def draw(seed, counter):
        return gaussian_noise(torch.tensor([seed]), torch.tensor([counter]), 64)
    assert torch.equal(draw(7, 3), draw(7, 3))
    assert not torch.equal(draw(7, 3), draw(7, 4))
    assert not torch.equal(draw(7, 3), draw(8, 3))
    assert not torch.equal(draw(7, 1 << 32), draw(7, 0))    # the high counter word counts
    big = gaussian_noise(torch.tensor([1]), torch.tensor([0]), 200_000)
    assert abs(float(big.mean())) < 0.02 and abs(float(big.std()) - 1) < 0.02
    assert torch.isfinite(big).all()


@pytest.mark.parametrize('kind,sizes', [POLICIES[1], POLICIES[3]])
def test_restoring_state_reproduces_samples(kind, sizes):
    observations = torch.randn(15, OBS, generator=torch.Generator().manual_seed(6))
    policy = make_policy(kind, OBS, ACT, **sizes)
    views = bind(policy)
    run(policy, observations[:5])
    saved = clone_state(views)
    first = run(policy, observations[5:])
    copy_state(views, saved)
    assert torch.equal(run(policy, observations[5:]), first)
    # without restoring the rng buffer the samples differ: the noise is load-bearing
    copy_state(views, saved)
    views['rng'][1] += 1000
    assert not torch.equal(run(policy, observations[5:]), first)


def test_linear_scan_matches_sequential_recurrence():
    g = torch.Generator().manual_seed(8)
    a, b, h0 = torch.rand(37, 5, generator=g), torch.randn(37, 5, generator=g), torch.randn(5)
    h, expected = h0, []
    for t in range(37):
        h = a[t] * h + b[t]
        expected.append(h)
    torch.testing.assert_close(linear_scan(a, b, h0), torch.stack(expected))


# ------------------------------------------------------------ rsl_rl / Isaac Lab formats

@pytest.mark.parametrize('rnn_type,layers,normalize,activation', [
    ('lstm', 1, False, 'elu'), ('lstm', 2, True, 'tanh'), ('gru', 1, True, 'elu')])
def test_torchscript_policy_round_trip(tmp_path, rnn_type, layers, normalize, activation):
    torch.manual_seed(9)
    rnn = (nn.LSTM if rnn_type == 'lstm' else nn.GRU)(OBS, 32, layers)
    exported_cls = ExportedLSTM if rnn_type == 'lstm' else ExportedGRU
    normalizer = Normalizer(OBS) if normalize else nn.Identity()
    exported = torch.jit.script(exported_cls(rsl_actor(activation, ACT), rnn, normalizer))
    exported.save(str(tmp_path / 'policy.pt'))
    policy = make_policy('recurrent', OBS, ACT, file=str(tmp_path / 'policy.pt'))
    # run as the file itself, with the buffers its forward overwrites adopted as state
    assert policy.state_names == (['hidden_state', 'cell_state'] if rnn_type == 'lstm'
                                  else ['hidden_state'])
    assert policy.activation == activation
    bind(policy)
    exported.reset()
    action = torch.zeros(ACT)
    for obs in torch.randn(50, OBS):
        # inference as a deployment runs it: without autograd. (With grad on, CPU LSTM takes
        # the native kernel instead of oneDNN's and differs in the last bit.)
        with torch.no_grad():
            expected = exported(obs.unsqueeze(0))                         # [1, A]
        policy.step(obs, action)
        # same kernels, same shapes, same op order on the same device: bit for bit
        assert torch.equal(action, expected.view(-1))
    assert torch.equal(policy.views['hidden_state'], exported.hidden_state)


def _rsl_checkpoint(rnn_type='lstm'):
    torch.manual_seed(10)
    memory_a = (nn.LSTM if rnn_type == 'lstm' else nn.GRU)(OBS, 32, 1)
    actor, normalizer = rsl_actor('elu', ACT), Normalizer(OBS)
    sd = {f'memory_a.rnn.{k}': v for k, v in memory_a.state_dict().items()}
    sd.update({f'actor.{k}': v for k, v in actor.state_dict().items()})
    sd.update({f'actor_obs_normalizer.{k}': v for k, v in normalizer.state_dict().items()})
    # critic side of ActorCriticRecurrent: present in the checkpoint, ignored by us
    sd.update({f'memory_c.rnn.{k}': v.clone() for k, v in memory_a.state_dict().items()})
    sd.update({'critic.0.weight': torch.randn(32, 32), 'std': torch.ones(ACT)})
    return {'model_state_dict': sd, 'iter': 100}, (memory_a, actor, normalizer)


def test_rsl_rl_state_dict_loading(tmp_path):
    checkpoint, (rnn, actor, normalizer) = _rsl_checkpoint()
    torch.save(checkpoint, tmp_path / 'model_100.pt')
    with pytest.raises(InvalidConfig, match="'activation'"):
        make_policy('recurrent', OBS, ACT, file=str(tmp_path / 'model_100.pt'))
    policy = make_policy('recurrent', OBS, ACT, file=str(tmp_path / 'model_100.pt'),
                         activation='elu')
    bind(policy)
    state, action = None, torch.zeros(ACT)
    for obs in torch.randn(20, OBS):
        with torch.no_grad():
            out, state = rnn(normalizer(obs.view(1, 1, OBS)), state)
            expected = actor(out).view(-1)
        policy.step(obs, action)
        assert torch.equal(action, expected)
    with pytest.raises(InvalidConfig, match='observations'):
        make_policy('recurrent', OBS + 1, ACT, file=str(tmp_path / 'model_100.pt'),
                    activation='elu')


def test_history_weights_round_trip_through_a_file(tmp_path):
    from safetensors.torch import save_file
    policy = make_policy('history', OBS, ACT, seed=11, **HIST)
    save_file(policy.state_dict(), str(tmp_path / 'history.safetensors'))
    loaded = make_policy('history', OBS, ACT, seed=12, file=str(tmp_path / 'history.safetensors'),
                         **HIST)
    assert loaded.model_digest() == policy.model_digest()


def test_model_digest_tracks_weights_not_state():
    a = make_policy('history', OBS, ACT, seed=1, **HIST)
    b = make_policy('history', OBS, ACT, seed=1, **HIST)
    assert a.model_digest() == b.model_digest()
    assert make_policy('history', OBS, ACT, seed=2, **HIST).model_digest() != a.model_digest()
    bind(a)
    run(a, torch.randn(5, OBS))
    assert a.model_digest() == b.model_digest()        # state is not a weight
    with torch.no_grad():
        a.blocks[1].mixer.a_bias[0] += 1e-3
    assert a.model_digest() != b.model_digest()
    r = make_policy('recurrent', OBS, ACT, **REC)
    digest = r.model_digest()
    with torch.no_grad():
        r.actor[0].weight[0, 0] += 1e-3
    assert r.model_digest() != digest


def test_bad_configuration_is_refused():
    with pytest.raises(InvalidConfig):
        make_policy('history', OBS, ACT, d_model=30, heads=4)
    with pytest.raises(InvalidConfig):
        make_policy('recurrent', OBS, ACT, no_such_size=3)
    with pytest.raises(InvalidConfig):
        make_policy('transformer', OBS, ACT)
    policy = make_policy('recurrent', OBS, ACT, **REC)
    views = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in policy.state_specs()}
    views['hidden_state'] = torch.zeros(2, 32)
    views['meta'] = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(InvalidConfig, match='hidden_state'):
        policy.bind(views)


def test_history_sizes_for_the_benchmark_model():
    # d_model 1024, 16 layers (8 attention + 8 recurrence), MLP ratio 4: about 200M
    # parameters; built on the meta device so the test allocates nothing
    with torch.device('meta'):
        policy = HistoryPolicy(64, 12, d_model=1024, n_layers=16, heads=16, capacity=16384,
                               chunk=8)
    n = sum(p.numel() for p in policy.parameters())
    assert 190e6 < n < 215e6, n


@pytest.mark.cuda
def test_prefill_matches_stepping_on_cuda():
    if not torch.cuda.is_available():
        print('CUDA is not available: this test runs on the GPU machine')
        pytest.skip('CUDA is not available')
    observations = torch.randn(40, OBS, generator=torch.Generator().manual_seed(3)).cuda()
    stepped = make_policy('history', OBS, ACT, seed=4, device='cuda', **HIST)
    filled = make_policy('history', OBS, ACT, seed=4, device='cuda', **HIST)
    vs = bind(stepped, 'cuda')
    bind(filled, 'cuda')
    run(stepped, observations[:33])
    filled.prefill(observations[:33])
    assert torch.equal(vs['cursor'], filled.views['cursor'])
    # fp32 on CUDA: fused attention and cuDNN's conv may use other reduction orders (and TF32
    # in cuDNN convolutions), so the bound is looser than on CPU
    torch.testing.assert_close(run(filled, observations[33:]), run(stepped, observations[33:]),
                               atol=2e-3, rtol=2e-3)


@pytest.mark.cuda
@pytest.mark.parametrize('rnn_type', ['lstm', 'gru'])
def test_scripted_policy_captured_equals_eager_and_the_file_on_cuda(tmp_path, rnn_type):
    # the TorchScript file's own forward, its state buffers in the arena, inside a CUDA graph,
    # with the last-action feedback slot filled in the graph too
    from flashrt_ros.runtime.engine import PolicyEngine
    torch.manual_seed(11)
    rnn = (nn.LSTM if rnn_type == 'lstm' else nn.GRU)(OBS, 32, 1)
    cls = ExportedLSTM if rnn_type == 'lstm' else ExportedGRU
    exported = torch.jit.script(cls(rsl_actor('elu', ACT), rnn, Normalizer(OBS)))
    exported.save(str(tmp_path / 'policy.pt'))
    feedback = (OBS - ACT, ACT, [1.0], [0.0], None)
    path = str(tmp_path / 'policy.pt')
    engines = [PolicyEngine(make_policy('recurrent', OBS, ACT, file=path), device='cuda',
                            cuda_graph=graph, capsule_dir=str(tmp_path / str(graph)),
                            last_action=feedback) for graph in (True, False)]
    assert engines[0].graph_captured and not engines[1].graph_captured
    direct = torch.jit.load(str(tmp_path / 'policy.pt'), map_location='cuda')
    last = torch.zeros(ACT)
    for obs in torch.randn(100, OBS):
        obs[OBS - ACT:] = 0
        captured, eager = (e.step(obs.numpy()) for e in engines)
        assert torch.equal(captured, eager)
        full = obs.clone()
        full[OBS - ACT:] = last
        with torch.no_grad():
            expected = direct(full.cuda().unsqueeze(0)).view(-1).cpu()
        assert torch.equal(eager, expected), (eager - expected).abs().max()
        last = expected
    observations = torch.randn(20, OBS)
    engines[0].snapshot('s')
    after = [engines[0].step(o.numpy()) for o in observations]
    engines[0].restore('s')
    assert all(torch.equal(a, engines[0].step(o.numpy())) for a, o in zip(after, observations))
