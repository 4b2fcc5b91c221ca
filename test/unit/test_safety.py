'''The safety supervisor (flashrt_ros/runtime/safety.py) on simulated readings, with a real
engine (a seeded recurrent policy, 3 joints): each detector trips past its limit and not
before, each response does what it says, rollbacks go further back per trip in a row and end
in a hold, the trip capsule replays the tripping action bit for bit, and the start-up fade.
No ROS.'''
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.errors import InvalidConfig
from flashrt_ros.runtime.policies import make_policy
from flashrt_ros.runtime.safety import parse, Supervisor, tilt
from support.robots import G1, NEEDS_G1

JOINTS = ['a', 'b', 'c']
DEFAULT = [0.1, -0.2, 0.3]
PERIOD = 0.02
UPRIGHT = ((0.0, 0.0, 0.0, 1.0), (0.0, 0.0, 0.0))


def config(**changes):
    cfg = dict(joint_names=JOINTS, default_angles=DEFAULT, joint_lower_limits=[-1.0],
               joint_upper_limits=[1.0], safety_joint_margin=0.1, safety_max_tilt=0.5,
               safety_max_joint_velocity=[5.0], safety_max_action_rate=2.0,
               safety_safe_every=2, safety_safe_keep=3, safety_max_rollbacks=2,
               safety_ramp_time=0.1, safety_startup_ramp=0.0, control_mode='timer',
               safety_model_file='')
    cfg.update(changes)
    return SimpleNamespace(**cfg)


class Log:
    def __init__(self):
        self.lines = []

    def error(self, text, **_):
        self.lines.append(text)


def make(tmp_path, entries, **changes):
    cfg = config(**changes)
    policy = make_policy('recurrent', 6, 3, seed=0, rnn_hidden_dim=8)
    engine = PolicyEngine(policy, device='cpu', cuda_graph=False, capsule_dir=str(tmp_path))
    return engine, Supervisor(engine, None, cfg, parse(entries, cfg, 3), PERIOD, Log())


def obs(k):
    return torch.randn(6, generator=torch.Generator().manual_seed(100 + k))


def joint_state(q=(0.0, 0.0, 0.0), dq=(0.0, 0.0, 0.0)):
    return (JOINTS, np.array(q), np.array(dq))


def tilted(angle):
    '''An IMU reading tilted by `angle` about x.'''
    return ((math.sin(angle / 2), 0.0, 0.0, math.cos(angle / 2)), (0.0, 0.0, 0.0))


def run_clean(engine, sup, steps, start=0):
    '''steps supervised steps that trip nothing; returns the actions.'''
    actions = []
    for k in range(start, start + steps):
        action = engine.step(obs(k)).numpy()
        assert sup.detect(joint_state(), UPRIGHT, action) == []
        sup.passed(joint_state(), action, np.asarray(DEFAULT) + 0.01 * action)
        actions.append(action)
    return actions


def test_tilt_from_the_imu_orientation():
    assert tilt((0.0, 0.0, 0.0, 1.0)) == 0.0
    assert tilt(tilted(0.3)[0]) == pytest.approx(0.3)
    assert tilt(tilted(math.pi / 2)[0]) == pytest.approx(math.pi / 2)
    # a turn about the vertical is no tilt
    assert tilt((0.0, 0.0, math.sin(0.4), math.cos(0.4))) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize('detector, below, above', [
    ('tilt', dict(imu=tilted(0.49)), dict(imu=tilted(0.51))),
    ('joint_position', dict(js=joint_state(q=(1.09, 0, 0))), dict(js=joint_state(q=(1.11, 0, 0)))),
    ('joint_velocity', dict(js=joint_state(dq=(0, -4.9, 0))),
     dict(js=joint_state(dq=(0, -5.1, 0)))),
    ('action_rate', dict(action=[1.9, 0, 0]), dict(action=[2.1, 0, 0])),
])
def test_each_detector_trips_past_its_limit_only(tmp_path, detector, below, above):
    engine, sup = make(tmp_path, [f'{detector}:hold'])
    sup.passed(joint_state(), np.zeros(3), np.asarray(DEFAULT))     # last action 0

    def seen(case):
        return sup.detect(case.get('js', joint_state()), case.get('imu', UPRIGHT),
                          np.asarray(case.get('action', [0.0, 0.0, 0.0])))
    assert seen(below) == []
    trips = seen(above)
    assert [d for d, _ in trips] == [detector], trips


