"""PolicyEngine: the correctness contract (byte-exact, action-identical, rollback, ablation),
capsule operations through the engine, bad input, and stepping under concurrent operations.

Runs with two toy policies written against the Policy contract (a GRU-like recurrent toy and an
append-growth KV toy) and with the real 'recurrent' and 'history' policies from policies.py.
"""

import hashlib
import os
import random
import threading
import time

import pytest
import torch

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.errors import (BudgetExceeded, CapacityExceeded, CapsuleExists,
                                        CorruptCapsule, IncompatibleCapsule, InvalidConfig,
                                        InvalidName, InvalidObservation, PathOutsideDirectory,
                                        RollbackUnavailable, UnknownCapsule)
from flashrt_ros.runtime.state import BufferSpec, META_POSITION

OBS, ACT = 6, 3


class ToyGRU(torch.nn.Module):
    """h <- tanh(Wx x + Wh h); action = Wo h. State: one recurrent buffer."""

    kind = 'recurrent'
    capacity = 0

    def __init__(self, hidden=16, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.obs_dim, self.act_dim, self.hidden = OBS, ACT, hidden
        self.wx = torch.nn.Parameter(torch.randn(hidden, OBS, generator=g) * 0.5)
        self.wh = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.3)
        self.wo = torch.nn.Parameter(torch.randn(ACT, hidden, generator=g))

    def state_specs(self):
        return [BufferSpec('h', (self.hidden,), torch.float32, 'recurrent')]

    def bind(self, views):
        self.h, self.meta = views['h'], views['meta']

    def reset_state(self):
        self.h.fill_(0.1)

    @torch.no_grad()
    def step(self, obs, action):
        self.h.copy_(torch.tanh(self.wx @ obs + self.wh @ self.h))
        action.copy_(self.wo @ self.h)

    def model_digest(self):
        h = hashlib.sha256()
        for name, p in self.named_parameters():
            h.update(name.encode())
            h.update(p.detach().cpu().numpy().tobytes())
        return h.hexdigest()


class ToyKV(ToyGRU):
    """Attention over an append KV cache, plus recurrent, conv and chunk state."""

    kind = 'history'

    def __init__(self, capacity=512, dim=8, seed=0):
        super().__init__(hidden=dim, seed=seed)
        g = torch.Generator().manual_seed(seed + 1)
        self.capacity, self.dim = capacity, dim
        self.wk = torch.nn.Parameter(torch.randn(dim, OBS, generator=g))
        self.wv = torch.nn.Parameter(torch.randn(dim, OBS, generator=g))
        self.wq = torch.nn.Parameter(torch.randn(dim, OBS, generator=g))

    def state_specs(self):
        return [BufferSpec('k', (self.capacity, self.dim), torch.float32, 'kv', 'append'),
                BufferSpec('v', (self.capacity, self.dim), torch.float32, 'kv', 'append'),
                BufferSpec('h', (self.dim,), torch.float32, 'recurrent'),
                BufferSpec('conv', (3, self.dim), torch.float32, 'conv'),
                BufferSpec('chunk', (2, ACT), torch.float32, 'chunk')]

    def bind(self, views):
        self.views = views
        super().bind(views)

    def reset_state(self):
        self.h.fill_(0.1)
        self.views['conv'].fill_(0.2)
        self.views['chunk'].fill_(0.3)

    @torch.no_grad()
    def step(self, obs, action):
        v = self.views
        pos = self.meta[META_POSITION:META_POSITION + 1]                   # [1]
        v['k'].index_copy_(0, pos, (self.wk @ obs).unsqueeze(0))
        v['v'].index_copy_(0, pos, (self.wv @ obs).unsqueeze(0))
        scores = v['k'] @ (self.wq @ obs + self.h)                          # [capacity]
        mask = torch.arange(self.capacity) > pos
        attn = torch.softmax(scores.masked_fill(mask, float('-inf')), 0) @ v['v']   # [dim]
        v['conv'].copy_(torch.cat([v['conv'][1:], attn.unsqueeze(0)]))
        self.h.copy_(torch.tanh(self.wh @ self.h + v['conv'].mean(0)))
        v['chunk'].copy_(torch.cat([v['chunk'][1:], (self.wo @ self.h).unsqueeze(0)]))
        action.copy_(v['chunk'].sum(0))
        pos.add_(1)

    def prefill(self, observations):
        scratch = torch.empty(ACT)
        for row in observations:
            self.step(row, scratch)


