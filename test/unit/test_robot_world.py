"""RobotWorld (flashrt_ros/sim/robot_world.py): a floating-base robot under joint PD control.

The Unitree G1 tests need the assets in ../shared/robots/unitree_g1 (beside the repository) and
skip with the reason where they are absent (the `g1` fixture, test/conftest.py); the small
inline model's tests always run. No ROS (the `flashrt_sim` node in 'mjcf' mode:
test/ros/test_sim_node_mjcf.py).
Checks: the pretrained G1 policy walks with upstream's loop (and, without target clipping, the
world reproduces unitree_rl_gym's deploy_mujoco.py loop bit for bit); snapshot/restore replays
bit for bit; a push changes the trajectory, deterministically; bad input gets a clear error.
"""
import time

import numpy as np
import pytest

mujoco = pytest.importorskip('mujoco', reason='mujoco missing: '
                             'pip install -r requirements/runtime.txt')

from flashrt_ros.sim.robot_world import (  # noqa: E402
    RobotWorld, upstream_world, UpstreamController)

PERIODS_20S = 1000      # 20 s at upstream's 50 Hz policy rate

BOX = """
<mujoco>
  <compiler angle="radian"/>
  <option timestep="0.002"/>
  <worldbody>
    <geom name="floor" type="plane" size="5 5 0.1"/>
    <body name="base" pos="0 0 0.1" quat="{quat}">
      <freejoint name="root"/>
      <geom type="box" size="0.1 0.1 0.1" mass="2"/>
      <body name="flap1" pos="0.1 0 0">
        <joint name="j1" type="hinge" axis="0 0 1" range="-1 1" armature="0.01"/>
        <geom type="capsule" fromto="0 0 0 0.05 0 0" size="0.01" mass="0.1"/>
      </body>
      <body name="flap2" pos="-0.1 0 0">
        <joint name="j2" type="hinge" axis="0 0 1" armature="0.01"/>
        <geom type="capsule" fromto="0 0 0 -0.05 0 0" size="0.01" mass="0.1"/>
      </body>
    </body>
  </worldbody>
  <actuator>
    <motor name="m2" joint="j2"/>
    {actuator1}
  </actuator>
</mujoco>
"""


def box_world(tmp_path, quat='1 0 0 0', actuator1='<motor name="m1" joint="j1"/>', **kw):
    path = tmp_path / 'box.xml'
    path.write_text(BOX.format(quat=quat, actuator1=actuator1))
    args = dict(kps=[5.0, 5.0], kds=[0.1, 0.1], default_angles=[0.0, 0.0], decimation=10)
    args.update(kw)
    return RobotWorld(path, **args)


def readings(world):
    names, q, dq, tau = world.joint_state()
    return (names, q.tobytes(), dq.tobytes(), tau.tobytes(),
            *(r.tobytes() for r in world.imu()), world.base_position().tobytes(),
            world.sim_time, world.steps)


# -- (a) the G1 walks -------------------------------------------------------------------------


def test_g1_walks_20_seconds_with_upstreams_loop(g1):
    cfg = g1['cfg']
    world = upstream_world(g1['scene'], cfg)
    controller = UpstreamController(g1['policy'](), cfg, command=[0.5, 0.0, 0.0])
    start = world.base_position()
    heights = []
    t0 = time.perf_counter()
    for _ in range(PERIODS_20S):
        world.step(controller(world))
        heights.append(world.base_position()[2])
    seconds = time.perf_counter() - t0
    walked = world.base_position() - start
    print(f'G1, vx 0.5 m/s, {world.sim_time:.2f} s simulated in {seconds:.2f} s: walked '
          f'{walked[0]:.3f} m forward ({walked[1]:+.3f} m sideways), pelvis '
          f'{min(heights):.4f} - {max(heights):.4f} m')
    assert world.steps == (PERIODS_20S + 1) * cfg['control_decimation']
    assert min(heights) > 0.5, 'the G1 fell'
    assert walked[0] >= 8.0