def test_hold_keeps_the_last_safe_targets_until_cleared(tmp_path):
    engine, sup = make(tmp_path, ['tilt:hold'])
    run_clean(engine, sup, 3)
    safe = sup.last_targets.copy()
    action = engine.step(obs(3)).numpy()
    trips = sup.detect(joint_state(), tilted(1.0), action)
    targets, done, trip = sup.tripped(trips)
    assert trip.detector == 'tilt' and trip.response == 'hold' and not trip.restored
    assert done == 'hold' and sup.holding and sup.trips == 1
    assert np.array_equal(targets, safe)
    assert all(np.array_equal(sup.held_targets(), safe) for _ in range(5))
    assert 'tilt' in sup.last_trip and 'hold' in sup.last_trip
    sup.clear()
    assert not sup.holding


def test_ramp_reaches_the_default_pose_in_ramp_time(tmp_path):
    engine, sup = make(tmp_path, ['joint_velocity:ramp'])      # 0.1 s at 0.02 s: 5 steps
    run_clean(engine, sup, 2)
    safe = sup.last_targets.copy()
    action = engine.step(obs(2)).numpy()
    first, _, _ = sup.tripped(sup.detect(joint_state(dq=(9, 0, 0)), UPRIGHT, action))
    ramp = [first] + [sup.held_targets() for _ in range(5)]
    assert np.allclose(ramp[0], safe + 0.2 * (np.asarray(DEFAULT) - safe))
    assert np.array_equal(ramp[4], np.asarray(DEFAULT)) and np.array_equal(ramp[5], ramp[4])


def test_rollback_goes_further_back_per_trip_in_a_row_then_holds(tmp_path):
    engine, sup = make(tmp_path, ['tilt:rollback'])
    run_clean(engine, sup, 6)               # safe capsules after steps 2, 4, 6
    assert [n for n in sup._safe] == ['safe-main-1', 'safe-main-2', 'safe-main-3']
    for _, name in ((1, 'safe-main-3'), (2, 'safe-main-2')):
        action = engine.step(obs(50)).numpy()
        targets, done, trip = sup.tripped(sup.detect(joint_state(), tilted(1.0), action))
        assert done == f'rollback to {name!r}' and not sup.holding and targets is None
        assert trip.restored == name and trip.restored_tag == engine.input_tag()
        assert engine.step_index == engine.store.get(name).manifest.step
    action = engine.step(obs(51)).numpy()
    _, done, _ = sup.tripped(sup.detect(joint_state(), tilted(1.0), action))
    assert done.startswith('hold (2 rollbacks in a row') and sup.holding
    assert sup.trips == 3 and len(sup.trip_capsules) == 3


def test_a_run_of_trips_ends_after_safe_every_clean_steps(tmp_path):
    engine, sup = make(tmp_path, ['tilt:rollback'])
    run_clean(engine, sup, 4)
    action = engine.step(obs(9)).numpy()
    assert sup.tripped(sup.detect(joint_state(), tilted(1.0), action))[1] == \
        "rollback to 'safe-main-2'"
    run_clean(engine, sup, 2, start=20)       # a new safe capsule: the run ends
    action = engine.step(obs(9)).numpy()
    assert sup.tripped(sup.detect(joint_state(), tilted(1.0), action))[1] == \
        "rollback to 'safe-main-3'"


def test_the_trip_capsule_replays_the_tripping_action_bit_for_bit(tmp_path):
    engine, sup = make(tmp_path, ['action_rate:hold'], safety_max_action_rate=0.0001)
    sup.last_action = [engine.step(obs(k)).numpy() for k in range(3)][-1]
    tripping = engine.step(obs(3)).numpy()
    sup.tripped(sup.detect(joint_state(), UPRIGHT, tripping))
    name = sup.trip_capsules[0]
    assert name == 'trip-main-1-action_rate' and engine.store.get(name).manifest.pinned
    for _ in range(8):
        engine.restore(name)
        assert np.array_equal(engine.step(obs(3)).numpy(), tripping)


def test_startup_fades_from_the_first_reading_to_the_policy(tmp_path):
    engine, sup = make(tmp_path, ['tilt:hold'], safety_startup_ramp=0.08)     # 4 steps
    start = np.array([0.5, 0.5, 0.5])
    policy = np.asarray(DEFAULT)
    out = [sup.passed(joint_state(q=start), np.zeros(3), policy) for _ in range(5)]
    for k, targets in enumerate(out[:4]):
        assert np.allclose(targets, start + (k + 1) / 4 * (policy - start))
    assert np.array_equal(out[4], policy)


@pytest.mark.parametrize('entries, changes, match', [
    (['tilt:damp'], {}, 'damp needs a command output with gains'),
    (['height:hold'], {}, 'unknown detector'),
    (['tilt:stop'], {}, 'response must be one of'),
    (['joint_position:hold'], dict(joint_lower_limits=[], joint_upper_limits=[]),
     'joint_position needs joint_lower_limits'),
    (['joint_velocity:hold'], dict(safety_max_joint_velocity=[1.0, 2.0]), 'one per joint'),
    (['action_rate:hold'], dict(safety_max_action_rate=0.0), 'must be > 0'),
    (['stale:rollback'], {}, 'no fault of the policy'),
    (['stale:hold'], dict(control_mode='lockstep'), "needs control_mode 'timer'"),
])
def test_configurations_that_cannot_work_are_refused(entries, changes, match):
    with pytest.raises(InvalidConfig, match=match):
        parse(entries, config(**changes), 3)


