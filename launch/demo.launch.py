"""The README's main job under ros2 launch: the policy node plus the demo driver.

ros2 launch flashrt_ros demo.launch.py
The launch ends when the driver exits; its report says whether every check held.
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import EmitEvent, RegisterEventHandler
from launch.event_handlers import OnProcessExit
from launch.events import Shutdown
from launch_ros.actions import Node


def generate_launch_description():
    params = os.path.join(get_package_share_directory('flashrt_ros'), 'config', 'policy.yaml')
    policy = Node(package='flashrt_ros', executable='policy_node', name='flashrt_policy',
                  parameters=[params], output='screen')
    driver = Node(package='flashrt_ros', executable='demo_driver', name='flashrt_demo_driver',
                  output='screen')
    return LaunchDescription([
        policy,
        driver,
        RegisterEventHandler(OnProcessExit(target_action=driver,
                                           on_exit=[EmitEvent(event=Shutdown())])),
    ])
