'''Policy bundles: what a training run writes beside its exported policy, read into this
package's parameters, so that nobody copies scales, joint orders and defaults by hand.

Two formats (load_bundle takes the run folder or the deploy file):
  isaaclab        Isaac Lab / unitree_rl_lab: <run>/params/deploy.yaml (observation terms with
                  scale, clip and history_length; JointPositionAction scale and offset;
                  default_joint_pos; joint_ids_map; stiffness/damping; step_dt) beside
                  <run>/exported/policy.onnx (or policy.pt)
  unitree_rl_gym  legged_gym / unitree_rl_gym deploy configs (deploy/deploy_mujoco/configs/
                  <robot>.yaml: scales, cmd_scale, cmd_init, default_angles, kps/kds,
                  simulation_dt, control_decimation) with the policy file its policy_path names,
                  and the MJCF its xml_path names, looked up beside it (the upstream paths hold
                  {LEGGED_GYM_ROOT_DIR})

Joint order. unitree_rl_gym's loop reads qpos[7:], the MJCF's joints in model order: the names
come from the MJCF beside the file, or from robot_joint_names. Isaac Lab's deploy.yaml names no
joints: the policy's joint i is the robot's joint joint_ids_map[i] (the SDK's motor order), so
robot_joint_names (the robot's joints in that order) gives the names; without it the joints are
called joint_<motor index> and the bundle says so.

A bundle this loader does not understand is refused with InvalidConfig naming the field.
Nothing here imports ROS.
'''
import math
import os
from typing import NamedTuple

import yaml

from .errors import InvalidConfig

# Isaac Lab observation term functions -> this package's term types
ISAACLAB_TERMS = {'base_ang_vel': 'base_ang_vel', 'projected_gravity': 'projected_gravity',
                  'velocity_commands': 'command', 'generated_commands': 'command',
                  'joint_pos_rel': 'joint_pos', 'joint_vel_rel': 'joint_vel',
                  'last_action': 'last_action', 'actions': 'last_action'}
# deploy_mujoco.py's observation, in order (G1, H1, H1-2 configs): 9 + 3 x joints + 2
RL_GYM_TERMS = ['base_ang_vel', 'projected_gravity', 'command', 'joint_pos', 'joint_vel',
                'last_action', 'phase']
RL_GYM_PERIOD = 0.8     # deploy_mujoco.py: period = 0.8 (the gait phase clock, seconds)
RL_GYM_FIELDS = ('num_obs', 'num_actions', 'default_angles', 'kps', 'kds', 'ang_vel_scale',
                 'dof_pos_scale', 'dof_vel_scale', 'action_scale', 'cmd_scale', 'cmd_init',
                 'simulation_dt', 'control_decimation', 'policy_path')


class Bundle(NamedTuple):
    format: str             # 'isaaclab' | 'unitree_rl_gym'
    deploy_file: str
    policy_file: str
    values: dict            # node parameter name -> value (observation.<term>.<setting> too)
    robot: dict             # for the world / controllers: joint_names, kps, kds,
    #                         default_angles (policy joint order); sim_dt and decimation
    #                         (unitree_rl_gym) or control_period (isaaclab)
    notes: list             # what the files did not say and was assumed


class _Loader(yaml.SafeLoader):
    '''deploy.yaml as Isaac Lab dumps it: its Python tags (a joint slice) carry nothing the
    deploy needs and are read as None.'''


_Loader.add_multi_constructor('tag:yaml.org,2002:python/', lambda loader, suffix, node: None)


def _refuse(source, field, why):
    raise InvalidConfig(f'policy bundle {source}: {field}: {why}')


def find_deploy_file(path):
    '''The deploy file of a run folder (params/deploy.yaml, or the one .yaml in it), or the
    file itself.'''
    path = os.path.expanduser(str(path))
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise InvalidConfig(f'policy bundle {path!r}: no such file or folder')
    for candidate in (os.path.join(path, 'params', 'deploy.yaml'),
                      os.path.join(path, 'deploy.yaml')):
        if os.path.isfile(candidate):
            return candidate
    yamls = sorted(f for f in os.listdir(path) if f.endswith(('.yaml', '.yml')))
    if len(yamls) == 1:
        return os.path.join(path, yamls[0])
    raise InvalidConfig(f'policy bundle {path!r}: no params/deploy.yaml (Isaac Lab) and not '
                        f'exactly one deploy .yaml (unitree_rl_gym) in it: {yamls}')


