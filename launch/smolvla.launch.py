"""A LeRobot SmolVLA (or Pi0, Pi0.5, ACT, Diffusion Policy) checkpoint on the robot: the
flashrt_policy node (policy_type smolvla, pi0, pi05, act or diffusion, from the checkpoint),
subscribed to the cameras, the joint states and the instruction (of the language policies),
which it assembles into the policy's observation on its device (observation_type cameras).

ros2 launch flashrt_ros smolvla.launch.py checkpoint:=/path/to/checkpoint
    camera_topics:=observation.images.top=/camera/top/image_raw[,<key>=<topic>...]
    joint_names:=shoulder,elbow,wrist,gripper,base,lift [instruction:='pick up the cube']
    [compressed_cameras:=observation.images.wrist] [joint_states:=/joint_states]
    [control_mode:=timer control_rate:=30.0] [camera_sync:=newest|stamp (lockstep)]
    [action_joint_names:=<the arm's joints>]
    [joint_scale:=57.29578,... joint_offset:=0.0,...]  (the checkpoint's units per ROS unit
                                 and its 0, per joint of joint_names: a LeRobot arm's degrees)
    [chunk_period:=0.0] [device:=auto] [action_topic:=/robot/cmd]
    [action_chunk_topic:=/joint_trajectory_controller/joint_trajectory]
    [joint_commands_topic:=/forward_position_controller/commands]
    [vision_dtype:=bfloat16]     (pi0, pi05: the vision tower in bfloat16, README)
    [denoise_kernels:=compiled|fused]  (smolvla, pi0, pi05: fused denoising kernels; fused:
                                        the expert's step of our own, README)
    [prefix_kernels:=compiled]   (smolvla, pi0, pi05: a fused prefix pass, README)
    [expert_dtype:=bfloat16]     (smolvla: the action expert in bfloat16, README)
    [rtc_delay:=3 rtc_queue_threshold:=10 [rtc_execution_horizon:=10] [rtc_schedule:=linear]
     [rtc_max_guidance_weight:=10.0]]   (smolvla, pi0, pi05: real-time chunking, README)

control_mode timer (the default here) steps at control_rate (the rate the policy was trained
at: its dataset's fps) over the newest frames and joint state; lockstep steps once per new
joint state (a simulator's), on the newest frames or, with camera_sync stamp, on each
camera's frame of the joint state's stamp. The observation size and the action size come from the
checkpoint (read when the launch starts: LeRobot is imported then). The instruction may
change later on /flashrt_policy/instruction (std_msgs/String) or as the node's instruction
parameter (ros2 param set). With action_joint_names, each
chunk also goes out on ~/action_chunk as a JointTrajectory; remap it to a
joint_trajectory_controller's topic with action_chunk_topic. Each step's action goes out on
~/joint_commands too (Float64MultiArray, in action_joint_names order): remap it to a
forward_command_controller's (its joints in that order) with joint_commands_topic.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

from flashrt_ros.runtime.policies.lerobot_rtc import RTC_OPTIONS

ARGUMENTS = {'checkpoint': None, 'camera_topics': None, 'joint_names': None,
             'instruction': '', 'compressed_cameras': '', 'joint_states': '/joint_states',
             'control_mode': 'timer', 'control_rate': '30.0', 'camera_sync': 'newest',
             'action_joint_names': '', 'joint_scale': '', 'joint_offset': '',
             'chunk_period': '0.0', 'device': 'auto', 'action_topic': '',
             'action_chunk_topic': '', 'joint_commands_topic': '', 'vision_dtype': '',
             'denoise_kernels': '', 'expert_dtype': '', 'prefix_kernels': '',
             **{k: '' for k in RTC_OPTIONS}}
# the options a checkpoint's policy class takes beyond the checkpoint (checkpoint_options)
OPTIONS = ('vision_dtype', 'denoise_kernels', 'prefix_kernels', 'expert_dtype',
           *RTC_OPTIONS)


def _list(a, key):
    """Launch argument `key` as a comma-separated list ('' is none). An empty entry ('a,,b', a
    trailing comma) is an error that names it: dropped, it would shift the entries after it
    onto the wrong joint or camera."""
    if not a[key].strip():
        return []
    items = [t.strip() for t in a[key].split(',')]
    if not all(items):
        raise RuntimeError(f'{key}:={a[key]!r} has an empty entry')
    return items


def _needed(a, key):
    """A list launch argument the node cannot run without (an empty one has no ROS type:
    launch_ros would fail naming none of them)."""
    items = _list(a, key)
    if not items:
        raise RuntimeError(f'{key}:={a[key]!r}: the node needs at least one')
    return items


def _typed(a, key, kind):
    """Launch argument `key` as kind (int, float or str), or an error that names it."""
    try:
        return kind(a[key])
    except ValueError:
        raise RuntimeError(f'{key}:={a[key]!r} is not '
                           f'{"an integer" if kind is int else "a number"}') from None


def _nodes(context):
    a = {k: LaunchConfiguration(k).perform(context) for k in ARGUMENTS}
    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_sizes
    kind, obs_dim, act_dim = checkpoint_sizes(a['checkpoint'])
    for topic, what in (('action_chunk_topic', 'chunks'),
                        ('joint_commands_topic', 'joint commands')):
        if a[topic] and not _list(a, 'action_joint_names'):
            raise RuntimeError(f'{topic}: {what} go out only with action_joint_names (the '
                               'joints they command)')
    remaps = [(src, dst) for src, dst in (('~/action', a['action_topic']),
                                          ('~/action_chunk', a['action_chunk_topic']),
                                          ('~/joint_commands', a['joint_commands_topic']),
                                          ('joint_states', a['joint_states'])) if dst]
    params = {'policy_type': kind, 'policy_file': a['checkpoint'], 'obs_dim': obs_dim,
              'act_dim': act_dim, 'autostart': True, 'observation_type': 'cameras',
              'camera_topics': _needed(a, 'camera_topics'),
              'joint_names': _needed(a, 'joint_names'), 'instruction': a['instruction'],
              'control_mode': a['control_mode'], 'control_rate': _typed(a, 'control_rate', float),
              'camera_sync': a['camera_sync'],
              'device': a['device'], 'chunk_period': _typed(a, 'chunk_period', float)}
    for key in ('action_joint_names', 'compressed_cameras'):
        if items := _list(a, key):      # (an empty list has no type for ROS)
            params[key] = items
    for key in ('joint_scale', 'joint_offset'):
        if items := _list(a, key):
            try:
                params[key] = [float(v) for v in items]
            except ValueError:
                raise RuntimeError(f'{key}:={a[key]!r} is not a list of numbers') from None
    given = [k for k in OPTIONS if a[k]]
    if given:
        from dataclasses import fields

        from flashrt_ros.runtime.policies import KINDS, option_kinds
        takes = option_kinds()
        for k in given:
            if kind not in takes[k]:
                raise RuntimeError(f'{k} is an option of {" / ".join(takes[k])}; '
                                   f'{a["checkpoint"]} is a {kind} checkpoint')
            types = {f.name: f.type for f in fields(KINDS[kind][1])}
            params[k] = _typed(a, k, types[k])  # int, float or str, as the node declares
    policy = Node(package='flashrt_ros', executable='policy_node', name='flashrt_policy',
                  output='screen', remappings=remaps, parameters=[params])
    return [policy]


def generate_launch_description():
    return LaunchDescription(
        [DeclareLaunchArgument(k, **({} if v is None else {'default_value': v}))
         for k, v in ARGUMENTS.items()] + [OpaqueFunction(function=_nodes)])
