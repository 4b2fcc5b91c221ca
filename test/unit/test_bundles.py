'''Policy bundles (flashrt_ros/runtime/bundles.py), no ROS.

The real bundles in ../shared/robots load into the values their files say, read here with
yaml, independently of the loader: the unitree_rl_gym G1 deploy config (deploy_mujoco_g1.yaml
beside motion.pt and scene.xml; its values also equal the hand-written config/g1.yaml) and the
unitree_rl_lab G1 velocity run (params/deploy.yaml, exported/policy.onnx). A copy of either,
changed in one field, is refused with InvalidConfig naming that field (the loader writes
'policy bundle <file>: <field>: <why>', so the tests match ': <field>: ').
'''
import copy
import pathlib
import re
import shutil
import xml.etree.ElementTree as ElementTree

import pytest
import yaml

from flashrt_ros.runtime.bundles import load_bundle
from flashrt_ros.runtime.errors import InvalidConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROBOTS = ROOT.parent / 'shared' / 'robots'
G1 = ROBOTS / 'unitree_g1'
G1_DEPLOY = G1 / 'deploy_mujoco_g1.yaml'
G1_FILES = ('motion.pt', 'scene.xml', 'g1_12dof.xml')
LAB = ROBOTS / 'unitree_rl_lab_g1_velocity'
LAB_DEPLOY = LAB / 'params' / 'deploy.yaml'
LAB_ONNX = LAB / 'exported' / 'policy.onnx'
G1_CONFIG = ROOT / 'config' / 'g1.yaml'

needs_g1 = pytest.mark.skipif(
    not all((G1 / f).exists() for f in ('deploy_mujoco_g1.yaml', *G1_FILES, 'meshes')),
    reason=f'needs the unitree_rl_gym G1 bundle in {G1} (../shared, absent in a fresh clone)')
needs_lab = pytest.mark.skipif(
    not (LAB_DEPLOY.exists() and LAB_ONNX.exists()),
    reason=f'needs the unitree_rl_lab G1 bundle in {LAB} (../shared, absent in a fresh clone)')

# deploy.yaml term -> this package's term type
TYPES = {'base_ang_vel': 'base_ang_vel', 'projected_gravity': 'projected_gravity',
         'velocity_commands': 'command', 'joint_pos_rel': 'joint_pos',
         'joint_vel_rel': 'joint_vel', 'last_action': 'last_action'}


class _Loader(yaml.SafeLoader):
    '''deploy.yaml as Isaac Lab dumps it; the one Python tag (a joint slice) is not needed.'''


_Loader.add_multi_constructor('tag:yaml.org,2002:python/', lambda loader, suffix, node: None)


def lab_deploy():
    return yaml.load(LAB_DEPLOY.read_text(), Loader=_Loader)


def g1_deploy():
    return yaml.safe_load(G1_DEPLOY.read_text())


def field(name):
    '''The pytest.raises match for a refusal naming `name` as its field.'''
    return re.escape(f': {name}: ')


def flatten(params, prefix=''):
    '''A ros__parameters mapping as node parameter names: nested keys joined by dots.'''
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out.update(flatten(value, f'{prefix}{key}.'))
        else:
            out[f'{prefix}{key}'] = value
    return out


def mjcf_actuated_joints(path):
    '''The MJCF's actuated joints in model (document) order, read with ElementTree, its
    <include>s expanded: what deploy_mujoco.py's qpos[7:] holds.'''
    def elements(p):
        for element in ElementTree.parse(p).getroot().iter():
            if element.tag == 'include':
                yield from elements(p.parent / element.get('file'))
            else:
                yield element
    everything = list(elements(path))
    actuated = {e.get('joint') for e in everything
                if e.tag in ('motor', 'position', 'velocity', 'general') and e.get('joint')}
    return [e.get('name') for e in everything if e.tag == 'joint' and e.get('name') in actuated]


