"""Starts the flashrt_policy node.

ros2 launch flashrt_ros policy.launch.py [namespace:=robot1] [params_file:=my.yaml]
    [autostart:=true|false] [use_sim_time:=true|false] [log_level:=debug|info|warn|error]
    [observation_topic:=/robot/obs] [action_topic:=/robot/cmd]
    [joint_states:=/robot/joint_states] [imu:=/robot/imu] [cmd_vel:=/cmd_vel]
    [joint_commands:=/forward_position_controller/commands]
    [joint_trajectory:=/joint_trajectory_controller/joint_trajectory]

autostart and use_sim_time left out keep what params_file says (config/policy.yaml: autostart
true); given, they override it. The topic arguments remap the node's topics (joint_states,
imu and cmd_vel are the inputs of observation_type terms, joint_commands and joint_trajectory
its command outputs) of a single-session node: a relative name resolves in `namespace`.

Exit status: a node that exits non-zero on its own (autostart failed: the policy did not load,
a setting is invalid) makes `ros2 launch` exit 1, as demo.launch.py does (see there why an
exception is the only way). Ctrl-C ends the launch with status 0; the node then goes through
its shutdown transition before it exits.

Under a lifecycle manager (nav2_lifecycle_manager), the manager configures and activates the
node, so the node must not do it itself: launch it with autostart:=false and give the manager

    lifecycle_manager:
      ros__parameters:
        node_names: ['flashrt_policy']    # relative to the manager's namespace; or give
                                          # '/robot1/flashrt_policy' (namespace:=robot1)
        autostart: true                   # the manager's: configure, then activate, at start
        bond_timeout: 0.0                 # this node forms no bond (see below)

With the node's own autostart on as well, the manager's configure finds the node active,
is refused (there is no configure from active) and the manager aborts the whole bringup. The
manager waits up to bond_timeout / 2 (default 4.0 s) after activating a node for a bond
heartbeat (bondcpp); this node has no bond, so any bond_timeout above 0 fails the bringup:
0.0 turns the bond off. See the flashrt_ros.node.policy_node docstring for the sequence.
"""
import os
import tempfile

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, RegisterEventHandler
from launch.event_handlers import OnProcessExit
from launch.substitution import Substitution
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
import yaml

# launch argument -> the node's topic it remaps (the name the node subscribes or publishes)
TOPICS = {'observation_topic': '~/observation', 'action_topic': '~/action',
          'joint_states': 'joint_states', 'imu': 'imu', 'cmd_vel': 'cmd_vel',
          'joint_commands': '~/joint_commands', 'joint_trajectory': '~/joint_trajectory'}
OVERRIDES = ('autostart', 'use_sim_time')     # boolean parameters a launch argument may set


class PolicyFailed(RuntimeError):
    """Raised from an event handler: what makes `ros2 launch` exit non-zero."""


def _policy_exited(event, context):
    # exiting on the launch's own shutdown (Ctrl-C) is the normal end, whatever its status
    if event.returncode != 0 and not context.is_shutdown:
        raise PolicyFailed(f'policy node exited with code {event.returncode} (its reason is '
                           'logged above)')


class GivenOverrides(Substitution):
    """Path of a parameters file holding the OVERRIDES given as launch arguments.

    A Node takes a parameter from a dict only with a value, and the default of a launch
    argument would then override params_file: autostart:=<unset> must keep what params_file
    says (test and robot configs set it there). launch_ros writes a dict of parameters to a
    temporary file the same way; an empty dict is a valid file for rcl.
    """

    def describe(self):
        return f'parameters given as launch arguments (of {", ".join(OVERRIDES)})'

    def perform(self, context):
        values = {}
        for name in OVERRIDES:
            text = context.launch_configurations.get(name, '')
            if text:
                value = yaml.safe_load(text)
                if not isinstance(value, bool):
                    raise ValueError(f'{name}:={text}: expected true or false')
                values[name] = value
        with tempfile.NamedTemporaryFile('w', prefix='flashrt_policy_', suffix='.yaml',
                                         delete=False) as file:
            yaml.safe_dump({'/**': {'ros__parameters': values}}, file)
        return file.name


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory('flashrt_ros'), 'config',
                                  'policy.yaml')
    policy = Node(
        package='flashrt_ros',
        executable='policy_node',
        name='flashrt_policy',
        namespace=LaunchConfiguration('namespace'),
        parameters=[LaunchConfiguration('params_file'), GivenOverrides()],
        remappings=[(topic, LaunchConfiguration(argument))
                    for argument, topic in TOPICS.items()],
        ros_arguments=['--log-level', LaunchConfiguration('log_level')],
        output='screen',
    )
    arguments = [
        DeclareLaunchArgument('namespace', default_value='',
                              description='namespace of the node and its topics'),
        DeclareLaunchArgument('params_file', default_value=default_params,
                              description='YAML file with ros__parameters for flashrt_policy'),
        DeclareLaunchArgument('autostart', default_value='',
                              description='true: configure and activate at start (a failure '
                              'exits 1); false: wait for lifecycle transitions (a lifecycle '
                              "manager's); empty: as params_file says"),
        DeclareLaunchArgument('use_sim_time', default_value='',
                              description='true: follow /clock; empty: as params_file says'),
        DeclareLaunchArgument('log_level', default_value='info',
                              description='debug, info, warn, error or fatal'),
    ] + [DeclareLaunchArgument(argument, default_value=topic,
                               description=f'topic the node uses as {topic}')
         for argument, topic in TOPICS.items()]
    return LaunchDescription(arguments + [
        policy,
        RegisterEventHandler(OnProcessExit(target_action=policy, on_exit=_policy_exited)),
    ])