def load_bundle(path, robot_joint_names=()):
    '''The Bundle at `path` (a run folder or a deploy file); InvalidConfig names the field
    it cannot use.'''
    deploy = find_deploy_file(path)
    try:
        with open(deploy) as f:
            cfg = yaml.load(f, Loader=_Loader)
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidConfig(f'policy bundle {deploy}: unreadable: {exc}') from None
    if not isinstance(cfg, dict):
        _refuse(deploy, '(top level)', 'not a mapping of settings')
    robot_joint_names = [str(n) for n in robot_joint_names or ()]
    if 'observations' in cfg or 'joint_ids_map' in cfg:
        return _isaaclab(deploy, cfg, robot_joint_names)
    if 'num_obs' in cfg or 'policy_path' in cfg:
        return _unitree_rl_gym(deploy, cfg, robot_joint_names)
    _refuse(deploy, '(format)', 'neither an Isaac Lab deploy.yaml (observations, '
            'joint_ids_map) nor a unitree_rl_gym deploy config (num_obs, policy_path)')


# -- helpers ---------------------------------------------------------------------------------

def _numbers(source, cfg, field, n=None, where=''):
    '''where: the field's path above it (observations.<term>., ...), for the refusal.'''
    value = cfg.get(field) if isinstance(cfg, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not value or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in value):
        _refuse(source, where + field, f'expected finite numbers, got {value!r}')
    if n is not None and len(value) != n:
        _refuse(source, where + field, f'{len(value)} values, expected {n}')
    return [float(v) for v in value]


def _number(source, cfg, field, positive=True):
    value = cfg.get(field)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or \
            not math.isfinite(value) or (positive and value <= 0):
        _refuse(source, field, f'expected a {"positive " if positive else ""}number, got '
                f'{value!r}')
    return value


def _beside(deploy, upstream_path, field, what):
    '''The file an upstream path names, looked up beside the deploy file (by its name).'''
    if not isinstance(upstream_path, str) or not upstream_path:
        _refuse(deploy, field, f'expected the {what} path, got {upstream_path!r}')
    candidate = os.path.join(os.path.dirname(deploy), os.path.basename(upstream_path))
    return candidate if os.path.isfile(candidate) else None


def _scripted_kind(path):
    '''recurrent for a TorchScript export that keeps a hidden state (legged_gym's
    PolicyExporterLSTM buffers), else mlp.'''
    import torch
    try:
        module = torch.jit.load(path, map_location='cpu')
    except Exception as exc:  # noqa: B902 - torch raises several types for a bad file
        raise InvalidConfig(f'policy file {path}: not a TorchScript export: {exc}') from None
    buffers = {name.rsplit('.', 1)[-1] for name, _ in module.named_buffers()}
    return 'recurrent' if {'hidden_state', 'cell_state'} & buffers else 'mlp'


def _onnx_kind(path):
    '''recurrent for an ONNX export with state inputs besides the observation, else mlp.'''
    import onnx
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as exc:  # noqa: B902 - onnx raises several types for a bad file
        raise InvalidConfig(f'policy file {path}: not an ONNX model: {exc}') from None
    weights = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in weights]
    return 'recurrent' if len(inputs) > 1 else 'mlp'


def _policy_kind(path):
    return _onnx_kind(path) if path.endswith('.onnx') else _scripted_kind(path)


def _mjcf_joints(path):
    '''The actuated joints of an MJCF in model order (deploy_mujoco.py reads qpos[7:]).'''
    import mujoco
    try:
        model = mujoco.MjModel.from_xml_path(path)
    except ValueError as exc:       # MuJoCo's parse and compile errors
        raise InvalidConfig(f'policy bundle MJCF {path}: {exc}') from None
    joints = sorted({int(model.actuator_trnid[a, 0]) for a in range(model.nu)
                     if model.actuator_trntype[a] == int(mujoco.mjtTrn.mjTRN_JOINT)})
    return [mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_JOINT, j) for j in joints]


# -- unitree_rl_gym ---------------------------------------------------------------------------