def g1_copy(tmp_path, change=None, drop=()):
    '''A copy of the G1 folder (the deploy file rewritten after `change`, motion.pt and the
    MJCF copied, less `drop`; the 20 MB of meshes linked, not copied).'''
    folder = tmp_path / 'g1'
    folder.mkdir()
    for name in G1_FILES:
        if name not in drop:
            shutil.copy(G1 / name, folder / name)
    (folder / 'meshes').symlink_to(G1 / 'meshes', target_is_directory=True)
    cfg = g1_deploy()
    if change:
        change(cfg)
    (folder / G1_DEPLOY.name).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return folder


def lab_copy(tmp_path, change=None, policy=True):
    '''A copy of the Isaac Lab run folder: params/deploy.yaml as plain yaml (without the
    tagged joint_ids) after `change`, and exported/policy.onnx unless not `policy`.'''
    run = tmp_path / 'run'
    (run / 'params').mkdir(parents=True)
    (run / 'exported').mkdir()
    if policy:
        shutil.copy(LAB_ONNX, run / 'exported' / 'policy.onnx')
    cfg = lab_deploy()
    del cfg['actions']['JointPositionAction']['joint_ids']
    if change:
        change(cfg)
    # sort_keys=False: the observation terms' order is the policy input's
    (run / 'params' / 'deploy.yaml').write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run


@pytest.fixture(scope='module')
def g1_bundle():
    return load_bundle(G1)


# -- unitree_rl_gym: the real G1 deploy config ------------------------------------------------

@needs_g1
def test_rl_gym_folder_and_file_give_the_deploy_files_values(g1_bundle):
    '''The G1 folder and its deploy file both load, and every derived value is the one the
    deploy file says: sizes, scales, command, defaults, action scale, phase clock, control
    rate, PD gains, the policy file beside it (a recurrent TorchScript LSTM).'''
    cfg = g1_deploy()
    by_file = load_bundle(G1_DEPLOY)
    dt, decimation = cfg['simulation_dt'], cfg['control_decimation']
    for bundle in (g1_bundle, by_file):
        values, robot = bundle.values, bundle.robot
        assert bundle.format == 'unitree_rl_gym'
        assert pathlib.Path(bundle.deploy_file) == G1_DEPLOY
        assert pathlib.Path(bundle.policy_file) == pathlib.Path(values['policy_file']) == \
            G1 / 'motion.pt'
        assert values['policy_type'] == 'recurrent'
        assert values['observation_numerics'] == 'unitree_rl_gym'
        assert values['obs_dim'] == cfg['num_obs'] == 47
        assert values['act_dim'] == cfg['num_actions'] == 12
        assert values['observation.base_ang_vel.scale'] == [cfg['ang_vel_scale']]
        assert values['observation.joint_pos.scale'] == [cfg['dof_pos_scale']]
        assert values['observation.joint_vel.scale'] == [cfg['dof_vel_scale']]
        assert values['observation.command.scale'] == cfg['cmd_scale']
        assert values['initial_command'] == cfg['cmd_init']
        assert values['action_scale'] == [cfg['action_scale']]
        assert values['default_angles'] == robot['default_angles'] == cfg['default_angles']
        assert values['observation.phase.dt'] == dt
        assert values['observation.phase.decimation'] == decimation
        assert values['control_rate'] == pytest.approx(1.0 / (dt * decimation))
        assert robot['kps'] == cfg['kps'] and robot['kds'] == cfg['kds']
        assert robot['sim_dt'] == dt and robot['decimation'] == decimation
        assert robot['joint_names'] == values['joint_names']
    assert by_file.values == g1_bundle.values and by_file.robot == g1_bundle.robot


@needs_g1
def test_rl_gym_values_equal_the_hand_written_g1_config(g1_bundle):
    '''Wherever config/g1.yaml (written by hand from the same deploy config) sets a key the
    bundle derives, they agree: the policy section's parameters (observation.<term>.<setting>
    nested there) and the robot section's defaults, gains and timing; the joint names are
    the MJCF's actuated joints.'''
    config = yaml.safe_load(G1_CONFIG.read_text())
    policy = flatten(config['/**/flashrt_policy']['ros__parameters'])
    robot = config['/**']['ros__parameters']
    # policy_file is '' there: the launch file sets it
    shared = (set(policy) & set(g1_bundle.values)) - {'policy_file'}
    assert {'joint_names', 'observation_terms', 'obs_dim', 'act_dim', 'observation_type',
            'observation.base_ang_vel.scale', 'observation.command.scale',
            'observation.joint_vel.scale', 'observation.phase.period', 'observation.phase.dt',
            'observation.phase.decimation', 'initial_command', 'action_scale',
            'observation_numerics', 'policy_type'} <= shared
    for key in sorted(shared):
        assert g1_bundle.values[key] == policy[key], key
    for key in ('default_angles', 'kps', 'kds', 'sim_dt', 'decimation'):
        assert g1_bundle.robot[key] == robot[key], key
    assert g1_bundle.values['default_angles'] == robot['default_angles']
    assert g1_bundle.values['joint_names'] == mjcf_actuated_joints(G1 / 'scene.xml') == \
        policy['joint_names']
    assert any('scene.xml' in note for note in g1_bundle.notes)


