'''Per-term observation history (Isaac Lab's history_length), no ROS.

On the real unitree_rl_lab G1 velocity bundle (../shared/robots/unitree_rl_lab_g1_velocity:
policy.onnx with 480 = 5 x 96 inputs, and the deploy.yaml Isaac Lab wrote for it), the engine
with per-term history is compared, step by step over an episode reset, with a reference
written here from Isaac Lab's documented semantics (ObservationManager.compute_group and
CircularBuffer): per term, the reading in float32, clipped, scaled; its buffer filled with the
first reading after a reset, flattened oldest first; terms concatenated in order
(test/support/isaaclab.py).
'''
import numpy as np
import pytest
import torch

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.errors import InvalidConfig
from flashrt_ros.runtime.observation import ObservationLayout
from flashrt_ros.runtime.policies import make_policy, TermHistory
from support.isaaclab import (BUNDLE, deploy, IsaacLabReference, JOINTS, ONNX, readings,
                              STEPS)

needs_bundle = pytest.mark.skipif(
    not ONNX.exists(), reason=f'needs the unitree_rl_lab G1 bundle in {BUNDLE} (../shared, '
    'absent in a fresh clone)')
# deploy.yaml term -> this package's term type
TYPES = {'base_ang_vel': 'base_ang_vel', 'projected_gravity': 'projected_gravity',
         'velocity_commands': 'command', 'joint_pos_rel': 'joint_pos',
         'joint_vel_rel': 'joint_vel', 'last_action': 'last_action'}
RESET_AT, SNAPSHOT_AT = 12, 2


def layout(cfg, history=True):
    terms = [{'name': name, 'type': TYPES[name], 'scale': term['scale'],
              **({'history_length': term['history_length']} if history else {})}
             for name, term in cfg['observations'].items()]
    return ObservationLayout(terms, JOINTS, cfg['default_joint_pos'], 29, 'isaaclab')


def engine_for(tmp_path, lay, name='run', **policy_args):
    policy = make_policy('mlp', lay.obs_dim, 29, file=str(ONNX),
                         term_history=lay.term_history(), **policy_args)
    return PolicyEngine(policy, device='cpu', cuda_graph=False,
                        capsule_dir=str(tmp_path / name), last_action=lay.device_feedback())


@needs_bundle
def test_per_term_history_matches_isaac_lab_and_onnxruntime(tmp_path):
    import onnxruntime
    cfg = deploy()
    lay = layout(cfg)
    assert lay.obs_dim == 96 and sum(s * n for s, n in lay.term_history()) == 480
    engine = engine_for(tmp_path, lay)
    plain = PolicyEngine(make_policy('mlp', 480, 29, file=str(ONNX)), device='cpu',
                         cuda_graph=False, capsule_dir=str(tmp_path / 'plain'))
    session = onnxruntime.InferenceSession(str(ONNX), providers=['CPUExecutionProvider'])
    reference, last, worst = IsaacLabReference(cfg), np.zeros(29, np.float32), 0.0
    for k, reading in enumerate(readings()):
        if k == RESET_AT:
            engine.reset_episode()
            reference.reset()
            last = np.zeros(29, np.float32)     # the action manager resets too
        joint_state, imu, command = reading
        action = engine.step(lay.assemble(k, joint_state, imu, command)).numpy()
        want_input = reference(reading, last)
        got_input = engine.arena.session_views[0]['term_history'].numpy()
        # the policy input: the reference's, bit for bit
        assert np.array_equal(got_input, want_input), \
            f'step {k}: input differs at {np.flatnonzero(got_input != want_input)[:8]}'
        # the actions: those of the package's own ONNX conversion fed that input, bit for bit
        assert np.array_equal(action, plain.step(want_input).numpy()), f'step {k}'
        ort = session.run(None, {'obs': want_input[None]})[0][0]
        worst = max(worst, float(np.abs(action - ort).max()))
        last = action
    print(f'per-term history vs onnxruntime over {STEPS} steps: max |diff| {worst:.3g}')
    assert worst < 1e-4


@needs_bundle
def test_whole_frame_history_gives_other_actions_on_this_bundle(tmp_path):
    '''The issue's finding, so the per-term test can fail: stacking whole 96-wide frames
    (zeros at the start) feeds this policy a different input and so different actions.'''
    cfg = deploy()
    per_term, whole = layout(cfg), layout(cfg, history=False)
    a = engine_for(tmp_path, per_term, 'a')
    diffs = {}
    for order in ('oldest_first', 'newest_first'):
        b = engine_for(tmp_path, whole, order, obs_history=5, history_order=order)
        a.reset_episode()
        for k, (joint_state, imu, command) in enumerate(readings()[:8]):
            x = a.step(per_term.assemble(k, joint_state, imu, command)).numpy()
            y = b.step(whole.assemble(k, joint_state, imu, command)).numpy()
            diffs[order] = max(diffs.get(order, 0.0), float(np.abs(x - y).max()))
    print(f'whole-frame vs per-term history, max |action diff|: {diffs}')
    assert all(d > 0.1 for d in diffs.values()), diffs


