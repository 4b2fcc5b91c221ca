"""Real-time chunking on the engine (runtime/policies/lerobot_rtc.py), SmolVLA: the actions are
LeRobot's own RTC loop (its RTCProcessor guidance, its ActionQueue) bit for bit, with the
delay fixed; the guidance is load-bearing; a capsule taken while a chunk is in flight lands the
same chunk at the same step, 8 times, after a rollback and in a fresh process; settings that
cannot work are refused. The model is the tiny SmolVLA LeRobot builds offline
(support/smolvla.py); Pi0 and Pi0.5 are in test_lerobot_pi0.py."""
import pytest
import torch

pytest.importorskip('lerobot.policies.smolvla.modeling_smolvla',
                    reason='needs lerobot and transformers (requirements/vla.txt)')

from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy  # noqa: E402

from flashrt_ros.runtime.engine import PolicyEngine  # noqa: E402
from flashrt_ros.runtime.errors import IncompatibleCapsule, InvalidConfig  # noqa: E402
from flashrt_ros.runtime.policies.lerobot_smolvla import SmolVLAChunkPolicy  # noqa: E402
from support.prefix import steps_in_a_fresh_process  # noqa: E402
from support.rtc import lerobots_rtc_actions, rtc_config  # noqa: E402
from support.smolvla import checkpoint, frames, pipeline, vectors, vlm_folder  # noqa: E402

CHUNK, SEED, HORIZON = 8, 7, 4     # the demo checkpoint's chunk_size; noise seed; horizon
DEVICES = ['cpu', pytest.param('cuda', marks=pytest.mark.cuda)]


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
    return checkpoint(vlm_folder(tmp_path_factory.mktemp('smolvlm')),
                      tmp_path_factory.mktemp('checkpoint'))


