"""What a configure reads: the node's typed settings, checked across parameters.

`load_settings(node)` turns the declared parameters (parameters.py) into one `Settings`: the
node's NodeConfig and the policy's config (typed, read by attribute), the device, the capsule
directory, the session names and, for joint_state and terms observations, the observation
layout and joint targets (for cameras observations, the cameras' setup). Every rule that spans
several parameters lives here, and each refusal names the parameter to change.
"""
from dataclasses import dataclass, field
import math
import os
import re
import time

from rclpy.exceptions import InvalidTopicNameException
from rclpy.validate_topic_name import validate_topic_name
import numpy as np
import torch

from flashrt_ros.node import parameters
from flashrt_ros.node.parameters import NodeConfig
from flashrt_ros.runtime.capsule_file import load_signing_key
from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.errors import InvalidConfig
from flashrt_ros.runtime.observation import JointTargets, ObservationLayout
from flashrt_ros.runtime.policies import build_policy, LEROBOT_KINDS


@dataclass
class Settings:
    """One configure's settings. `node` is updated in place when a live parameter changes."""

    node: NodeConfig
    policy: object                    # the policy kind's config (runtime/config.py)
    device: torch.device
    capsule_dir: str
    session_names: list = field(default_factory=list)   # [] for a single session
    layout: ObservationLayout = None  # joint_state and terms observations
    targets: JointTargets = None      # terms: actions -> joint commands
    cameras: 'CameraSetup' = None     # cameras observations

    @property
    def terms(self):
        return self.node.observation_type == 'terms'

    @property
    def readings(self):
        """The observation is assembled from the robot's readings (terms, cameras), ticked by
        control_mode, rather than given whole in one message."""
        return self.node.observation_type in ('terms', 'cameras')

    @property
    def lockstep(self):
        return self.readings and self.node.control_mode == 'lockstep'


@dataclass
class CameraSetup:
    """observation_type cameras: what the checkpoint's observation holds (checkpoint_inputs)
    and where each camera comes from."""

    topics: dict            # camera key -> topic, in the checkpoint's order
    compressed: set         # the keys whose topic is a CompressedImage
    cameras: dict           # camera key -> (3, H, W)
    tokens: int             # the instruction's token count (0: the policy takes none)
    tokenize: object        # checkpoint_inputs' tokenize(text, state=None), or None
    state_dim: int
    action_units: tuple = None  # (scale, offset) per action joint (joint_scale), or None


def build_engine(settings, clock=time.time):
    """The PolicyEngine a configure builds (tests build reference engines the same way);
    clock: seconds now, for the capsules' stamps (the node's ROS clock)."""
    cfg, layout = settings.node, settings.layout
    policy = build_policy(settings.policy, device='cpu',
                          term_history=layout.term_history() if layout else None)
    policy.set_kernels(cfg.kernels)
    if cfg.policy_type in LEROBOT_KINDS:
        _chunk_period(cfg, policy, settings.cameras)
    return PolicyEngine(policy, device=settings.device, cuda_graph=cfg.cuda_graph,
                        sessions=cfg.sessions, session_names=settings.session_names or None,
                        batch_sessions=cfg.batch_sessions, rollback_depth=cfg.rollback_depth,
                        device_budget=cfg.device_budget_mb << 20,
                        host_budget=cfg.host_budget_mb << 20, capsule_dir=settings.capsule_dir,
                        last_action=layout.device_feedback() if layout else None,
                        signing_key=load_signing_key(cfg.signing_key_file)
                        if cfg.signing_key_file else None, clock=clock)


# parameters that only the terms mode reads; set with another observation_type they are
# refused, not ignored (a robot would run without the limits or the supervisor they ask for)
TERMS_ONLY = ('observation_terms', 'default_angles', 'action_scale', 'joint_lower_limits',
              'joint_upper_limits', 'initial_command', 'safety')


def _need(ok, name, value, what):
    if not ok:
        raise InvalidConfig(f'parameter {name!r} = {value!r}: {what}')