def test_replaying_steps_that_tripped_once_takes_no_safe_capsule(tmp_path):
    '''After a rollback, the steps between the safe capsule and the trip are a replay: in a
    deterministic world they lead to the same trip, so they neither take safe capsules nor end
    the run of trips, and the next trip goes one capsule further back.'''
    engine, sup = make(tmp_path, ['tilt:rollback'], safety_safe_every=3)
    run_clean(engine, sup, 8)               # safe capsules after steps 3 and 6
    action = engine.step(obs(30)).numpy()   # step 9 trips: back to step 6, 2 steps replayed
    assert sup.tripped(sup.detect(joint_state(), tilted(1.0), action))[1] == \
        "rollback to 'safe-main-2'"
    assert sup.probation == 2
    run_clean(engine, sup, 3, start=40)     # 2 replayed + 1 new: no capsule, the run goes on
    assert list(sup._safe) == ['safe-main-1', 'safe-main-2'] and sup.consecutive == 1
    action = engine.step(obs(31)).numpy()
    assert sup.tripped(sup.detect(joint_state(), tilted(1.0), action))[1] == \
        "rollback to 'safe-main-1'"


def test_a_stale_input_latches_its_response_without_a_step(tmp_path):
    engine, sup = make(tmp_path, ['stale:ramp'])
    run_clean(engine, sup, 2)
    safe, step = sup.last_targets.copy(), engine.step_index
    trip = sup.stale('imu is 250 ms old')
    assert trip.detector == 'stale' and trip.response == 'ramp' and sup.holding
    assert engine.step_index == step and sup.trips == 1
    assert np.allclose(sup.held_targets(), safe + 0.2 * (np.asarray(DEFAULT) - safe))
    assert sup.stale('again') is None and sup.trips == 1       # already holding


@NEEDS_G1
def test_joint_limits_from_the_model_file():
    '''safety_model_file: the MJCF's joint ranges (the G1's), by joint name.'''
    from flashrt_ros.runtime.safety import model_limits
    lower, upper = model_limits(G1 / 'scene.xml', ['left_hip_pitch_joint', 'left_knee_joint'])
    assert (lower[0], upper[0]) == (-2.5307, 2.8798)        # g1_12dof.xml's range
    assert lower[1] < upper[1]
    with pytest.raises(InvalidConfig, match="no joint 'elbow'"):
        model_limits(G1 / 'scene.xml', ['elbow'])


FRESH = '''
import sys, numpy as np, torch
from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.policies import make_policy
device, directory, path = sys.argv[1:4]
engine = PolicyEngine(make_policy('recurrent', 6, 3, seed=0, rnn_hidden_dim=8), device=device,
                      cuda_graph=device == 'cuda', capsule_dir=directory)
engine.load(path, name='trip')
engine.restore('trip')
obs = torch.randn(6, generator=torch.Generator().manual_seed(103))
print(engine.step(obs).cpu().numpy().tobytes().hex())
'''


@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.cuda)])
def test_trip_capsule_replays_8_times_and_in_a_fresh_process(tmp_path, device):
    '''On the device the engine runs on (CUDA: with its captured graph): the trip capsule,
    restored 8 times and in a fresh process from its file, gives the tripping action bit for
    bit, and a rollback restores the safe capsule's bytes.'''
    import subprocess
    import sys
    if device == 'cuda' and not torch.cuda.is_available():
        pytest.skip('CUDA is not available')
    cfg = config()
    policy = make_policy('recurrent', 6, 3, seed=0, rnn_hidden_dim=8)
    engine = PolicyEngine(policy, device=device, cuda_graph=device == 'cuda',
                          capsule_dir=str(tmp_path))
    sup = Supervisor(engine, None, cfg, parse(['tilt:rollback'], cfg, 3), PERIOD, Log())
    run_clean(engine, sup, 2)                     # one safe capsule
    tripping = engine.step(obs(3)).cpu().numpy()
    _, done, trip = sup.tripped(sup.detect(joint_state(), tilted(1.0), tripping))
    assert done == "rollback to 'safe-main-1'"
    assert engine.step_index == 2
    for _ in range(8):
        engine.restore(trip.trip_capsule)
        assert np.array_equal(engine.step(obs(3)).cpu().numpy(), tripping)
    path = engine.save(trip.trip_capsule).path
    out = subprocess.run([sys.executable, '-c', FRESH, device, str(tmp_path), path],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert bytes.fromhex(out.stdout.strip().splitlines()[-1]) == tripping.tobytes()