def _engine(folder, tmp_path, device='cpu', delay=2, threshold=3):
    policy = SmolVLAChunkPolicy.from_pretrained(
        folder, seed=SEED, rtc_delay=delay, rtc_queue_threshold=threshold,
        rtc_execution_horizon=HORIZON, rtc_schedule='exp')
    return PolicyEngine(policy, device=device, capsule_dir=str(tmp_path / 'capsules'))


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('delay', [0, 2])
def test_actions_equal_lerobots_real_time_chunking_loop(folder, tmp_path, device, delay):
    """Four chunks (the first at once, then each launched with 3 actions left and landing
    `delay` steps later): LeRobot's loop's actions bit for bit; without the guidance
    (no leftover) LeRobot's actions differ from the second chunk on."""
    reference, (pre, post) = SmolVLAPolicy.from_pretrained(folder).eval().to(device), \
        pipeline(folder)
    engine = _engine(folder, tmp_path, device, delay=delay)
    policy = engine.policy
    assert policy._guided[False].captured == (device == 'cuda')
    batch = frames(20, seed=2)
    shape = (1, CHUNK, 16)
    want = lerobots_rtc_actions(reference, pre, post, batch, rtc_config(HORIZON), delay, 3,
                                SEED, shape, device)
    got, chunks = [], []
    for obs in vectors(folder, batch):
        got.append(engine.step(obs).cpu())
        chunks.append(policy.fresh_chunk(policy.views))
    landed = [c is not None for c in chunks]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), \
        [t for t, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    first = CHUNK - 3       # the step that launches the second chunk
    # then every CHUNK - 3 steps: a landed chunk holds CHUNK - delay, launches with 3 left
    landings = [t for t, x in enumerate(landed) if x]
    assert landings[:3] == [0, first + delay, first + delay + CHUNK - 3]
    # the landed chunk (what ~/action_chunk sends) is the actions the steps then take
    for t, after in zip(landings, landings[1:] + [len(got)]):
        n = min(after - t, len(chunks[t]))
        assert torch.equal(torch.from_numpy(chunks[t][:n]), torch.stack(got[t:t + n])), t
    unguided = lerobots_rtc_actions(reference, pre, post, batch, rtc_config(HORIZON), delay,
                                    3, SEED, shape, device, guided=False)
    assert all(torch.equal(a, b) for a, b in zip(unguided[:first + delay], want))
    assert not torch.equal(unguided[first + delay], want[first + delay])


@pytest.mark.parametrize('device', DEVICES)
def test_a_fleets_flights_overlap_and_each_chunk_is_computed_once(folder, tmp_path, device):
    """Two robots whose chunks are in flight at once (one launches while the other's has
    not landed): each robot's actions are a one-robot engine's bit for bit, and each chunk is
    computed once (the landing takes the chunk that ran for it, kept while the other robot's
    ran; it was computed again, synchronously, at every landing)."""
    import numpy as np
    fleet = PolicyEngine(_engine(folder, tmp_path / 'f', device).policy, device=device,
                         capsule_dir=str(tmp_path / 'fleet'), sessions=2)
    policy, computed = fleet.policy, []
    for kept, graph in policy._guided.items():
        graph.replay = lambda run=graph.replay: computed.append(1) or run()
    alone = [_engine(folder, tmp_path / f'alone{i}', device) for i in range(2)]
    obs = [vectors(folder, frames(20, seed=seed)) for seed in (11, 12)]
    for t in range(20):
        # the second robot a step behind: each of its launches falls inside the first's
        # flight (launched a step before, landing two steps after)
        active = np.array([True, t >= 1])
        rows = np.stack([obs[0][t], obs[1][max(t - 1, 0)]])
        got = fleet.step_all(rows, active=active)
        assert torch.equal(got[0], alone[0].step(obs[0][t]).cpu()), t
        if active[1]:
            assert torch.equal(got[1], alone[1].step(obs[1][t - 1]).cpu()), t
    launches = [a.policy.views['rng'][1].item() - 1 for a in alone]     # guided chunks
    assert len(computed) == sum(launches) and min(launches) >= 2, (computed, launches)


@pytest.mark.parametrize('device', DEVICES)
def test_a_capsule_taken_in_flight_lands_the_same_chunk(folder, tmp_path, device):
    """Snapshot one step after a launch (the chunk in flight): the run after it (the landing,
    the next launch and landing) replays bit for bit 8 times, after a rollback into the flight,
    after a different episode ran in between, and in a fresh process."""
    engine = _engine(folder, tmp_path, device)
    obs = vectors(folder, frames(18, seed=4))
    for o in obs[:CHUNK - 3 + 1]:
        engine.step(o)
    assert engine.policy.views['left'].tolist()[1] == 1      # one step to landing
    engine.snapshot('flight')
    later = obs[CHUNK - 3 + 1:]
    want = torch.stack([engine.step(o) for o in later])
    other = vectors(folder, frames(CHUNK, seed=9))
    for i in range(8):
        engine.restore('flight')
        if i % 2:           # another episode's chunk in flight meanwhile
            engine.reset_episode()
            for o in other:
                engine.step(o)
            engine.restore('flight')
        assert torch.equal(torch.stack([engine.step(o) for o in later]), want), i
    engine.restore('flight')
    for o in later[:3]:
        engine.step(o)
    engine.rollback(2)      # back into the next flight
    assert torch.equal(torch.stack([engine.step(o) for o in later[1:]]), want[1:])
    fresh = steps_in_a_fresh_process(
        engine, 'flight', 'from test_lerobot_rtc import _engine\n'
        f'e = _engine({folder!r}, pathlib.Path({str(tmp_path)!r}), {device!r})', later, tmp_path)
    assert torch.equal(fresh, want.cpu())


@pytest.mark.cuda
def test_a_launch_queued_behind_a_busy_side_stream_runs_on_its_own_inputs(folder, tmp_path):
    """On CUDA a launch returns at once and its chunk may wait on the side stream behind
    other sessions' flights (held busy here for ~0.1 s): the steps after it write the next
    observations and the state meanwhile, and the flight still runs on the inputs of its
    launch. At the other launches the current stream is held busy instead: the side stream
    waits for the launch's copies of its inputs. Each chunk computed once (none again at its
    landing: its inputs were the state's), the actions a one-robot engine's bit for bit."""
    engine, alone = (_engine(folder, tmp_path / name, 'cuda') for name in ('e', 'a'))
    policy, computed = engine.policy, []
    for graph in policy._guided.values():
        graph.replay = lambda run=graph.replay: computed.append(1) or run()
    obs = vectors(folder, frames(20, seed=13))
    for t, o in enumerate(obs):
        left, landing, _ = policy.views['left'].tolist()
        if left == 3 and landing < 0:       # this step launches (threshold 3)
            held = policy._side if len(computed) % 2 else torch.cuda.current_stream()
            with torch.cuda.stream(held):
                torch.cuda._sleep(int(2e8))
        assert torch.equal(engine.step(o), alone.step(o)), t
    launches = policy.views['rng'][1].item() - 1
    assert len(computed) == launches >= 2, (computed, launches)


def test_a_kv_restore_while_a_kept_prefix_chunk_flies_lands_as_a_fresh_engine_would(
        folder, tmp_path):
    """A chunk in flight on the kept prefix, and a restore of kinds [kv] (another scene's
    prefix) before it lands: the landing leaves the state a fresh engine's landing leaves
    (the flight's prefix computed again), bit for bit, not the restored one under the
    flight's chunk; the actions are the same either way. (Found by a fuzzer.)"""
    engine = _engine(folder, tmp_path)
    scene, other = vectors(folder, frames(2, seed=1))
    engine.step(other)
    engine.snapshot('other')            # its kv: the other scene's prefix
    engine.reset_episode()
    for _ in range(CHUNK - 3 + 1):      # the first chunk, then a launch on the kept prefix
        engine.step(scene)
    flight = engine.policy._flights[engine.policy._session()]
    assert flight.kept and engine.policy.views['left'].tolist()[1] == 1
    engine.restore('other', kinds=['kv'])
    engine.snapshot('flight')
    live = torch.stack([engine.step(scene) for _ in range(2)])
    fresh = _engine(folder, tmp_path)       # another engine: no flight in its graphs
    fresh.restore(fresh.load(engine.save('flight').path).manifest.name)
    assert torch.equal(torch.stack([fresh.step(scene) for _ in range(2)]), live)
    assert torch.equal(engine.arena.blocks[0], fresh.arena.blocks[0])


def test_settings_that_cannot_work_are_refused(folder, tmp_path):
    """The old queue must last the delay, a landed chunk must hold more than the threshold;
    a checkpoint that enables RTC itself is refused (the node sets it); a capsule of other RTC
    settings is not restored (they change the actions)."""
    for delay, threshold in ((3, 2), (2, 6), (0, 0), (4, 4)):
        with pytest.raises(InvalidConfig, match='rtc_delay <= rtc_queue_threshold'):
            _engine(folder, tmp_path, delay=delay, threshold=threshold)
    with pytest.raises(InvalidConfig, match='rtc_schedule'):
        SmolVLAChunkPolicy.from_pretrained(folder, rtc_delay=1, rtc_queue_threshold=2,
                                           rtc_schedule='cosine')
    from lerobot.processor import NormalizerProcessorStep
    stats = next(s.stats for s in pipeline(folder)[0].steps
                 if isinstance(s, NormalizerProcessorStep))
    lerobot = SmolVLAPolicy.from_pretrained(folder)
    lerobot.config.rtc_config = rtc_config(HORIZON)
    with pytest.raises(InvalidConfig, match='enables real-time chunking'):
        SmolVLAChunkPolicy(lerobot, stats=stats, rtc_delay=1, rtc_queue_threshold=2)
    with pytest.raises(InvalidConfig, match='enables real-time chunking'):
        SmolVLAChunkPolicy(lerobot, stats=stats)        # (it would be ignored)
    a = _engine(folder, tmp_path)
    a.snapshot('a')
    a.save('a', str(tmp_path / 'capsules' / 'a.capsule'))
    b = _engine(folder, tmp_path, delay=1)
    with pytest.raises(IncompatibleCapsule):
        b.load(str(tmp_path / 'capsules' / 'a.capsule'), 'a')