def _unitree_rl_gym(deploy, cfg, robot_joint_names):
    missing = [f for f in RL_GYM_FIELDS if f not in cfg]
    if missing:
        _refuse(deploy, ', '.join(missing), 'missing (a unitree_rl_gym deploy config has '
                f'{", ".join(RL_GYM_FIELDS)})')
    n = cfg['num_actions']
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        _refuse(deploy, 'num_actions', f'expected a positive integer, got {n!r}')
    if not isinstance(cfg['num_obs'], int) or isinstance(cfg['num_obs'], bool) or \
            cfg['num_obs'] != 9 + 3 * n + 2:
        _refuse(deploy, 'num_obs', f'{cfg["num_obs"]}: deploy_mujoco.py\'s observation (ang '
                'vel, gravity, command, joint pos, joint vel, action, sin/cos phase) has '
                f'9 + 3 x {n} + 2 = {9 + 3 * n + 2} values; another layout is not this format')
    default = _numbers(deploy, cfg, 'default_angles', n)
    kps, kds = _numbers(deploy, cfg, 'kps', n), _numbers(deploy, cfg, 'kds', n)
    cmd_scale = _numbers(deploy, cfg, 'cmd_scale', 3)
    cmd_init = _numbers(deploy, cfg, 'cmd_init', 3)
    scales = {f: _number(deploy, cfg, f, positive=False) for f in
              ('ang_vel_scale', 'dof_pos_scale', 'dof_vel_scale', 'action_scale')}
    sim_dt = _number(deploy, cfg, 'simulation_dt')
    decimation = cfg['control_decimation']
    if not isinstance(decimation, int) or isinstance(decimation, bool) or decimation < 1:
        _refuse(deploy, 'control_decimation', f'expected a positive integer, got {decimation!r}')
    policy = _beside(deploy, cfg['policy_path'], 'policy_path', 'policy file')
    if policy is None:
        _refuse(deploy, 'policy_path', f'{cfg["policy_path"]!r}: no '
                f'{os.path.basename(cfg["policy_path"])} beside {deploy}')
    notes = []
    if robot_joint_names:
        if len(robot_joint_names) != n:
            _refuse(deploy, 'robot_joint_names', f'{len(robot_joint_names)} names for '
                    f'num_actions {n}')
        joints = robot_joint_names
    else:
        mjcf = _beside(deploy, cfg.get('xml_path'), 'xml_path', 'MJCF') \
            if cfg.get('xml_path') else None
        if mjcf is None:
            _refuse(deploy, 'xml_path', 'the joint order is the MJCF\'s (deploy_mujoco.py '
                    'reads qpos[7:]) and no MJCF of that name is beside the file: put it '
                    'there or set robot_joint_names')
        joints = _mjcf_joints(mjcf)
        if len(joints) != n:
            _refuse(deploy, 'xml_path', f'{mjcf} actuates {len(joints)} joints, num_actions '
                    f'is {n}')
        notes.append(f'joint order from {os.path.basename(mjcf)} (its actuated joints)')
    values = {
        'policy_type': _policy_kind(policy), 'policy_file': policy,
        'obs_dim': cfg['num_obs'], 'act_dim': n, 'observation_type': 'terms',
        'observation_numerics': 'unitree_rl_gym', 'joint_names': joints,
        'observation_terms': list(RL_GYM_TERMS),
        'observation.base_ang_vel.scale': [scales['ang_vel_scale']],
        'observation.command.scale': cmd_scale,
        'observation.joint_pos.scale': [scales['dof_pos_scale']],
        'observation.joint_vel.scale': [scales['dof_vel_scale']],
        'observation.phase.period': RL_GYM_PERIOD,
        'observation.phase.dt': float(sim_dt), 'observation.phase.decimation': decimation,
        'initial_command': cmd_init, 'action_scale': [scales['action_scale']],
        'default_angles': default, 'control_rate': 1.0 / (sim_dt * decimation)}
    notes.append(f'gait phase period {RL_GYM_PERIOD} s: deploy_mujoco.py\'s constant, not in '
                 'the file')
    robot = {'joint_names': joints, 'kps': kps, 'kds': kds, 'default_angles': default,
             'sim_dt': float(sim_dt), 'decimation': decimation}
    return Bundle('unitree_rl_gym', deploy, policy, values, robot, notes)


# -- Isaac Lab --------------------------------------------------------------------------------

