"""A Unitree G1 walks in MuJoCo through flashrt_ros: the policy node (motion.pt, observations
assembled from the world's JointState and Imu, joint targets out) and the flashrt_sim world
(PD at 500 Hz, a policy step every 10 physics steps), in lock-step.

ros2 launch flashrt_ros g1_walk.launch.py robot_dir:=/path/to/unitree_g1 [namespace:=g1]
robot_dir holds scene.xml (with g1_12dof.xml and meshes/) and motion.pt (unitree_rl_gym).
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node


def generate_launch_description():
    params = os.path.join(get_package_share_directory('flashrt_ros'), 'config', 'g1.yaml')
    robot_dir = LaunchConfiguration('robot_dir')
    namespace = LaunchConfiguration('namespace')
    return LaunchDescription([
        DeclareLaunchArgument('robot_dir', description='folder with scene.xml and motion.pt'),
        DeclareLaunchArgument('namespace', default_value='',
                              description='namespace of both nodes and their topics'),
        Node(package='flashrt_ros', executable='sim_node', name='flashrt_sim',
             namespace=namespace, output='screen',
             parameters=[params, {'mjcf_path': PathJoinSubstitution([robot_dir, 'scene.xml'])}]),
        Node(package='flashrt_ros', executable='policy_node', name='flashrt_policy',
             namespace=namespace, output='screen',
             parameters=[params,
                         {'policy_file': PathJoinSubstitution([robot_dir, 'motion.pt'])}],
             # relative names: the world's topics in the same namespace
             remappings=[('joint_states', 'flashrt_sim/joint_states'),
                         ('imu', 'flashrt_sim/imu'),
                         ('~/joint_commands', 'flashrt_sim/joint_commands')]),
    ])