@needs_bundle
def test_capsule_mid_history_reproduces_actions_bit_for_bit(tmp_path):
    lay = layout(deploy())
    engine = engine_for(tmp_path, lay)
    obs = [lay.assemble(k, *r) for k, r in enumerate(readings(seed=1))]
    for o in obs[:SNAPSHOT_AT]:
        engine.step(o)
    engine.snapshot('mid')         # the windows still hold copies of the first reading
    original = [engine.step(o).numpy() for o in obs[SNAPSHOT_AT:]]
    for _ in range(2):
        engine.restore('mid')
        again = [engine.step(o).numpy() for o in obs[SNAPSHOT_AT:]]
        assert all(np.array_equal(x, y) for x, y in zip(original, again))
    # a fresh episode: the windows fill again from its first reading, as in a new engine
    engine.reset_episode()
    fresh = [engine.step(o).numpy() for o in obs[:3]]
    first = engine_for(tmp_path, lay, 'first')
    assert all(np.array_equal(f, first.step(o).numpy()) for f, o in zip(fresh, obs[:3]))


def test_term_windows_fill_then_shift_oldest_first(tmp_path):
    '''Two terms (history 3 and 1) over a recording policy: the input is the first term's
    window oldest first, then the second term's reading; the first step fills.'''
    seen = []

    class Record(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            seen.append(x.clone())
            return x[..., :1]

    inner = make_policy('mlp', 7, 1, actor_hidden_dims=[4])
    inner.actor = torch.nn.Sequential(Record())
    policy = TermHistory(inner, [(2, 3), (1, 1)])
    assert policy.obs_dim == 3
    engine = PolicyEngine(policy, device='cpu', cuda_graph=False, capsule_dir=str(tmp_path))
    for k in range(4):
        engine.step(np.array([k, 10 + k, 100 + k], np.float32))
    rows = [s.reshape(-1).tolist() for s in seen[-4:]]
    assert rows[0] == [0, 10, 0, 10, 0, 10, 100]
    assert rows[1] == [0, 10, 0, 10, 1, 11, 101]
    assert rows[3] == [1, 11, 2, 12, 3, 13, 103]


def test_fleet_sessions_keep_their_own_windows(tmp_path):
    '''A fleet steps batched views: each session's windows match a single-session run.'''
    terms = [(3, 2), (2, 4)]
    kwargs = dict(actor_hidden_dims=[8], seed=3, term_history=terms)
    fleet = PolicyEngine(make_policy('mlp', 5, 2, **kwargs), device='cpu', cuda_graph=False,
                         capsule_dir=str(tmp_path / 'f'), sessions=2, batch_sessions=True)
    alone = [PolicyEngine(make_policy('mlp', 5, 2, **kwargs), device='cpu', cuda_graph=False,
                          capsule_dir=str(tmp_path / f's{i}')) for i in range(2)]
    rng = np.random.default_rng(4)
    for _ in range(6):
        obs = rng.standard_normal((2, 5)).astype(np.float32)
        actions = fleet.step_all(obs).numpy()
        for i in range(2):
            single = alone[i].step(obs[i]).numpy()
            assert np.array_equal(fleet.arena.session_views[i]['term_history'].numpy(),
                                  alone[i].arena.session_views[0]['term_history'].numpy())
            assert np.allclose(actions[i], single, atol=1e-6)


def test_bad_term_history_is_refused():
    with pytest.raises(InvalidConfig, match='one or the other'):
        make_policy('mlp', 5, 2, obs_history=2, term_history=[(3, 2), (2, 1)])
    with pytest.raises(InvalidConfig, match='add up to 5 values, obs_dim is 6'):
        make_policy('mlp', 6, 2, term_history=[(3, 2), (2, 1)])
    inner = make_policy('mlp', 9, 2)
    with pytest.raises(InvalidConfig, match='stack to 8 policy inputs.*takes 9'):
        TermHistory(inner, [(3, 2), (2, 1)])
    with pytest.raises(InvalidConfig, match='history_length'):
        ObservationLayout([{'name': 'command', 'history_length': 0}], ['a'], [0.0], 1)


@needs_bundle
def test_onnx_width_mismatch_names_both_numbers():
    '''History 4 instead of 5: the bundle takes 480 inputs, the terms stack to 384.'''
    short = [(3, 4), (3, 4), (3, 4), (29, 4), (29, 4), (29, 4)]
    with pytest.raises(InvalidConfig, match='480') as info:
        make_policy('mlp', 96, 29, file=str(ONNX), term_history=short)
    assert '384' in str(info.value)