@needs_g1
def test_rl_gym_copy_loads_as_the_original(tmp_path, g1_bundle):
    '''The unchanged copy the refusal tests start from loads to the original's values (so
    each refusal below is its one change's doing).'''
    bundle = load_bundle(g1_copy(tmp_path))
    expected = dict(g1_bundle.values, policy_file=str(tmp_path / 'g1' / 'motion.pt'))
    assert bundle.values == expected and bundle.robot == g1_bundle.robot


@needs_g1
def test_rl_gym_robot_joint_names_replace_the_mjcf(tmp_path, g1_bundle):
    '''With robot_joint_names the bundle needs no MJCF beside the file and takes those
    names, in that order; everything else is as before.'''
    names = [f'made_up_{i}' for i in range(12)]
    bundle = load_bundle(g1_copy(tmp_path, drop=('scene.xml', 'g1_12dof.xml')), names)
    assert bundle.values['joint_names'] == bundle.robot['joint_names'] == names
    assert not any('scene.xml' in note for note in bundle.notes)
    ignore = {'joint_names', 'policy_file'}
    assert {k: v for k, v in bundle.values.items() if k not in ignore} == \
        {k: v for k, v in g1_bundle.values.items() if k not in ignore}


def _set(key, value):
    return lambda cfg: cfg.update({key: value})


@needs_g1
@pytest.mark.parametrize('change, drop, names, refused', [
    pytest.param(lambda cfg: cfg.pop('cmd_scale'), (), (), 'cmd_scale', id='no-cmd_scale'),
    pytest.param(_set('num_obs', 48), (), (), 'num_obs', id='num_obs-not-9+3n+2'),
    pytest.param(lambda cfg: cfg['kps'].pop(), (), (), 'kps', id='kps-of-11'),
    pytest.param(None, ('motion.pt',), (), 'policy_path', id='no-policy-file'),
    pytest.param(None, ('scene.xml',), (), 'xml_path', id='no-mjcf-no-names'),
    pytest.param(None, (), [f'j{i}' for i in range(11)], 'robot_joint_names',
                 id='11-robot_joint_names'),
    pytest.param(_set('control_decimation', 0), (), (), 'control_decimation',
                 id='control_decimation-0'),
])
def test_rl_gym_refusals_name_the_field(tmp_path, change, drop, names, refused):
    '''A G1 deploy folder changed in one way is refused with InvalidConfig naming the
    field: a missing field, an observation size of another layout, gains of the wrong
    length, no policy file, no MJCF and no names, names of the wrong length, decimation 0.'''
    folder = g1_copy(tmp_path, change, drop)
    with pytest.raises(InvalidConfig, match=field(refused)):
        load_bundle(folder, names)


# -- Isaac Lab: the real unitree_rl_lab G1 velocity run ---------------------------------------