def _isaaclab(deploy, cfg, robot_joint_names):
    run = os.path.dirname(os.path.dirname(deploy)) if \
        os.path.basename(os.path.dirname(deploy)) == 'params' else os.path.dirname(deploy)
    ids = cfg.get('joint_ids_map')
    if not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids) or \
            sorted(ids) != list(range(len(ids))):
        _refuse(deploy, 'joint_ids_map', f'expected a permutation of 0..n-1, got {ids!r}')
    n = len(ids)
    default = _numbers(deploy, cfg, 'default_joint_pos', n)
    stiffness = _numbers(deploy, cfg, 'stiffness', n)
    damping = _numbers(deploy, cfg, 'damping', n)
    step_dt = _number(deploy, cfg, 'step_dt')
    actions = cfg.get('actions')
    if not isinstance(actions, dict) or list(actions) != ['JointPositionAction']:
        _refuse(deploy, 'actions', f'{list(actions) if isinstance(actions, dict) else actions!r}:'
                ' this loader knows one JointPositionAction term')
    action, where = actions['JointPositionAction'] or {}, 'actions.JointPositionAction.'
    if not isinstance(action, dict):
        _refuse(deploy, where[:-1], f'expected its settings, got {action!r}')
    per_joint = isinstance(action.get('scale'), list)
    scale = _numbers(deploy, action, 'scale', n if per_joint else None, where)
    offset = action.get('offset')
    if offset is not None and _numbers(deploy, action, 'offset', n, where) != default:
        _refuse(deploy, 'actions.JointPositionAction.offset', 'differs from default_joint_pos: '
                'joint targets here are default_angles + action_scale x action')
    if action.get('clip') is not None:
        _refuse(deploy, 'actions.JointPositionAction.clip', f'{action["clip"]!r}: a clip of '
                'the raw action is not supported (joint target limits are '
                'joint_lower_limits/joint_upper_limits)')
    observations = cfg.get('observations')
    if not isinstance(observations, dict) or not observations:
        _refuse(deploy, 'observations', f'expected the policy group\'s terms, got '
                f'{observations!r}')
    sizes = {'base_ang_vel': 3, 'projected_gravity': 3, 'command': 3, 'joint_pos': n,
             'joint_vel': n, 'last_action': n}
    values = {'observation_terms': list(observations)}
    obs_dim = 0
    for name, term in observations.items():
        field = f'observations.{name}'
        kind = ISAACLAB_TERMS.get(name)
        if kind is None:
            _refuse(deploy, field, f'unknown term (known: {", ".join(ISAACLAB_TERMS)}); set '
                    f'observation.{name}.type and its settings, without the bundle')
        if not isinstance(term, dict):
            _refuse(deploy, field, f'expected its settings, got {term!r}')
        history = term.get('history_length', 1) or 1
        if not isinstance(history, int) or isinstance(history, bool) or history < 1:
            _refuse(deploy, f'{field}.history_length', f'expected a positive integer, got '
                    f'{history!r}')
        term_scale = _numbers(deploy, term, 'scale', where=field + '.') \
            if term.get('scale') is not None else [1.0]
        if len(term_scale) not in (1, sizes[kind]):
            _refuse(deploy, f'{field}.scale', f'{len(term_scale)} values for a term of '
                    f'{sizes[kind]}')
        values[f'observation.{name}.type'] = kind
        values[f'observation.{name}.scale'] = term_scale
        if term.get('clip') is not None:
            values[f'observation.{name}.clip'] = _numbers(deploy, term, 'clip', 2, field + '.')
        values[f'observation.{name}.history_length'] = history
        obs_dim += sizes[kind]      # one frame: the terms' histories widen the policy input
    notes = []
    if robot_joint_names:
        if len(robot_joint_names) != n:
            _refuse(deploy, 'robot_joint_names', f'{len(robot_joint_names)} names for the '
                    f'{n} joints of joint_ids_map')
        names = list(robot_joint_names)
    else:
        names = [f'joint_{i}' for i in range(n)]
        notes.append('deploy.yaml names no joints: joint_<motor index> stand for them; set '
                     'robot_joint_names (the robot\'s joints in motor order) to read and '
                     'command them by name')
    joints = [names[i] for i in ids]      # the policy's joint i is motor joint_ids_map[i]
    policy = next((p for p in (os.path.join(run, 'exported', 'policy.onnx'),
                               os.path.join(run, 'exported', 'policy.pt'))
                   if os.path.isfile(p)), None)
    if policy is None:
        _refuse(deploy, '(policy file)', f'no exported/policy.onnx or exported/policy.pt in '
                f'{run}')
    values.update({
        'policy_type': _policy_kind(policy), 'policy_file': policy, 'obs_dim': obs_dim,
        'act_dim': n, 'observation_type': 'terms', 'observation_numerics': 'isaaclab',
        'joint_names': joints, 'default_angles': default, 'action_scale': scale,
        'control_rate': 1.0 / step_dt})
    # stiffness and damping are written in motor order, as the SDK applies them
    robot = {'joint_names': joints, 'kps': [stiffness[i] for i in ids],
             'kds': [damping[i] for i in ids], 'default_angles': default,
             'control_period': float(step_dt)}
    notes.append('stiffness and damping taken in motor order (joint_ids_map), as '
                 'unitree_rl_lab writes and applies them')
    return Bundle('isaaclab', deploy, policy, values, robot, notes)
