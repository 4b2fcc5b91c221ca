'''Vendor-exact: with the same readings, the G1's observation, action and joint targets as
config/g1.yaml builds them (observation_numerics: unitree_rl_gym) equal unitree_rl_gym's
deploy loop bit for bit. No ROS: the layout, engine and joint targets the node builds.

The vendor loop below is a transcription of unitree_rl_gym deploy/deploy_mujoco/
deploy_mujoco.py (commit fb7514a) on the real G1 model and policy in ../shared/robots/unitree_g1:
its dtypes (float32 default angles, cmd_scale, command; Python-float scales; float64 MuJoCo
readings), its order of operations, its phase from the simulation-step counter.

One thing is not the arithmetic's: the vendor calls the TorchScript LSTM with autograd on,
and torch 2.13 on CPU then computes it with other kernels than under no_grad (the actions
differ in the last bits from the second step on; measured here). The engine steps under
no_grad, so the end-to-end test runs the transcription under no_grad too; the faithful
(autograd on) loop is checked term by term: the node's observation and joint targets from
that loop's own readings and actions.
'''

import numpy as np
import pytest
import torch
import yaml

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.observation import JointTargets, ObservationLayout
from flashrt_ros.runtime.policies import make_policy
from support.robots import G1 as ROBOT, G1_YAML, NEEDS_G1

mujoco = pytest.importorskip('mujoco', reason='needs mujoco (the G1 world)')

pytestmark = NEEDS_G1
CONTROL_STEPS = 300         # 6 s of walking at 50 Hz


def get_gravity_orientation(quaternion):
    qw, qx, qy, qz = quaternion[0], quaternion[1], quaternion[2], quaternion[3]
    gravity_orientation = np.zeros(3)
    gravity_orientation[0] = 2 * (-qz * qx + qw * qy)
    gravity_orientation[1] = -2 * (qz * qy + qw * qx)
    gravity_orientation[2] = 1 - 2 * (qw * qw + qz * qz)
    return gravity_orientation


def vendor_loop(steps, autograd):
    '''deploy_mujoco.py's loop (viewer and sleeps left out): per control step the readings
    it used (float64 copies), the observation, action and target_dof_pos it computed.'''
    with torch.set_grad_enabled(autograd):
        return _vendor_loop(steps)


def _vendor_loop(steps):
    config = yaml.safe_load((ROBOT / 'deploy_mujoco_g1.yaml').read_text())
    simulation_dt = config['simulation_dt']
    control_decimation = config['control_decimation']
    kps = np.array(config['kps'], dtype=np.float32)
    kds = np.array(config['kds'], dtype=np.float32)
    default_angles = np.array(config['default_angles'], dtype=np.float32)
    ang_vel_scale = config['ang_vel_scale']
    dof_pos_scale = config['dof_pos_scale']
    dof_vel_scale = config['dof_vel_scale']
    action_scale = config['action_scale']
    cmd_scale = np.array(config['cmd_scale'], dtype=np.float32)
    num_actions = config['num_actions']
    cmd = np.array(config['cmd_init'], dtype=np.float32)
    action = np.zeros(num_actions, dtype=np.float32)
    target_dof_pos = default_angles.copy()
    obs = np.zeros(config['num_obs'], dtype=np.float32)
    counter = 0
    m = mujoco.MjModel.from_xml_path(str(ROBOT / 'scene.xml'))
    d = mujoco.MjData(m)
    m.opt.timestep = simulation_dt
    policy = torch.jit.load(str(ROBOT / 'motion.pt'))
    out = []
    while len(out) < steps:
        tau = (target_dof_pos - d.qpos[7:]) * kps + (np.zeros_like(kds) - d.qvel[6:]) * kds
        d.ctrl[:] = tau
        mujoco.mj_step(m, d)
        counter += 1
        if counter % control_decimation == 0:
            reading = (d.qpos[7:].copy(), d.qvel[6:].copy(), d.qpos[3:7].copy(),
                       d.qvel[3:6].copy())
            qj, dqj, quat, omega = reading
            qj = (qj - default_angles) * dof_pos_scale
            dqj = dqj * dof_vel_scale
            gravity_orientation = get_gravity_orientation(quat)
            omega = omega * ang_vel_scale
            period = 0.8
            count = counter * simulation_dt
            phase = count % period / period
            sin_phase = np.sin(2 * np.pi * phase)
            cos_phase = np.cos(2 * np.pi * phase)
            obs[:3] = omega
            obs[3:6] = gravity_orientation
            obs[6:9] = cmd * cmd_scale
            obs[9:9 + num_actions] = qj
            obs[9 + num_actions:9 + 2 * num_actions] = dqj
            obs[9 + 2 * num_actions:9 + 3 * num_actions] = action
            obs[9 + 3 * num_actions:9 + 3 * num_actions + 2] = np.array([sin_phase, cos_phase])
            obs_tensor = torch.from_numpy(obs).unsqueeze(0)
            action = policy(obs_tensor).detach().numpy().squeeze()
            target_dof_pos = action * action_scale + default_angles
            out.append((reading, obs.copy(), action.copy(), target_dof_pos.copy()))
    return out


