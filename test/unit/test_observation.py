'''Observation assembly and joint targets (runtime/observation.py), no ROS.'''
import math

import numpy as np
import pytest

from flashrt_ros.runtime.errors import InvalidConfig, InvalidObservation
from flashrt_ros.runtime.observation import JointTargets, ObservationLayout, projected_gravity

JOINTS = ['a', 'b', 'c']
DEFAULT = [0.1, -0.2, 0.3]


def layout(terms, act_dim=3):
    return ObservationLayout(terms, JOINTS, DEFAULT, act_dim)


def state(order=JOINTS, q=(1.0, 2.0, 3.0), dq=(4.0, 5.0, 6.0)):
    index = [JOINTS.index(n) for n in order]
    return list(order), np.array(q)[index], np.array(dq)[index]


IMU = ((0.0, 0.0, 0.0, 1.0), (0.1, 0.2, 0.3))


def test_terms_in_order_with_scales_offsets_and_clip():
    obs = layout([{'name': 'base_ang_vel', 'scale': [0.25]},
                  {'name': 'command', 'scale': [2.0, 2.0, 0.25]},
                  {'name': 'joint_pos'},
                  {'name': 'vel', 'type': 'joint_vel', 'scale': [0.5], 'clip': [2.6]},
                  {'name': 'last_action'}]).assemble(0, state(), IMU, (0.5, 0.1, 1.0))
    expected = np.array([0.025, 0.05, 0.075, 1.0, 0.2, 0.25, 0.9, 2.2, 2.7, 2.0, 2.5, 2.6,
                         0, 0, 0], dtype=np.float32)
    assert np.array_equal(obs, expected)


def test_joints_are_read_by_name_in_any_message_order():
    lay = layout([{'name': 'joint_pos'}, {'name': 'joint_vel'}])
    a = lay.assemble(0, state())
    b = lay.assemble(0, state(order=['c', 'a', 'b']))
    assert np.array_equal(a, b)


@pytest.mark.parametrize('reading, words', [
    (None, 'no joint state'),
    ((['a', 'b'], np.zeros(2), np.zeros(2)), "lacks joints ['c']"),
    ((['a', 'b', 'c', 'a'], np.zeros(4), np.zeros(4)), 'twice'),
    ((['a', 'b', 'c'], np.zeros(2), np.zeros(3)), 'length'),
])
def test_missing_duplicated_or_malformed_joint_states_are_refused(reading, words):
    with pytest.raises(InvalidObservation, match=words.replace('[', r'\[').replace(']', r'\]')):
        layout([{'name': 'joint_pos'}, {'name': 'joint_vel'}]).assemble(0, reading)


def test_missing_inputs_are_refused_not_defaulted():
    lay = layout([{'name': 'projected_gravity'}, {'name': 'command'},
                  {'name': 'x', 'type': 'raw', 'size': 2}])
    with pytest.raises(InvalidObservation, match='IMU'):
        lay.assemble(0, imu=None, command=(0, 0, 0), raw={'x': [1, 2]})
    with pytest.raises(InvalidObservation, match='command'):
        lay.assemble(0, imu=IMU, command=None, raw={'x': [1, 2]})
    with pytest.raises(InvalidObservation, match="'x'"):
        lay.assemble(0, imu=IMU, command=(0, 0, 0), raw={})
    with pytest.raises(InvalidObservation, match='2'):
        lay.assemble(0, imu=IMU, command=(0, 0, 0), raw={'x': [1, 2, 3]})
    with pytest.raises(InvalidObservation, match='unit quaternion'):
        lay.assemble(0, imu=((0, 0, 0, 0), (0, 0, 0)), command=(0, 0, 0), raw={'x': [1, 2]})


def test_imu_frame_conventions():
    # upright: gravity points down the base z axis
    assert np.allclose(projected_gravity((1, 0, 0, 0)), [0, 0, -1])
    # pitched nose-down by 90 deg about y: gravity along the base's +x... written out:
    s = math.sqrt(0.5)
    assert np.allclose(projected_gravity((s, 0, s, 0)), [1, 0, 0], atol=1e-12)
    # rolled 90 deg about x: gravity along the base's -y
    assert np.allclose(projected_gravity((s, s, 0, 0)), [0, -1, 0], atol=1e-12)
    # a ROS Imu orientation is (x, y, z, w): the layout converts
    obs = layout([{'name': 'projected_gravity'}]).assemble(0, imu=((s, 0, 0, s), (0, 0, 0)))
    assert np.allclose(obs, [0, -1, 0], atol=1e-7)


def test_phase_is_a_function_of_the_step_counter():
    lay = layout([{'name': 'phase', 'period': 0.8, 'dt': 0.02}])
    for k in (0, 7, 39, 40, 1000):
        phase = ((k + 1) * 0.02) % 0.8 / 0.8
        want = np.array([math.sin(2 * math.pi * phase), math.cos(2 * math.pi * phase)],
                        dtype=np.float32)
        assert np.array_equal(lay.assemble(k), want)
    assert np.array_equal(lay.assemble(3), lay.assemble(43))     # one period later