@needs_lab
def test_isaaclab_values_are_the_deploy_files():
    '''The run folder and its deploy.yaml load to the same bundle, whose values are the
    file's: one frame of the six terms (96), 29 actions, each term's type, scale and history
    in file order, defaults, action scale, control rate, an ONNX MLP; the joints named by
    motor index (and a note says so); PD gains taken in motor order through joint_ids_map.'''
    cfg = lab_deploy()
    ids = cfg['joint_ids_map']
    bundle = load_bundle(LAB)
    assert load_bundle(LAB_DEPLOY) == bundle
    values, robot = bundle.values, bundle.robot
    assert bundle.format == 'isaaclab'
    assert pathlib.Path(bundle.deploy_file) == LAB_DEPLOY
    assert pathlib.Path(bundle.policy_file) == pathlib.Path(values['policy_file']) == LAB_ONNX
    assert values['policy_type'] == 'mlp' and values['observation_numerics'] == 'isaaclab'
    assert values['obs_dim'] == 3 + 3 + 3 + 29 + 29 + 29 == \
        sum(len(term['scale']) for term in cfg['observations'].values())
    assert values['act_dim'] == len(ids) == 29
    assert values['observation_terms'] == list(cfg['observations']) == list(TYPES)
    for name, term in cfg['observations'].items():
        assert values[f'observation.{name}.type'] == TYPES[name]
        assert values[f'observation.{name}.scale'] == term['scale']
        assert values[f'observation.{name}.history_length'] == term['history_length'] == 5
        assert f'observation.{name}.clip' not in values      # clip: null in the file
    assert values['default_angles'] == robot['default_angles'] == cfg['default_joint_pos']
    assert values['action_scale'] == cfg['actions']['JointPositionAction']['scale']
    assert values['control_rate'] == pytest.approx(1.0 / cfg['step_dt'])
    assert values['joint_names'] == robot['joint_names'] == [f'joint_{i}' for i in ids]
    assert any('joint_<motor index>' in note for note in bundle.notes)
    assert robot['kps'] == [cfg['stiffness'][ids[i]] for i in range(29)]
    assert robot['kds'] == [cfg['damping'][ids[i]] for i in range(29)]
    # the policy's joint 2 is the waist yaw (motor 12): its gain is the waist's, not a leg's
    assert ids[2] == 12 and robot['kps'][2] == cfg['stiffness'][12] != cfg['stiffness'][2]


@needs_lab
def test_isaaclab_robot_joint_names_in_motor_order():
    '''With the robot's joint names in motor order, the policy's joint i is named
    names[joint_ids_map[i]], no joint_<motor index> note is left, and nothing else
    changes.'''
    ids = lab_deploy()['joint_ids_map']
    names = [f'motor_{k}_joint' for k in range(29)]
    bundle = load_bundle(LAB, names)
    plain = load_bundle(LAB)
    assert bundle.values['joint_names'] == bundle.robot['joint_names'] == \
        [names[ids[i]] for i in range(29)]
    first = ['motor_0_joint', 'motor_6_joint', 'motor_12_joint']
    assert bundle.values['joint_names'][:3] == first
    assert not any('joint_<motor index>' in note for note in bundle.notes)
    assert dict(bundle.values, joint_names=None) == dict(plain.values, joint_names=None)
    assert dict(bundle.robot, joint_names=None) == dict(plain.robot, joint_names=None)


@needs_lab
def test_isaaclab_plain_yaml_copy_loads_as_the_original(tmp_path):
    '''The copy the refusal tests start from (plain yaml, no Python tag) loads to the
    original's values, so each refusal below is its one change's doing.'''
    run = lab_copy(tmp_path)
    bundle, real = load_bundle(run), load_bundle(LAB)
    expected = dict(real.values, policy_file=str(run / 'exported' / 'policy.onnx'))
    assert bundle.values == expected and bundle.robot == real.robot


@needs_lab
def test_isaaclab_history_length_0_is_one_frame(tmp_path):
    '''history_length 0 is Isaac Lab's ObservationTermCfg default, "no history": the term
    is read as one frame (1), the others keep theirs.'''
    run = lab_copy(tmp_path, lambda cfg: cfg['observations']['base_ang_vel'].update(
        history_length=0))
    values = load_bundle(run).values
    assert values['observation.base_ang_vel.history_length'] == 1
    assert values['observation.projected_gravity.history_length'] == 5


def _actions(cfg):
    return cfg['actions']['JointPositionAction']


def _swap_ids(cfg):
    cfg['joint_ids_map'][1] = cfg['joint_ids_map'][0]       # a motor twice, one never


def _unknown_term(cfg):
    cfg['observations']['height_scan'] = {'params': {}, 'clip': None, 'scale': [1.0],
                                          'history_length': 1}


