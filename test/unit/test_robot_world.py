"""RobotWorld (flashrt_ros/sim/robot_world.py): a floating-base robot under joint PD control.

The Unitree G1 tests need the assets in ../shared/robots/unitree_g1 (beside the repository) and
skip with the reason where they are absent; the small inline model's tests always run. No ROS,
except the last test (the `flashrt_sim` node in 'mjcf' mode), which skips without rclpy.
Checks: the pretrained G1 policy walks with upstream's loop (and, without target clipping, the
world reproduces unitree_rl_gym's deploy_mujoco.py loop bit for bit); snapshot/restore replays
bit for bit; a push changes the trajectory, deterministically; bad input gets a clear error.
"""
import pathlib
import threading
import time

import numpy as np
import pytest

mujoco = pytest.importorskip('mujoco', reason='mujoco missing: '
                             'pip install -r requirements/runtime.txt')

from flashrt_ros.sim.robot_world import (  # noqa: E402
    load_upstream_config, RobotWorld, upstream_world, UpstreamController)

ROOT = pathlib.Path(__file__).resolve().parents[1]
G1 = ROOT.parent / 'shared' / 'robots' / 'unitree_g1'
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


@pytest.fixture(scope='module')
def g1():
    if not G1.is_dir():
        pytest.skip(f'robot assets absent: {G1} (the G1 model, policy and config are kept in '
                    'shared/robots beside the repository, not in it)')
    torch = pytest.importorskip('torch', reason='torch missing: run tools/bootstrap.sh')
    cfg = load_upstream_config(G1 / 'deploy_mujoco_g1.yaml')
    # A 1x64 LSTM step is too small to share: a second torch thread made the 20 s walk 5x
    # slower on a busy 2-core machine (same results).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield dict(cfg=cfg, scene=G1 / 'scene.xml',
               policy=lambda: torch.jit.load(str(G1 / 'motion.pt')))
    torch.set_num_threads(threads)


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


# -- the flashrt_sim node in 'mjcf' mode ---------------------------------------------------------


class _Latest:
    """Messages of one topic, with a wait for the n-th."""

    def __init__(self, node, msg_type, topic):
        self.msgs, self.cond = [], threading.Condition()
        node.create_subscription(msg_type, topic, self._on, 10)

    def _on(self, msg):
        with self.cond:
            self.msgs.append(msg)
            self.cond.notify_all()

    def wait(self, n, timeout=10.0):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.msgs) >= n, timeout), \
                f'{n} messages expected, {len(self.msgs)} came'
            return self.msgs[n - 1]


class _FromMessages:
    """What UpstreamController reads from a world, rebuilt from the published messages."""

    def __init__(self, js, imu, sim_dt):
        stamp = js.header.stamp
        self.steps = round((stamp.sec + stamp.nanosec * 1e-9) / sim_dt)
        self._js = (list(js.name), np.array(js.position), np.array(js.velocity),
                    np.array(js.effort))
        o, w, a = imu.orientation, imu.angular_velocity, imu.linear_acceleration
        self._imu = (np.array([o.w, o.x, o.y, o.z]), np.array([w.x, w.y, w.z]),
                     np.array([a.x, a.y, a.z]))

    def joint_state(self):
        return self._js

    def imu(self):
        return self._imu