def g1_settings():
    '''The policy node's settings from config/g1.yaml (its section, then the robot's).'''
    files = yaml.safe_load(G1_YAML.read_text())
    return {**files['/**/flashrt_policy']['ros__parameters'], **files['/**']['ros__parameters']}


def node_parts(settings, phase=None, numerics=None):
    '''(layout, joint targets) as the node builds them from these settings.'''
    observation = dict(settings['observation'])
    if phase is not None:
        observation['phase'] = phase
    terms = [{'name': n, **observation.get(n, {})} for n in settings['observation_terms']]
    numerics = numerics or settings['observation_numerics']
    joints = settings['joint_names']
    layout = ObservationLayout(terms, joints, settings['default_angles'], 12, numerics)
    targets = JointTargets(joints, settings['default_angles'], settings['action_scale'],
                           numerics=numerics)
    return layout, targets


def node_run(readings, settings, **numerics):
    '''What the node computes from these readings: assemble, engine step, joint targets.'''
    layout, targets = node_parts(settings, **numerics)
    joints = settings['joint_names']
    engine = PolicyEngine(make_policy('recurrent', 47, 12, file=str(ROBOT / 'motion.pt')),
                          device='cpu', cuda_graph=False, capsule_dir='/nonexistent/unused',
                          last_action=layout.device_feedback())
    out = []
    for k, (q, dq, (w, x, y, z), omega) in enumerate(readings):
        # as the node receives them: JointState by name, Imu orientation (x, y, z, w)
        obs = layout.assemble(k, (joints, q, dq), ((x, y, z, w), omega),
                              settings['initial_command'])
        action = engine.step(obs).numpy()
        # the policy's input: last_action filled from the arena inside the step
        out.append((engine.program.obs_buf[0].numpy().copy(), action, targets(action)))
    return out


@pytest.fixture(scope='module')
def vendor():
    return vendor_loop(CONTROL_STEPS, autograd=False)


def test_g1_commands_equal_unitree_deploy_loop_bit_for_bit(vendor):
    ours = node_run([r for r, _, _, _ in vendor], g1_settings())
    for k, ((_, obs, _, target), (obs_node, _, command)) in enumerate(zip(vendor, ours)):
        assert np.array_equal(obs_node, obs), \
            f'step {k}: observation differs at {np.flatnonzero(obs_node != obs).tolist()}'
        assert command.dtype == np.float64
        assert np.array_equal(command, target.astype(np.float64)), \
            f'step {k}: max |command diff| {np.abs(command - target).max()}'
    print(f'{len(vendor)} G1 control steps: observations and commands equal the vendor '
          "loop's bit for bit")


def test_g1_arithmetic_equals_the_faithful_vendor_loop():
    '''The loop exactly as written (autograd on): from its readings and its own actions, the
    node's observation (its action slot is the previous action, filled on the device) and
    joint targets equal the loop's bit for bit at every step.'''
    settings = g1_settings()
    layout, targets = node_parts(settings)
    faithful, previous = vendor_loop(CONTROL_STEPS, autograd=True), np.zeros(12, np.float32)
    for k, ((q, dq, (w, x, y, z), omega), obs, action, target) in enumerate(faithful):
        ours = layout.assemble(k, (settings['joint_names'], q, dq), ((x, y, z, w), omega),
                               settings['initial_command'])
        ours[33:45] = previous
        assert np.array_equal(ours, obs), f'step {k}'
        assert np.array_equal(targets(action), target.astype(np.float64)), f'step {k}'
        previous = action
    grad_free = vendor_loop(3, autograd=False)
    print('autograd on vs off, vendor actions equal per step: '
          f'{[np.array_equal(a[2], b[2]) for a, b in zip(faithful, grad_free)]}')


def test_float64_arithmetic_misses_the_vendor_loop(vendor):
    '''The arithmetic before observation_numerics (float64 default angles, phase from
    (step + 1) * 0.02, targets in float64): not the vendor loop's commands. Shows the test
    above can fail.'''
    readings = [r for r, _, _, _ in vendor]
    ours = node_run(readings, g1_settings(), phase={'period': 0.8, 'dt': 0.02},
                    numerics='float64')
    joint_pos = np.array([o[9:21] for o, _, _ in ours])
    vendor_pos = np.array([o[9:21] for _, o, _, _ in vendor])
    rounding = float((joint_pos != vendor_pos).mean())
    commands = np.array([c for _, _, c in ours])
    targets = np.array([t for _, _, _, t in vendor], dtype=np.float64)
    worst = float(np.abs(commands - targets).max())
    print(f'float64 arithmetic: {100 * rounding:.1f} % of joint_pos readings round '
          f'differently; commands off by up to {worst:.3g} rad')
    assert rounding > 0.05 and not np.array_equal(commands, targets)