def _real(kind, seed=0, **sizes):
    from flashrt_ros.runtime.policies import make_policy
    if kind == 'recurrent':
        sizes = {'rnn_type': 'gru', 'rnn_hidden_dim': 32, 'actor_hidden_dims': (32,), **sizes}
    else:
        sizes = {'d_model': 32, 'n_layers': 2, 'heads': 2, 'capacity': 512, 'chunk': 4,
                 **sizes}
    return make_policy(kind, OBS, ACT, seed=seed, **sizes)


POLICIES = {
    'toy_gru': lambda seed=0, **kw: ToyGRU(seed=seed, **kw),
    'toy_kv': lambda seed=0, **kw: ToyKV(seed=seed, **kw),
    'recurrent': lambda seed=0, **kw: _real('recurrent', seed, **kw),
    'history': lambda seed=0, **kw: _real('history', seed, **kw),
}


def make_engine(tmp_path, kind='toy_kv', seed=0, depth=8, **kw):
    sizes = kw.pop('sizes', {})
    return PolicyEngine(POLICIES[kind](seed=seed, **sizes), device='cpu', rollback_depth=depth,
                        capsule_dir=str(tmp_path / 'capsules'), debug=True, **kw)


def observations(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, OBS, generator=g)


def live(engine):
    return engine.arena.storage[:engine.arena.live_nbytes(engine.position)].clone()


@pytest.fixture(params=list(POLICIES))
def kind(request):
    return request.param


def test_byte_exact_restore(tmp_path, kind):
    e = make_engine(tmp_path, kind)
    for o in observations(20):
        e.step(o)
    r = e.snapshot('c')
    before = live(e)
    for o in observations(15, seed=2):
        e.step(o)
    assert not torch.equal(live(e)[:before.numel()], before)
    e.restore('c')
    assert torch.equal(live(e), before)
    assert torch.equal(live(e), e.store.get('c').data)
    assert (e.step_index, e.position) == (r.manifest.step, r.manifest.position) == (20, 20 * (
        e.arena.capacity > 0))


def test_action_identical_after_restore_200_steps(tmp_path, kind):
    e = make_engine(tmp_path, kind)
    for o in observations(30):
        e.step(o)
    e.snapshot('c')
    future = observations(200, seed=3)
    original = [e.step(o) for o in future]
    e.restore('c')
    replay = [e.step(o) for o in future]
    assert all(torch.equal(a, b) for a, b in zip(original, replay))
    assert len({a.numpy().tobytes() for a in original}) > 100   # the actions do vary


@pytest.mark.parametrize('kind', ['toy_kv', 'history'])
def test_kv_only_restore_diverges(tmp_path, kind):
    e = make_engine(tmp_path, kind)
    for o in observations(40):
        e.step(o)
    e.snapshot('c')
    future = observations(30, seed=4)
    original = [e.step(o) for o in future]
    e.reset_episode()                       # everything back to the initial state
    e.restore('c', kinds=['kv', 'meta'])    # KV (+ position) only: recurrent/conv/chunk stay
    assert e.position == 40
    ablated = [e.step(o) for o in future]
    assert not all(torch.equal(a, b) for a, b in zip(original, ablated))
    e.restore('c')                          # and the full restore still matches
    assert all(torch.equal(a, e.step(o)) for a, o in zip(original, future))
    with pytest.raises(InvalidConfig, match='unknown kinds'):
        e.restore('c', kinds=['weights'])