def test_g1_reproduces_upstreams_loop_bit_for_bit(g1):
    """unitree_rl_gym deploy_mujoco.py, written out (viewer and sleep left out) vs RobotWorld
    with UpstreamController and no target clipping (upstream clips nothing)."""
    cfg, periods = g1['cfg'], 150
    kps, kds, default = cfg['kps'], cfg['kds'], cfg['default_angles']
    m = mujoco.MjModel.from_xml_path(str(g1['scene']))
    d = mujoco.MjData(m)
    m.opt.timestep = cfg['simulation_dt']
    policy = g1['policy']()
    import torch
    counter, target = 0, default.copy()
    action, obs = np.zeros(12, dtype=np.float32), np.zeros(47, dtype=np.float32)
    cmd = np.array([0.5, 0.0, 0.0], dtype=np.float32)
    upstream = []
    while len(upstream) < periods:
        tau = (target - d.qpos[7:]) * kps + (np.zeros(12, dtype=np.float32) - d.qvel[6:]) * kds
        d.ctrl[:] = tau
        mujoco.mj_step(m, d)
        counter += 1
        if counter % cfg['control_decimation'] == 0:
            upstream.append(d.qpos.tobytes() + d.qvel.tobytes())
            qj = (d.qpos[7:] - default) * cfg['dof_pos_scale']
            dqj = d.qvel[6:] * cfg['dof_vel_scale']
            qw, qx, qy, qz = d.qpos[3:7]
            omega = d.qvel[3:6] * cfg['ang_vel_scale']
            phase = (counter * cfg['simulation_dt']) % 0.8 / 0.8
            obs[:3] = omega
            obs[3:6] = [2 * (-qz * qx + qw * qy), -2 * (qz * qy + qw * qx),
                        1 - 2 * (qw * qw + qz * qz)]
            obs[6:9] = cmd * cfg['cmd_scale']
            obs[9:21], obs[21:33], obs[33:45] = qj, dqj, action
            obs[45], obs[46] = np.sin(2 * np.pi * phase), np.cos(2 * np.pi * phase)
            with torch.no_grad():
                action = policy(torch.from_numpy(obs).unsqueeze(0)).detach().numpy().squeeze()
            target = action * cfg['action_scale'] + default

    world = upstream_world(g1['scene'], cfg, clip_targets=False)
    controller = UpstreamController(g1['policy'](), cfg, command=cmd)
    ours = []
    for _ in range(periods):
        ours.append(world.data.qpos.tobytes() + world.data.qvel.tobytes())
        world.step(controller(world))
    first = next((i for i, (a, b) in enumerate(zip(upstream, ours)) if a != b), None)
    assert first is None, f'RobotWorld departs from upstream at policy step {first}'


# -- (b) snapshot / restore, (c) pushes ---------------------------------------------------------


@pytest.fixture(scope='module')
def walking(g1):
    """A G1 walking 100 periods, snapshot 'k' there, then 40 more periods under the policy:
    their targets and the original run's results (what a replay must give again)."""
    world = upstream_world(g1['scene'], g1['cfg'])
    controller = UpstreamController(g1['policy'](), g1['cfg'])
    for _ in range(100):
        world.step(controller(world))
    world.snapshot('k')
    targets, original = [], []
    for _ in range(40):
        targets.append(controller(world))
        original += run(world, targets[-1:])
    return world, targets, original


def run(world, targets):
    out = []
    for t in targets:
        obs, reward = world.step(t)
        out.append((world.state_bytes(), obs.tobytes(), reward, readings(world)))
    return out


def test_restore_replays_bit_for_bit(walking):
    world, targets, original = walking
    world.restore('k')
    at_k = (world.state_bytes(), readings(world), world.targets.tobytes())
    first = run(world, targets)
    assert first == original, 'the replay after a restore departs from the original run'
    assert world.steps == at_k[1][-1] + 40 * world.decimation
    assert world.restore('k').tobytes() == np.concatenate(
        [world.data.qpos, world.data.qvel]).tobytes()
    assert (world.state_bytes(), readings(world), world.targets.tobytes()) == at_k
    assert run(world, targets) == first
    # Holding the restored targets (step(None)) is the same as sending them again.
    world.restore('k')
    held = run(world, [None] * 3)
    world.restore('k')
    assert run(world, [world.targets.copy()] * 3) == held


def test_push_changes_the_trajectory_deterministically(walking):
    world, targets, plain = walking
    pushed = []
    for push in (0.3, 0.3, [0.0, 0.3, 0.0], -0.3):
        world.restore('k')
        world.perturb(push=push)
        pushed.append(run(world, targets))
    assert pushed[0] == pushed[1], 'the same push gave two trajectories'
    assert pushed[2] == pushed[0], 'a y push as one number and as (x, y, z) differ'
    assert pushed[0] != plain and pushed[3] != pushed[0]
    y = [np.frombuffer(r[3][7], dtype=np.float64)[1] for r in (plain[5], pushed[0][5])]
    assert y[1] > y[0], 'a +y push should move the pelvis towards +y'
    # Observation noise: seeded, on the observation only (the physics is the same).
    world.restore('k')
    world.perturb(noise_seed=7, noise_std=0.01)
    noisy = run(world, targets)
    world.restore('k')
    world.perturb(noise_seed=7, noise_std=0.01)
    assert run(world, targets) == noisy
    assert [r[0] for r in noisy] == [r[0] for r in plain]
    assert [r[1] for r in noisy] != [r[1] for r in plain]


