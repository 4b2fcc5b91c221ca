"""Starts the flashrt_policy node.

ros2 launch flashrt_ros policy.launch.py [namespace:=robot1] [params_file:=my.yaml]
    [observation_topic:=/robot/obs] [action_topic:=/robot/cmd]
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory('flashrt_ros'), 'config',
                                  'policy.yaml')
    return LaunchDescription([
        DeclareLaunchArgument('namespace', default_value='',
                              description='namespace of the node and its topics'),
        DeclareLaunchArgument('params_file', default_value=default_params,
                              description='YAML file with ros__parameters for flashrt_policy'),
        DeclareLaunchArgument('observation_topic', default_value='~/observation',
                              description='topic the policy reads observations from'),
        DeclareLaunchArgument('action_topic', default_value='~/action',
                              description='topic the policy publishes actions on'),
        Node(
            package='flashrt_ros',
            executable='policy_node',
            name='flashrt_policy',
            namespace=LaunchConfiguration('namespace'),
            parameters=[LaunchConfiguration('params_file')],
            remappings=[('~/observation', LaunchConfiguration('observation_topic')),
                        ('~/action', LaunchConfiguration('action_topic'))],
            output='screen',
        ),
    ])