def _moved_offset(cfg):
    _actions(cfg)['offset'][0] += 0.1


def _second_action(cfg):
    cfg['actions']['JointVelocityAction'] = copy.deepcopy(_actions(cfg))


@needs_lab
@pytest.mark.parametrize('change, policy, names, refused', [
    pytest.param(_swap_ids, True, (), 'joint_ids_map', id='ids-not-a-permutation'),
    pytest.param(_unknown_term, True, (), 'observations.height_scan', id='unknown-term'),
    pytest.param(_moved_offset, True, (), 'actions.JointPositionAction.offset',
                 id='offset-not-default'),
    pytest.param(lambda cfg: _actions(cfg).update(clip=[[-10.0, 10.0]] * 29), True, (),
                 'actions.JointPositionAction.clip', id='action-clip'),
    pytest.param(_second_action, True, (), 'actions', id='second-action-term'),
    pytest.param(lambda cfg: cfg['observations']['base_ang_vel'].update(history_length=-1),
                 True, (), 'observations.base_ang_vel.history_length', id='history-minus-1'),
    pytest.param(None, False, (), '(policy file)', id='no-exported-policy'),
    pytest.param(None, True, [f'j{i}' for i in range(28)], 'robot_joint_names',
                 id='28-robot_joint_names'),
    pytest.param(lambda cfg: cfg['observations']['joint_vel_rel'].update(scale=[0.05] * 3),
                 True, (), 'observations.joint_vel_rel.scale', id='term-scale-of-3'),
    pytest.param(lambda cfg: cfg['observations']['base_ang_vel'].update(scale='x'),
                 True, (), 'observations.base_ang_vel.scale', id='term-scale-not-numbers'),
    pytest.param(lambda cfg: cfg['observations']['base_ang_vel'].update(clip=[1, 2, 3]),
                 True, (), 'observations.base_ang_vel.clip', id='term-clip-of-3'),
    pytest.param(lambda cfg: cfg['actions'].update(JointPositionAction=[1, 2]),
                 True, (), 'actions.JointPositionAction', id='action-term-not-a-mapping'),
    pytest.param(lambda cfg: _actions(cfg).pop('scale'), True, (),
                 'actions.JointPositionAction.scale', id='action-scale-missing'),
])
def test_isaaclab_refusals_name_the_field(tmp_path, change, policy, names, refused):
    '''An Isaac Lab run changed in one way is refused with InvalidConfig naming the field:
    joint_ids_map not a permutation, a term this package has no type for, an action offset
    other than the defaults, an action clip, a second action term, a negative history, no
    exported policy, names of the wrong length, a term scale of the wrong length.'''
    run = lab_copy(tmp_path, change, policy)
    with pytest.raises(InvalidConfig, match=field(refused)):
        load_bundle(run, names)


# -- neither format, no deploy file -----------------------------------------------------------

def test_neither_format_is_refused(tmp_path):
    '''A yaml of unrelated settings is neither format: refused naming (format).'''
    path = tmp_path / 'controller.yaml'
    path.write_text(yaml.safe_dump({'controller': {'rate': 50}, 'topics': ['a', 'b']}))
    with pytest.raises(InvalidConfig, match=field('(format)')):
        load_bundle(path)
    with pytest.raises(InvalidConfig, match=field('(format)')):
        load_bundle(tmp_path)           # the folder's one yaml is the same file


def test_folder_of_two_yamls_is_refused(tmp_path):
    '''A folder with no params/deploy.yaml and two yaml files names no deploy file: the
    refusal says so and lists them.'''
    for name in ('a.yaml', 'b.yaml'):
        (tmp_path / name).write_text(yaml.safe_dump({'num_obs': 47}))
    with pytest.raises(InvalidConfig, match=re.escape('no params/deploy.yaml')) as refused:
        load_bundle(tmp_path)
    assert "['a.yaml', 'b.yaml']" in str(refused.value)


def test_missing_path_is_refused(tmp_path):
    '''A path that does not exist is refused as such, naming it.'''
    missing = tmp_path / 'no_such_run'
    with pytest.raises(InvalidConfig, match='no such file or folder') as refused:
        load_bundle(missing)
    assert str(missing) in str(refused.value)