def test_reset_starts_from_the_mjcf_and_holds_default_angles(g1):
    cfg = g1['cfg']
    world = upstream_world(g1['scene'], cfg)
    first = readings(world)
    assert world.steps == cfg['control_decimation']
    np.testing.assert_array_equal(world.targets, cfg['default_angles'].astype(np.float64))
    world.step(np.zeros(12))
    world.reset()
    assert readings(world) == first
    names = world.joint_names
    assert names[0] == 'left_hip_pitch_joint' and len(names) == 12 and world.base_body == 'pelvis'


def test_joint_order_is_the_callers(g1):
    cfg = g1['cfg']
    world = upstream_world(g1['scene'], cfg)
    rev = RobotWorld(g1['scene'], cfg['kps'][::-1], cfg['kds'][::-1],
                     cfg['default_angles'][::-1], sim_dt=cfg['simulation_dt'],
                     decimation=cfg['control_decimation'], joint_names=world.joint_names[::-1])
    rng = np.random.default_rng(0)
    for _ in range(5):
        t = cfg['default_angles'] + rng.normal(0.0, 0.05, 12)
        world.step(t)
        rev.step(t[::-1])
        assert world.state_bytes() == rev.state_bytes()
        _, q, dq, tau = rev.joint_state()
        np.testing.assert_array_equal(q[::-1], world.joint_state()[1])
        np.testing.assert_array_equal(tau[::-1], world.joint_state()[3])


# -- readings and bad input on a small inline model -----------------------------------------


def test_imu_reads_gravity_in_the_base_frame(tmp_path):
    """A box resting on the floor, rolled 90 degrees about x: its y axis points up, so an
    accelerometer reads +9.81 along base y, and the projected gravity agrees."""
    world = box_world(tmp_path, quat='0.70710678 0.70710678 0 0')
    for _ in range(50):
        world.step([0.0, 0.0])
    quat, gyro, acc = world.imu()
    np.testing.assert_allclose(acc, [0.0, 9.81, 0.0], atol=0.05)
    np.testing.assert_allclose(gyro, 0.0, atol=1e-2)
    qw, qx, qy, qz = quat
    gravity = [2 * (-qz * qx + qw * qy), -2 * (qz * qy + qw * qx), 1 - 2 * (qw * qw + qz * qz)]
    np.testing.assert_allclose(gravity, [0.0, -1.0, 0.0], atol=1e-3)
    assert world.joint_names == ['j2', 'j1'] and world.base_body == 'base'
    assert world.sim_time == pytest.approx(51 * 10 * 0.002)


def test_targets_clipped_to_joint_ranges(tmp_path):
    world = box_world(tmp_path)
    world.step([5.0, 5.0])                                   # j2 has no range, j1 [-1, 1]
    np.testing.assert_array_equal(world.targets, [5.0, 1.0])
    world = box_world(tmp_path, clip_targets=False)
    world.step([5.0, 5.0])
    np.testing.assert_array_equal(world.targets, [5.0, 5.0])


def test_bad_input_is_refused_clearly(tmp_path):
    world = box_world(tmp_path)
    world.snapshot('s')
    state = world.state_bytes()
    with pytest.raises(ValueError, match=r'targets have 3 values, the world takes 2 '
                                         r'\(joints: j2, j1\)'):
        world.step([0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match='NaN or Inf'):
        world.step([0.0, float('nan')])
    with pytest.raises(ValueError, match='push must be'):
        world.perturb(push=[1.0, 2.0])
    with pytest.raises(KeyError, match="no world snapshot named 'nope'"):
        world.restore('nope')
    with pytest.raises(ValueError, match='needs a name'):
        world.snapshot('')
    assert world.state_bytes() == state, 'a refused call changed the world'
    with pytest.raises(ValueError, match='kps has 3 values, the world has 2 joints'):
        box_world(tmp_path, kps=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="no joint named 'knee'"):
        box_world(tmp_path, joint_names=['j1', 'knee'])
    with pytest.raises(ValueError, match="joint 'root' is not a hinge or slide"):
        box_world(tmp_path, joint_names=['j1', 'root'])
    with pytest.raises(ValueError, match="joint 'j1' has no motor"):
        box_world(tmp_path, joint_names=['j2', 'j1'],
                  actuator1='<position name="m1" joint="j1" kp="10"/>')
    with pytest.raises(ValueError, match='decimation must be >= 1'):
        box_world(tmp_path, decimation=0)
    with pytest.raises(ValueError, match='joint names repeat'):
        box_world(tmp_path, joint_names=['j1', 'j1'])
    with pytest.raises(ValueError, match='sim_dt must be > 0'):
        box_world(tmp_path, sim_dt=-0.001)
    fixed = tmp_path / 'fixed.xml'
    fixed.write_text(BOX.format(quat='1 0 0 0', actuator1='').replace(
        '<freejoint name="root"/>', ''))
    with pytest.raises(ValueError, match='no free joint'):
        RobotWorld(fixed, [1.0], [0.1], [0.0])