@pytest.mark.ros
def test_sim_node_mjcf_mode_walks_over_topics(g1):
    """The policy loop closed over ROS topics: same walk as in process, bit for bit."""
    rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
    from geometry_msgs.msg import PoseStamped
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.parameter import Parameter
    from sensor_msgs.msg import Imu, JointState
    from std_msgs.msg import Float64MultiArray
    from std_srvs.srv import Trigger

    from flashrt_ros import srv as fsrv
    from flashrt_ros.sim.sim_node import make_sim_node

    cfg, periods = g1['cfg'], 60
    params = dict(world='mjcf', mjcf_path=str(g1['scene']),
                  kps=[int(k) for k in cfg['kps']],          # YAML integers are accepted
                  kds=cfg['kds'].astype(float).tolist(),
                  default_angles=cfg['default_angles'].astype(float).tolist(),
                  sim_dt=cfg['simulation_dt'], decimation=cfg['control_decimation'])
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    sim = make_sim_node('flashrt_sim_mjcf', context=ctx, parameter_overrides=[
        Parameter(k, value=v) for k, v in params.items()])
    node = rclpy.create_node('mjcf_test_client', context=ctx)
    executor = SingleThreadedExecutor(context=ctx)
    executor.add_node(sim)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        base = '/flashrt_sim_mjcf'
        js = _Latest(node, JointState, base + '/joint_states')
        imu = _Latest(node, Imu, base + '/imu')
        pose = _Latest(node, PoseStamped, base + '/base_pose')
        cmd = node.create_publisher(Float64MultiArray, base + '/joint_commands', 10)
        snapshot = node.create_client(fsrv.Snapshot, base + '/snapshot')
        restore = node.create_client(fsrv.Restore, base + '/restore')
        pubs = (sim.robot.joint_pub, sim.robot.imu_pub, sim.robot.pose_pub)
        deadline = time.monotonic() + 10.0
        while cmd.get_subscription_count() == 0 or any(
                pub.get_subscription_count() == 0 for pub in pubs):
            assert time.monotonic() < deadline, 'the sim node and the client did not match'
            time.sleep(0.01)

        def call(client, name):
            assert client.wait_for_service(timeout_sec=10.0)
            request = client.srv_type.Request()
            request.name = name
            future = client.call_async(request)
            end = time.monotonic() + 10.0
            while not future.done():
                assert time.monotonic() < end, f'{client.srv_name} did not answer'
                time.sleep(0.0005)
            return future.result()

        # Lock-step: the node's reset published nothing yet (no subscriber then); a restore of
        # a snapshot taken now publishes the start readings.
        assert call(snapshot, 'start').success
        assert call(restore, 'start').success
        n = 1
        world = upstream_world(g1['scene'], cfg)
        ours = UpstreamController(g1['policy'](), cfg)
        theirs = UpstreamController(g1['policy'](), cfg)
        for _ in range(periods):
            j, i, p = js.wait(n), imu.wait(n), pose.wait(n)
            assert j.header.stamp == i.header.stamp == p.header.stamp
            assert i.header.frame_id == 'pelvis' and p.header.frame_id == 'world'
            got = np.array([p.pose.position.x, p.pose.position.y, p.pose.position.z])
            assert got.tobytes() == world.base_position().tobytes()
            assert np.array(j.position).tobytes() == world.joint_state()[1].tobytes()
            targets = theirs(_FromMessages(j, i, cfg['simulation_dt']))
            world.step(ours(world))
            cmd.publish(Float64MultiArray(data=targets.astype(float).tolist()))
            n += 1
        pose.wait(n)
        assert pose.msgs[-1].pose.position.x > 0.2, 'the G1 did not walk forward over ROS'
        # A wrong-length command is refused (logged); the node carries on.
        cmd.publish(Float64MultiArray(data=[0.0] * 3))
        assert call(restore, 'start').success
        assert pose.wait(n + 1).pose.position.x == pose.msgs[0].pose.position.x
        assert sim.world.steps == cfg['control_decimation']
        # ~/step: one period holding the last targets, published like a command.
        step = node.create_client(Trigger, base + '/step')
        assert step.wait_for_service(timeout_sec=10.0)
        future = step.call_async(Trigger.Request())
        end = time.monotonic() + 10.0
        while not future.done():
            assert time.monotonic() < end, '~/step did not answer'
            time.sleep(0.0005)
        assert future.result().success
        stamp = js.wait(n + 2).header.stamp
        assert stamp.sec + stamp.nanosec * 1e-9 == pytest.approx(
            2 * cfg['control_decimation'] * cfg['simulation_dt'])
        with pytest.raises(ValueError, match="'mjcf' needs the parameters kps, kds"):
            make_sim_node('flashrt_sim_bad', context=ctx, parameter_overrides=[
                Parameter('world', value='mjcf'), Parameter('mjcf_path', value='x.xml'),
                Parameter('default_angles', value=[0.0])])
    finally:
        executor.shutdown()
        spinner.join(timeout=5.0)
        sim.destroy_node()
        node.destroy_node()
        rclpy.try_shutdown(context=ctx)