def _device(name):
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else 'cpu'
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    _need(device is not None and device.type in ('cpu', 'cuda'), 'device', name,
          "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
    _need(device.type != 'cuda' or torch.cuda.is_available(), 'device', name,
          'CUDA is not available on this machine')
    return device


def _joint_state_layout(cfg, policy):
    joints = cfg.joint_names
    _need(len(joints) > 0 and policy.obs_dim in (len(joints), 2 * len(joints)), 'joint_names',
          joints, 'joint_state observations need obs_dim == len(joint_names) (positions) or '
          '2 * len(joint_names) (positions then velocities)')
    _need(len(cfg.action_joint_names) in (0, policy.act_dim), 'action_joint_names',
          cfg.action_joint_names, 'must be empty or hold act_dim names')
    # the same by-name reading as the terms' joint_pos / joint_vel, unscaled
    terms = [{'name': 'joint_pos', 'offset': [0.0]}] + (
        [{'name': 'joint_vel'}] if policy.obs_dim == 2 * len(joints) else [])
    return ObservationLayout(terms, joints, [], policy.act_dim)


def _terms_layout(node, cfg, policy):
    joints = cfg.joint_names
    _need(len(joints) == policy.act_dim, 'joint_names', joints,
          f'terms: one joint per action (act_dim {policy.act_dim})')
    _need(len(cfg.default_angles) == len(joints), 'default_angles', cfg.default_angles,
          'terms: one default angle per joint in joint_names')
    _need(len(cfg.action_scale) in (1, len(joints)), 'action_scale', cfg.action_scale,
          'terms: one value, or one per joint')
    _need(len(cfg.initial_command) in (0, 3), 'initial_command', cfg.initial_command,
          'empty or (vx, vy, yaw rate)')
    _need(len(cfg.observation_terms) > 0, 'observation_terms', cfg.observation_terms,
          "observation_type 'terms' needs the ordered term names")
    layout = ObservationLayout(parameters.term_specs(node, cfg.observation_terms), joints,
                               cfg.default_angles, policy.act_dim, cfg.observation_numerics)
    _need(layout.obs_dim == policy.obs_dim, 'obs_dim', policy.obs_dim,
          f'the observation terms add up to {layout.obs_dim} values')
    _need(cfg.control_mode == 'timer' or 'joint_state' in layout.needs, 'control_mode',
          cfg.control_mode, 'lockstep steps on each new joint state; these terms read none: '
          "use 'timer'")
    targets = JointTargets(joints, cfg.default_angles, cfg.action_scale,
                           cfg.joint_lower_limits, cfg.joint_upper_limits,
                           cfg.observation_numerics)
    return layout, targets


def _camera_setup(cfg, policy):
    _need(cfg.policy_type in LEROBOT_KINDS, 'observation_type', 'cameras',
          f'a LeRobot checkpoint\'s observation (policy_type {" / ".join(LEROBOT_KINDS)})')
    _need(bool(policy.policy_file), 'policy_file', policy.policy_file,
          'cameras: the checkpoint folder (its cameras, state and tokenizer)')
    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_inputs, \
        observation_size
    cameras, tokens, tokenize = checkpoint_inputs(policy.policy_file)
    topics = dict(entry.split('=', 1) for entry in cfg.camera_topics if '=' in entry)
    _need(len(topics) == len(cfg.camera_topics) and set(topics) == set(cameras) and
          all(topics.values()), 'camera_topics', cfg.camera_topics,
          f"one 'feature key=topic' for each camera of the checkpoint: {list(cameras)}")
    for topic in topics.values():
        try:
            validate_topic_name(topic)
        except InvalidTopicNameException as exc:
            _need(False, 'camera_topics', cfg.camera_topics,
                  f'{topic!r} is not a ROS topic name ({str(exc).splitlines()[0]})')
    # a fleet's robots each have their cameras, under the session's name as its joint states
    _need(cfg.sessions == 1 or not any(t.startswith(('/', '~')) for t in topics.values()),
          'camera_topics', cfg.camera_topics, 'sessions > 1: relative topics, each robot\'s '
          'under its session name (<name>/<topic>)')
    _need(set(cfg.compressed_cameras) <= set(cameras), 'compressed_cameras',
          cfg.compressed_cameras, f'names cameras the checkpoint lacks: {list(cameras)}')
    _need(not cfg.instruction or tokens, 'instruction', cfg.instruction,
          f'this {cfg.policy_type} checkpoint takes no instruction')
    _need(cfg.camera_sync == 'newest' or cfg.control_mode == 'lockstep', 'camera_sync',
          cfg.camera_sync, 'stamp pairs frames with lock-step joint states; a timer step takes '
          'the newest frames (max_input_age)')
    state_dim = policy.obs_dim - observation_size(0, cameras, tokens)
    _need(len(cfg.joint_names) == state_dim, 'joint_names', cfg.joint_names,
          f'cameras: the {state_dim} joints of the state, in its order (obs_dim {policy.obs_dim}'
          ' less the images and tokens)')
    return CameraSetup({k: topics[k] for k in cameras}, set(cfg.compressed_cameras), cameras,
                       tokens, tokenize, state_dim, _action_units(cfg))


def _action_units(cfg):
    """joint_scale / joint_offset checked: (scale, offset) float64 arrays in
    action_joint_names order, to turn the checkpoint's actions into ROS units; None without
    them (the checkpoint's units are ROS's)."""
    joints = cfg.joint_names
    for name in ('joint_scale', 'joint_offset'):
        values = getattr(cfg, name)
        _need(len(values) in (0, len(joints)) and all(map(math.isfinite, values)), name,
              values, f'empty, or one finite value per joint of joint_names ({len(joints)})')
    _need(0.0 not in cfg.joint_scale, 'joint_scale', cfg.joint_scale,
          'a joint scaled by 0 reads nothing, and its actions could not go back')
    if not (cfg.joint_scale or cfg.joint_offset):
        return None
    actions = cfg.action_joint_names
    _need(actions and set(actions) <= set(joints), 'action_joint_names', actions,
          'joint_scale / joint_offset: the actions go back to ROS units by name: name each '
          'action joint, each one of joint_names')
    at = [joints.index(name) for name in actions]
    scale = np.asarray(cfg.joint_scale or [1.0] * len(joints), np.float64)
    offset = np.asarray(cfg.joint_offset or [0.0] * len(joints), np.float64)
    return scale[at], offset[at]


def _chunk_output(cfg, policy):
    """~/action_chunk (action_joint_names): a JointTrajectory whose points are chunk_period
    apart, the policy's control period; only timer mode knows one of its own."""
    joints = cfg.action_joint_names
    _need(len(joints) in (0, policy.act_dim), 'action_joint_names', joints,
          'must be empty or hold act_dim names')


def _chunk_period(cfg, policy, cameras):
    """With the policy loaded (build_engine): ~/action_chunk's timing, or, for ACT's temporal
    ensembling (no chunk holds the actions sent: no ~/action_chunk), what the names still do:
    on cameras, the commands and their units; else nothing, so they are refused."""
    joints = cfg.action_joint_names
    if not getattr(policy, 'gives_chunks', True):
        why = ('this ACT checkpoint ensembles (temporal_ensemble_coeff): one action a step, '
               'no chunk for ~/action_chunk')
        _need(not joints or cameras, 'action_joint_names', joints,
              why + ', and without cameras nothing else takes the names')
        _need(not cfg.chunk_period, 'chunk_period', cfg.chunk_period, why)
        return
    _need(not joints or cfg.chunk_period > 0 or cfg.control_mode == 'timer' and
          cfg.observation_type in ('terms', 'cameras'), 'chunk_period', cfg.chunk_period,
          "the seconds between ~/action_chunk's points, the policy's control period: 0 "
          'means 1 / control_rate, which only steps in timer mode (terms, cameras)')


def _session_names(cfg):
    if cfg.sessions == 1:
        _need(not cfg.session_names, 'session_names', cfg.session_names,
              'names sessions; set sessions')
        return []
    # count and distinctness: the engine checks them (build_engine)
    names = cfg.session_names or [f's{i}' for i in range(cfg.sessions)]
    bad = [n for n in names if not re.fullmatch(r'[A-Za-z][A-Za-z0-9_]*', n)]
    _need(not bad, 'session_names', names, f'{bad} are not ROS name tokens (a letter, then '
          "letters, digits, _): they name each session's topic namespace")
    return names


def load_settings(node):
    """The node's Settings from its parameters; InvalidConfig names the offending one."""
    cfg, policy = parameters.read(node)
    if policy.policy_file:
        folder = cfg.policy_type in LEROBOT_KINDS     # a LeRobot checkpoint folder
        _need((os.path.isdir if folder else os.path.isfile)(policy.policy_file), 'policy_file',
              policy.policy_file, 'no such folder' if folder else 'no such file')
    if cfg.policy_type in LEROBOT_KINDS:      # they name ~/action_chunk's joints
        _chunk_output(cfg, policy)
    _need(not cfg.chunk_period or cfg.policy_type in LEROBOT_KINDS and cfg.action_joint_names,
          'chunk_period', cfg.chunk_period, "spaces ~/action_chunk's points, which only a "
          'LeRobot chunk policy with action_joint_names publishes (no chunk would go out)')
    for name in ('joint_names', 'action_joint_names'):  # (a controller would drop one)
        names = getattr(cfg, name)
        _need(len(set(names)) == len(names), name, names, 'names a joint twice')
    layout = targets = cameras = None
    if cfg.observation_type == 'joint_state':
        layout = _joint_state_layout(cfg, policy)
    elif cfg.observation_type == 'terms':
        layout, targets = _terms_layout(node, cfg, policy)
    elif cfg.observation_type == 'cameras':
        cameras = _camera_setup(cfg, policy)
    for name in ('joint_scale', 'joint_offset', 'instruction'):  # ignored, they would
        _need(cameras or not getattr(cfg, name), name, getattr(cfg, name),   # change nothing
              'observation_type cameras only: with another the node does not assemble the '
              'observation (float32_array: the token ids come in it)')
    for name in TERMS_ONLY:     # the joint targets and the supervisor are the terms mode's
        _need(cfg.observation_type == 'terms' or not getattr(cfg, name), name,
              getattr(cfg, name), 'observation_type terms only: with another the node builds '
              'no joint targets and no safety supervisor, and the actions would go out '
              'unclipped and unsupervised')
    # one directory per node: two robots on one machine never share capsules; under ROS_HOME
    # (default ~/.ros) as ROS keeps its logs
    capsule_dir = cfg.capsule_dir or os.path.join(
        os.environ.get('ROS_HOME') or os.path.join('~', '.ros'), 'flashrt_capsules',
        node.get_fully_qualified_name().lstrip('/'))
    return Settings(cfg, policy, _device(cfg.device), os.path.expanduser(capsule_dir),
                    _session_names(cfg), layout, targets, cameras)