def test_a_restore_without_meta_says_the_step_counter_stays(tmp_path):
    """Partial restores name what they did: with the meta buffers the counters go back to the
    capsule's step; without them they stay, and the message says so."""
    e = make_engine(tmp_path, 'history')
    for o in observations(5):
        e.step(o)
    e.snapshot('c')
    for o in observations(3, seed=5):
        e.step(o)
    kv = e.restore('c', kinds=['kv'])
    assert 'taken at step 5' in kv.message and 'counter stays at 8' in kv.message, kv.message
    assert e.restore('c', kinds=['kv', 'meta']).message.endswith('to step 5')


def test_rollback_exact_for_every_k_and_refused_beyond(tmp_path, kind):
    depth = 8
    e = make_engine(tmp_path, kind, depth=depth)
    obs = observations(depth + 5)
    states, positions = [], []
    for o in obs:
        states.append(live(e))
        positions.append(e.position)
        e.step(o)
    n = len(obs)
    assert e.rollback_available == depth
    for k in range(1, depth + 1):
        e.rollback(k)
        assert e.step_index == n - k and e.position == positions[n - k]
        assert torch.equal(live(e), states[n - k]), f'rollback({k}) is not S_(n-k)'
        assert e.rollback_available == depth - k
        for o in obs[n - k:]:
            e.step(o)
        assert e.rollback_available == depth
    with pytest.raises(RollbackUnavailable, match=f'cannot roll back {depth + 1} steps'):
        e.rollback(depth + 1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(RollbackUnavailable):
            e.rollback(bad)
    e.snapshot('c')
    e.restore('c')
    assert e.rollback_available == 0
    before = live(e)
    with pytest.raises(RollbackUnavailable, match='0 available'):
        e.rollback(1)
    assert torch.equal(live(e), before)


def test_fork_independence(tmp_path):
    e = make_engine(tmp_path)
    for o in observations(10):
        e.step(o)
    e.fork('', 'a')
    a_bytes = e.store.get('a').data.clone()
    e.fork('a', 'b')
    assert e.store.get('b').manifest.parent == 'a'
    assert e.store.get('b').data.data_ptr() != e.store.get('a').data.data_ptr()
    e.restore('b')
    for o in observations(10, seed=5):
        e.step(o)
    e.snapshot('b', overwrite=True)
    assert torch.equal(e.store.get('a').data, a_bytes)
    e.delete('a')
    e.fork('b', 'c')
    e.restore('c')
    assert torch.equal(live(e), e.store.get('b').data)
    with pytest.raises(UnknownCapsule):
        e.fork('a', 'd')
    with pytest.raises(CapsuleExists):
        e.fork('b', 'c')


def test_save_load_round_trip_and_continuation(tmp_path, kind):
    e = make_engine(tmp_path, kind)
    for o in observations(12):
        e.step(o)
    e.snapshot('c')
    r = e.save('c')
    assert os.path.isfile(os.path.join(e.store.directory, 'c.capsule'))
    assert 'c.capsule' in r.message
    future = observations(20, seed=6)
    original = [e.step(o) for o in future]
    other = make_engine(tmp_path, kind)          # a fresh process would see the same file
    assert other.load('c.capsule', name='c2').path == r.path == os.path.join(
        e.store.directory, 'c.capsule')
    other.restore('c2')
    assert torch.equal(live(other), e.store.get('c').data)
    assert all(torch.equal(a, other.step(o)) for a, o in zip(original, future))


def test_bad_files_refused_with_precise_messages(tmp_path):
    e = make_engine(tmp_path, 'toy_kv')
    for o in observations(5):
        e.step(o)
    e.snapshot('c')
    path = os.path.join(e.store.directory, 'c.capsule')
    e.save('c')
    good = open(path, 'rb').read()
    before, state = e.store.list(), live(e)

    other_model = make_engine(tmp_path, 'toy_kv', seed=9)
    with pytest.raises(IncompatibleCapsule) as err:
        other_model.load('c.capsule')
    assert str(err.value) == (
        f"capsule 'c' was taken with model digest {e.model_digest[:12]} but the loaded "
        f'policy is {other_model.model_digest[:12]}')
    other_schema = make_engine(tmp_path, 'toy_kv', sizes={'capacity': 256})
    with pytest.raises(IncompatibleCapsule, match='schema digest ' + e.arena.schema_digest[:12]):
        other_schema.load('c.capsule')

    flipped = bytearray(good)
    flipped[-5] ^= 0x10
    open(path, 'wb').write(flipped)
    with pytest.raises(CorruptCapsule, match='failed its checksum'):
        e.load('c.capsule', name='x')
    open(path, 'wb').write(good[:len(good) // 2])
    with pytest.raises(CorruptCapsule, match='truncated'):
        e.load('c.capsule', name='x')
    assert e.store.list() == before and torch.equal(live(e), state)
    assert other_model.store.list() == [] and other_schema.store.list() == []


def test_bad_names_and_paths_refused(tmp_path):
    e = make_engine(tmp_path, 'toy_gru')
    e.step(observations(1)[0])
    for bad in ('../x', 'a/b', '', '..'):
        if bad:
            with pytest.raises(InvalidName):
                e.snapshot(bad)
        with pytest.raises((InvalidName, UnknownCapsule)):
            e.restore(bad)
    with pytest.raises(UnknownCapsule, match="no capsule named 'nope'"):
        e.restore('nope')
    e.snapshot('c')
    with pytest.raises(CapsuleExists):
        e.snapshot('c')
    with pytest.raises(PathOutsideDirectory):
        e.save('c', '/tmp/evil.safetensors')
    with pytest.raises(PathOutsideDirectory):
        e.load('../../etc/passwd')
    assert [m.name for m in e.store.list()] == ['c']
    assert e.snapshot().manifest.name.startswith('snap-1-')


def test_bad_observations_refused_state_untouched(tmp_path):
    e = make_engine(tmp_path, 'toy_kv')
    for o in observations(3):
        e.step(o)
    state = live(e)
    nan, inf = torch.ones(OBS), torch.ones(OBS)
    nan[2], inf[4] = float('nan'), float('inf')
    for bad, match in ((torch.ones(OBS + 1), 'shape'), (nan, 'NaN'), (inf, 'Inf'),
                       (['a'] * OBS, 'not numeric'), (torch.full((OBS,), 1e300,
                                                                 dtype=torch.float64), 'Inf')):
        with pytest.raises(InvalidObservation, match=match):
            e.step(bad)
    bad_rows = observations(4)
    bad_rows[2, 1] = float('nan')
    with pytest.raises(InvalidObservation, match='NaN'):
        e.prefill(bad_rows)
    assert e.rejected_observations == 6
    assert e.step_index == 3 and e.position == 3 and torch.equal(live(e), state)
    e.step(observations(1)[0])                   # the loop carries on
    assert e.step_index == 4


def test_snapshot_holds_live_bytes_not_capacity(tmp_path):
    e = make_engine(tmp_path, 'toy_kv', sizes={'capacity': 16384, 'dim': 4})
    e.prefill(observations(2048))
    assert e.position == 2048
    m = e.snapshot('c').manifest
    assert m.nbytes == e.arena.static_nbytes + 2048 * e.arena.row_nbytes
    assert m.nbytes < e.arena.total_nbytes / 7


def test_capacity_exceeded(tmp_path):
    e = make_engine(tmp_path, 'toy_kv', sizes={'capacity': 4})
    for o in observations(4):
        e.step(o)
    state = live(e)
    with pytest.raises(CapacityExceeded, match='history is full'):
        e.step(observations(1)[0])
    with pytest.raises(CapacityExceeded):
        e.prefill(observations(1))
    assert torch.equal(live(e), state)


def test_reset_episode(tmp_path):
    e = make_engine(tmp_path, 'toy_kv')
    initial = live(e)
    for o in observations(5):
        e.step(o)
    e.reset_episode()
    assert (e.episode, e.step_index, e.position) == (1, 0, 0)
    assert int(e.arena['meta'][1]) == 1
    e.arena['meta'][1] = 0                       # the only difference is the episode counter
    assert torch.equal(live(e), initial)
    e.arena['meta'][1] = 1
    for o in observations(3):
        e.step(o)
    e.snapshot('episode_start')
    start = e.store.get('episode_start').data.clone()
    for o in observations(7):
        e.step(o)
    e.reset_episode()
    assert e.episode == 2 and e.step_index == 3
    meta = e.arena['meta'].clone()
    assert int(meta[1]) == 2
    e.arena['meta'][1] = 1                       # the only difference is the episode counter
    assert torch.equal(live(e), start)
    e.arena['meta'].copy_(meta)


def test_latency_reported(tmp_path):
    e = make_engine(tmp_path, 'toy_gru')
    for o in observations(10):
        e.step(o)
    p50, p99 = e.step_latency_us()
    assert 0 < p50 <= p99
    assert e.snapshot('c').latency_us > 0 and e.restore('c').latency_us > 0


@pytest.mark.parametrize('kind', ['toy_kv', 'history'])
def test_concurrent_ops_never_see_torn_state(tmp_path, kind):
    """With a constant observation the state after t steps is a function of t alone, whatever
    the interleaving of rollbacks and restores; so every snapshot must equal S_t of the
    reference run, and every action must be one the reference run produced."""
    obs = observations(1, seed=7)[0]
    ref_engine = make_engine(tmp_path / 'ref', kind)
    n = 400                                  # the stepper never goes past step n
    states, actions = [live(ref_engine)], set()
    for _ in range(n):
        actions.add(ref_engine.step(obs).numpy().tobytes())
        states.append(live(ref_engine))

    e = make_engine(tmp_path, kind, depth=8)
    errors, stop, steps = [], threading.Event(), [0]

    def stepper():
        try:
            while not stop.is_set() and steps[0] < n:
                a = e.step(obs)
                steps[0] += 1
                if a.numpy().tobytes() not in actions:
                    errors.append('action not from the reference run')
                time.sleep(0)                # let the other thread take the lock
        except Exception as exc:             # surface in the main thread
            errors.append(repr(exc))

    rng = random.Random(0)
    t = threading.Thread(target=stepper)
    t.start()
    first = steps[0]
    for i in range(60):
        m = e.snapshot(f's{i}').manifest
        if not torch.equal(e.store.get(m.name).data, states[m.step]):
            errors.append(f'snapshot at step {m.step} is not a state the run passed through')
        op = rng.random()
        if op < 0.4 and e.rollback_available:
            try:
                e.rollback(rng.randint(1, 8))
            except RollbackUnavailable:
                pass                         # fewer available than asked: refused, fine
        elif op < 0.7:
            e.restore(f's{rng.randrange(i + 1)}')
        time.sleep(0)
    interleaved = steps[0] - first
    stop.set()
    t.join()
    assert not errors, errors[:3]
    assert interleaved > 0, 'the stepper never ran while operations did'


def test_full_budget_refused_state_and_store_unchanged(tmp_path):
    probe = make_engine(tmp_path / 'probe', 'toy_gru')
    nbytes = probe.arena.live_nbytes(0)
    e = make_engine(tmp_path, 'toy_gru', device_budget=nbytes, host_budget=0)
    e.step(observations(1)[0])
    e.snapshot('a', pin=True)
    e.step(observations(1)[0])
    before, state = e.store.list(), live(e)
    with pytest.raises(BudgetExceeded, match='device tier cannot take'):
        e.snapshot('b')
    with pytest.raises(BudgetExceeded):
        e.fork('a', 'c')
    assert e.store.list() == before and torch.equal(live(e), state)
    e.delete('a')
    # a CPU engine's device tier is host memory: results say so, as list_capsules does
    assert e.snapshot('b').manifest.tier == 'host'
    assert e.restore('b').manifest.tier == 'host'
    assert e.store.placement()['b'] == 'device'      # the budget it counts against


def test_meta_buffer_is_engine_owned(tmp_path):
    class Bad(ToyGRU):
        def state_specs(self):
            return super().state_specs() + [BufferSpec('meta', (4,), torch.int64, 'meta')]
    with pytest.raises(InvalidConfig, match='meta'):
        PolicyEngine(Bad(), capsule_dir=str(tmp_path))


@pytest.mark.cuda
@pytest.mark.parametrize('kind', ['recurrent', 'history'])
def test_cuda_graph_contract(tmp_path, kind):
    if not torch.cuda.is_available():
        print('skipping: CUDA is not available on this machine')
        pytest.skip('CUDA is not available')
    depth = 8
    e = PolicyEngine(POLICIES[kind](), device='cuda', cuda_graph=True, rollback_depth=depth,
                     capsule_dir=str(tmp_path), debug=True)
    assert e.graph_captured
    obs = observations(260)
    for o in obs[:30]:
        e.step(o)
    assert (e.step_index, e.position) == (30, 30 * (kind == 'history'))   # warm-up left no trace
    e.snapshot('c')
    before = live(e)
    original = [e.step(o) for o in obs[30:230]]
    e.restore('c')
    assert torch.equal(live(e), before)
    assert all(torch.equal(a, e.step(o)) for a, o in zip(original, obs[30:230]))
    states = []
    for o in obs[230:240]:
        states.append(live(e))
        e.step(o)
    for k in range(1, depth + 1):
        e.rollback(k)
        assert torch.equal(live(e), states[len(states) - k]), f'rollback({k})'
        for o in obs[240 - k:240]:
            e.step(o)
    if kind == 'history':
        e.reset_episode()
        e.restore('c', kinds=['kv', 'meta'])
        ablated = [e.step(o) for o in obs[30:60]]
        assert not all(torch.equal(a, b) for a, b in zip(original, ablated))
    p50, p99 = e.step_latency_us()
    print(f'{kind} cuda graph step p50 {p50:.1f} us p99 {p99:.1f} us')


def test_finite_flag_rides_with_the_action(tmp_path):
    e = make_engine(tmp_path, 'toy_gru')
    obs = observations(3)
    e.step(obs[0])
    assert e.last_step_finite
    e.snapshot('ok')
    e.arena['h'][0] = float('nan')          # a poisoned recurrent state
    action = e.step(obs[1])
    assert not e.last_step_finite and not torch.isfinite(action).all()
    e.restore('ok')
    e.step(obs[2])
    assert e.last_step_finite


def test_host_tier_restore_and_frozen_manifests(tmp_path):
    e = make_engine(tmp_path, 'toy_kv')
    obs = observations(20)
    for o in obs[:5]:
        e.step(o)
    m = e.snapshot('h', tier='host').manifest
    assert m.tier == 'host' and e.fork('h', 'f').manifest.tier == 'host'
    with pytest.raises(AttributeError):
        m.step = 0              # the store's record cannot be changed through a result
    before, expected = live(e), [e.step(o) for o in obs[5:20]]
    e.restore('h')
    assert torch.equal(live(e), before)
    assert all(torch.equal(a, e.step(o)) for a, o in zip(expected, obs[5:20]))


@pytest.mark.cuda
def test_cuda_copy_paths_agree_bit_for_bit(tmp_path):
    """cuda-python copies (Transfer) and torch copies give the same bytes and actions, for
    device- and host-tier capsules, forks and rollbacks."""
    if not torch.cuda.is_available():
        print('skipping: CUDA is not available on this machine')
        pytest.skip('CUDA is not available')
    runs = {}
    for use in (True, False):
        e = PolicyEngine(POLICIES['history'](), device='cuda', rollback_depth=4,
                         capsule_dir=str(tmp_path / str(use)), use_cuda_python=use, debug=True)
        obs, acts = observations(40), []
        for o in obs[:10]:
            acts.append(e.step(o))
        e.snapshot('d')
        e.snapshot('h', tier='host')
        e.fork('d', 'f')
        for o in obs[10:20]:
            acts.append(e.step(o))
        e.rollback(3)
        for name in ('h', 'f', 'd'):
            e.restore(name)
            acts += [e.step(o) for o in obs[20:30]]
        runs[use] = (e.transfer.backend, torch.stack(acts), live(e))
    print(f'backends: {runs[True][0]} vs {runs[False][0]}')
    assert runs[False][0] == 'torch'
    assert torch.equal(runs[True][1], runs[False][1])
    assert torch.equal(runs[True][2], runs[False][2])


def test_history_step_runs_the_smallest_span_covering_the_position(tmp_path):
    e = make_engine(tmp_path, 'history')          # capacity 512
    program = e.program
    assert program.spans == [64, 128, 256, 512] and len(program.graphs) == 4
    for position, span in ((0, 64), (63, 64), (64, 128), (200, 256), (511, 512)):
        assert program.graphs[program.spans.index(span)] is program.graph_for(position), position
    # a span only drops rows the mask hides: actions match the whole-capacity step
    reference = make_engine(tmp_path / 'ref', 'history')
    whole = reference.program
    whole.spans, whole.graphs = [None], [whole.graph]
    obs = observations(150)
    got = torch.stack([e.step(o) for o in obs])
    want = torch.stack([reference.step(o) for o in obs])
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_cuda_span_graphs_equal_eager_bit_for_bit(tmp_path):
    if not torch.cuda.is_available():
        print('skipping: CUDA is not available on this machine')
        pytest.skip('CUDA is not available')
    obs, runs = observations(300), []
    for graph in (True, False):
        e = PolicyEngine(POLICIES['history'](), device='cuda', cuda_graph=graph,
                         capsule_dir=str(tmp_path / str(graph)))
        assert e.graph_captured == graph and len(e.program.spans) == 4
        runs.append(torch.stack([e.step(o) for o in obs]))      # crosses 64, 128 and 256
    assert torch.equal(runs[0], runs[1])


def test_input_tag_is_state(tmp_path):
    """The tag of the consumed input follows the state: capsules, rollback, reset."""
    e = make_engine(tmp_path, 'toy_kv')
    obs = observations(4)
    assert e.input_tag() == 0
    e.step(obs[0], tag=11)
    e.snapshot('at11')
    e.step(obs[1], tag=12)
    assert e.input_tag() == 12 and e.last_action() is None      # no fed-back action here
    e.rollback(1)
    assert e.input_tag() == 11
    e.step(obs[1], tag=12)
    e.step(obs[2])                      # untagged steps keep the last tag
    assert e.input_tag() == 12
    e.restore('at11')
    assert e.input_tag() == 11
    e.reset_episode()
    assert e.input_tag() == 0
    before = live(e)
    for bad in (0, -1, 1 << 63, 1.5, '3'):
        with pytest.raises(InvalidObservation, match='tag'):
            e.step(obs[3], tag=bad)
    assert torch.equal(live(e), before)


@pytest.mark.cuda
def test_cuda_integrated_memory_host_tier_needs_no_copy(tmp_path):
    """Jetson Thor's GPU shares the host's DRAM (cudaDevAttrIntegrated): a host-tier capsule
    stays device memory and demotion to the host tier is a relabel. Forced on a discrete GPU
    here (the flag is what the engine reads from the device properties)."""
    if not torch.cuda.is_available():
        print('skipping: CUDA is not available on this machine')
        pytest.skip('CUDA is not available')
    e = PolicyEngine(POLICIES['recurrent'](), device='cuda', capsule_dir=str(tmp_path))
    assert e.store.integrated == torch.cuda.get_device_properties(0).is_integrated
    e.store.integrated = True
    obs = observations(12)
    for o in obs[:4]:
        e.step(o)
    h = e.snapshot('h', tier='host')
    assert h.manifest.tier == 'host' and e.store.get('h').data.is_cuda
    e.snapshot('d')
    ptr = e.store.get('d').data.data_ptr()
    e.store.device_budget = e.store.get('d').manifest.nbytes   # room for one capsule:
    e.snapshot('x')                                              # 'd' moves to the host tier
    assert e.store.placement()['d'] == 'host' and e.store.get('d').data.data_ptr() == ptr
    expected = [e.step(o) for o in obs[4:12]]
    for name in ('h', 'd'):
        e.restore(name)
        assert all(torch.equal(a, e.step(o)) for a, o in zip(expected, obs[4:12]))