def test_bad_layouts_are_refused():
    with pytest.raises(InvalidConfig, match='type'):
        layout([{'name': 'speed'}])
    with pytest.raises(InvalidConfig, match='period'):
        layout([{'name': 'phase'}])
    with pytest.raises(InvalidConfig, match='not in joint_names'):
        layout([{'name': 'joint_pos', 'joints': ['z']}])
    with pytest.raises(InvalidConfig, match='duplicate'):
        ObservationLayout([{'name': 'joint_pos'}], ['a', 'a'], [0, 0], 2)
    with pytest.raises(InvalidConfig, match='scale'):
        layout([{'name': 'command', 'scale': [1, 2]}])
    with pytest.raises(InvalidConfig, match='unknown settings'):
        layout([{'name': 'command', 'gain': 2}])


def test_joint_targets_scale_offset_and_clip():
    targets = JointTargets(JOINTS, DEFAULT, [0.25], lower=[-1, -1, -1], upper=[1, 1, 0.35])
    out = targets(np.array([1.0, -8.0, 1.0], dtype=np.float32))
    assert np.allclose(out, [0.35, -1.0, 0.35]) and out.dtype == np.float64
    with pytest.raises(InvalidConfig, match='act_dim'):
        targets(np.zeros(2))


@pytest.mark.parametrize('bad', [math.inf, -math.inf, math.nan])
def test_nonfinite_readings_are_refused_even_where_a_clip_would_hide_them(bad):
    # before the check ran ahead of the clip, inf was clipped to 1.0 and stepped
    lay = layout([{'name': 'base_ang_vel', 'clip': [1.0]}, {'name': 'joint_pos', 'clip': [5]}])
    with pytest.raises(InvalidObservation, match=r"'base_ang_vel'.*NaN/Inf at elements \[1\]"):
        lay.assemble(0, state(), ((0.0, 0.0, 0.0, 1.0), (0.1, bad, 0.3)))
    with pytest.raises(InvalidObservation, match="'joint_pos'.*NaN/Inf"):
        lay.assemble(0, state(q=(1.0, bad, 3.0)), IMU)


def test_isaaclab_numerics_clip_before_scale_in_float32():
    terms = [{'name': 'joint_vel', 'scale': [0.05], 'clip': [10.0]}]
    reading = state(dq=(30.0, -0.3, 7.7))
    got = ObservationLayout(terms, JOINTS, DEFAULT, 3, 'isaaclab').assemble(0, reading)
    dq = np.array([30.0, -0.3, 7.7], dtype=np.float32)
    want = np.clip(dq, np.float32(-10), np.float32(10)) * np.float32(0.05)
    assert np.array_equal(got, want) and got[0] == np.float32(0.5)
    # this package's own arithmetic scales first: 30 * 0.05 = 1.5 stays unclipped
    assert layout(terms).assemble(0, reading)[0] == np.float32(1.5)


def test_unitree_rl_gym_numerics_follow_its_dtypes():
    terms = [{'name': 'joint_pos'}, {'name': 'command', 'scale': [2.0, 2.0, 0.25]},
             {'name': 'joint_vel', 'scale': [0.05]}]
    q, dq, cmd = (0.7, -0.35, 1.1), (0.3, -1.7, 2.9), (0.3, 0.1, 0.7)
    got = ObservationLayout(terms, JOINTS, DEFAULT, 3, 'unitree_rl_gym').assemble(
        0, state(q=q, dq=dq), command=cmd)
    default32 = np.array(DEFAULT, dtype=np.float32)
    want = np.concatenate([(np.array(q) - default32) * 1.0,
                           np.array(cmd, np.float32) * np.array([2, 2, 0.25], np.float32),
                           np.array(dq) * 0.05]).astype(np.float32)
    assert np.array_equal(got, want)
    targets = JointTargets(JOINTS, DEFAULT, [0.25], numerics='unitree_rl_gym')
    a = np.array([0.3, -1.1, 0.7], dtype=np.float32)
    assert np.array_equal(targets(a), (a * 0.25 + default32).astype(np.float64))
    with pytest.raises(InvalidConfig, match='observation_numerics'):
        ObservationLayout(terms, JOINTS, DEFAULT, 3, 'float16')


def test_phase_counts_simulation_steps_with_decimation():
    lay = layout([{'name': 'phase', 'period': 0.8, 'dt': 0.002, 'decimation': 10}])
    for k in (0, 7, 39, 1000):
        phase = ((k + 1) * 10 * 0.002) % 0.8 / 0.8
        want = np.array([math.sin(2 * math.pi * phase), math.cos(2 * math.pi * phase)],
                        dtype=np.float32)
        assert np.array_equal(lay.assemble(k), want)
    with pytest.raises(InvalidConfig, match='decimation'):
        layout([{'name': 'phase', 'period': 0.8, 'dt': 0.002, 'decimation': 0}])
