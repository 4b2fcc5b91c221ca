'''StepGraph: eager on CPU (one code path), captured replay on CUDA equal to eager.'''

import pytest
import torch

from flashrt_ros.runtime.graph import StepGraph
from flashrt_ros.runtime.policies import make_policy
from flashrt_ros.runtime.state import BufferSpec, META_POSITION, StateArena

OBS, ACT = 12, 4
POLICIES = [('recurrent', dict(rnn_hidden_dim=64, actor_hidden_dims=(64, 32), noise_std=0.1)),
            ('recurrent', dict(rnn_type='gru', rnn_hidden_dim=64, actor_hidden_dims=(64,))),
            ('history', dict(d_model=64, n_layers=4, heads=4, capacity=128, chunk=4,
                             noise_std=0.1)),
            ('history', dict(d_model=64, n_layers=4, heads=4, capacity=128, chunk=4,
                             dtype='bfloat16'))]


def cuda_or_skip():
    if not torch.cuda.is_available():
        reason = 'CUDA is not available: captured-graph tests run on the GPU machine'
        print(reason)
        pytest.skip(reason)


def test_eager_replay_calls_fn_each_time():
    calls = []
    graph = StepGraph(lambda: calls.append(1), 'cpu', enabled=True, state=torch.zeros(8))
    assert not graph.captured and calls == []          # CPU: no warm-up, no capture
    for _ in range(3):
        graph.replay()
    assert len(calls) == 3


def test_disabled_capture_is_eager_on_any_device():
    calls = []
    graph = StepGraph(lambda: calls.append(1), 'cuda', enabled=False)
    graph.replay()
    assert not graph.captured and calls == [1]


def test_debug_check_catches_a_moved_buffer():
    buf = torch.zeros(4)
    graph = StepGraph(lambda: buf.add_(1), 'cpu', enabled=False, check={'buf': buf})
    graph.replay()
    buf.set_(torch.zeros(4))                           # same tensor object, new storage
    with pytest.raises(RuntimeError, match='buf'):
        graph.replay()


def build(kind, sizes, device):
    '''Policy bound to a fresh arena on device, with static obs/action staging buffers.'''
    policy = make_policy(kind, OBS, ACT, seed=5, device=device, **sizes)
    meta = BufferSpec('meta', (4,), torch.int64, 'meta')
    arena = StateArena(policy.state_specs() + [meta], device)
    policy.bind(arena.views)
    policy.reset_state()
    obs, action = torch.zeros(OBS, device=device), torch.zeros(ACT, device=device)
    return policy, arena, obs, action


@pytest.mark.cuda
@pytest.mark.parametrize('kind,sizes', POLICIES)
def test_captured_replay_equals_eager(kind, sizes):
    cuda_or_skip()
    eager_policy, eager_arena, eager_obs, eager_action = build(kind, sizes, 'cuda')
    policy, arena, obs, action = build(kind, sizes, 'cuda')
    initial = arena.storage.clone()
    ptrs = {name: view.data_ptr() for name, view in arena.views.items()}

    graph = StepGraph(lambda: policy.step(obs, action), 'cuda', enabled=True,
                      state=arena.storage, check=dict(arena.views, obs=obs, action=action))
    eager = StepGraph(lambda: eager_policy.step(eager_obs, eager_action), 'cuda', enabled=False)
    assert graph.captured and not eager.captured
    # warm-up ran the step 3 times; the saved copy put every byte back
    assert torch.equal(arena.storage, initial)
    assert int(arena.views['meta'][META_POSITION]) == 0

    observations = torch.randn(100, OBS, device='cuda',
                               generator=torch.Generator('cuda').manual_seed(0))
    for t in range(100):
        obs.copy_(observations[t])
        eager_obs.copy_(observations[t])
        graph.replay()
        eager.replay()
        # the graph replays the kernels the eager step launched, with the same shapes, so
        # bits match; if this ever fails first suspect cuBLAS/SDPA picking another algorithm
        # under capture (workspace limits), which would be a kernel difference, not a bug
        assert torch.equal(action, eager_action), f'step {t}'
    assert torch.equal(arena.storage, eager_arena.storage)
    assert {name: view.data_ptr() for name, view in arena.views.items()} == ptrs
    if kind == 'history':
        assert int(arena.views['meta'][META_POSITION]) == 100


@pytest.mark.cuda
def test_graphs_share_one_pool_and_restore_between_replays():
    cuda_or_skip()
    policy, arena, obs, action = build(*POLICIES[0], 'cuda')
    first = StepGraph(lambda: policy.step(obs, action), 'cuda', enabled=True,
                      state=arena.storage)
    second = StepGraph(lambda: policy.step(obs, action), 'cuda', enabled=True,
                       state=arena.storage, pool=first.pool)
    assert second.pool == first.pool
    obs.normal_()
    snapshot = arena.storage.clone()
    first.replay()
    expected = action.clone()
    arena.storage.copy_(snapshot)          # a restore: same addresses, so the graph still holds
    second.replay()
    assert torch.equal(action, expected)


@pytest.mark.cuda
def test_host_built_constants_are_captured_and_a_changing_one_is_refused():
    """Library code that builds constants from host values on every call (LeRobot's masks and
    timesteps) captures under host_constants: the replay uses the kept constants, and writing
    the result in place does not change them; a host value that changes between calls is
    refused at capture instead of being frozen into the graph."""
    cuda_or_skip()
    x = torch.arange(4.0, device='cuda')
    out = {}

    def fn():
        scale = torch.tensor([2.0, 3.0, 4.0, 5.0], device='cuda')
        shift = torch.ones(4).to('cuda')
        scale.add_(1)                   # in place on the stand-in: a copy of the constant
        out['y'] = x * scale + shift
    graph = StepGraph(fn, 'cuda', enabled=True, host_constants=True)
    assert graph.captured
    for _ in range(8):
        graph.replay()
        assert torch.equal(out['y'], x * torch.tensor([3.0, 4.0, 5.0, 6.0], device='cuda') + 1)
    calls = []

    def changing():
        calls.append(1)
        out['z'] = x * torch.tensor(float(len(calls)), device='cuda')
    with pytest.raises(RuntimeError, match='changed value between calls'):
        StepGraph(changing, 'cuda', enabled=True, host_constants=True)
