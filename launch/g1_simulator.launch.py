"""A Unitree G1 through the ROS standard simulator API: a world serving simulation_interfaces
(flashrt_sim, MuJoCo, in paused lock-step: each step sends the readings and waits for the
policy's command), the policy node (motion.pt) and the episode runner, which drives the world
only through simulation_interfaces (pause, reset, the SimulateSteps action, Get/SetEntityState
for pushes) plus the world capsules flashrt_sim serves beyond the standard: a snapshot of world +
policy after 10 s of walking, three pushed what-if branches, each replayed bit for bit. The
launch ends when the runner does; its last line says how many checks held ('5 passed, 0
failed'), and the runner's own exit status is logged ('process has finished cleanly' or the
code).

ros2 launch flashrt_ros g1_simulator.launch.py robot_dir:=/path/to/unitree_g1

For another simulator (Gazebo, Isaac Sim) serving simulation_interfaces, leave out the world
(world:=false), point `simulator` at its namespace (Gazebo: /gzserver) and the joint_states,
imu and joint_commands arguments at the robot's topics there; see the README,
"Any simulator".
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, RegisterEventHandler
from launch.conditions import IfCondition
from launch.event_handlers import OnProcessExit
from launch.events import Shutdown
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node


def generate_launch_description():
    params = os.path.join(get_package_share_directory('flashrt_ros'), 'config', 'g1.yaml')
    robot_dir = LaunchConfiguration('robot_dir')
    simulator = LaunchConfiguration('simulator')
    runner = Node(package='flashrt_ros', executable='episode_runner',
                  name='flashrt_episode_runner', output='screen',
                  parameters=[params, {'world': 'simulator', 'simulator': simulator,
                                       'push_entity': 'pelvis'}])
    return LaunchDescription([
        DeclareLaunchArgument('robot_dir', description='folder with scene.xml and motion.pt'),
        DeclareLaunchArgument('simulator', default_value='/flashrt_sim',
                              description='where the world serves simulation_interfaces'),
        DeclareLaunchArgument('joint_states', default_value='/flashrt_sim/joint_states',
                              description='the robot sensor_msgs/JointState topic'),
        DeclareLaunchArgument('imu', default_value='/flashrt_sim/imu',
                              description='the robot sensor_msgs/Imu topic'),
        DeclareLaunchArgument('joint_commands', default_value='/flashrt_sim/joint_commands',
                              description='where the joint position targets go'),
        DeclareLaunchArgument('world', default_value='true',
                              description='start the flashrt_sim MuJoCo world (false: another '
                              'simulator serves `simulator`)'),
        Node(package='flashrt_ros', executable='sim_node', name='flashrt_sim', output='screen',
             condition=IfCondition(LaunchConfiguration('world')),
             parameters=[params, {'mjcf_path': PathJoinSubstitution([robot_dir, 'scene.xml']),
                                  'lockstep': 'steps'}]),
        Node(package='flashrt_ros', executable='policy_node', name='flashrt_policy',
             output='screen',
             parameters=[params,
                         {'policy_file': PathJoinSubstitution([robot_dir, 'motion.pt'])}],
             remappings=[('joint_states', LaunchConfiguration('joint_states')),
                         ('imu', LaunchConfiguration('imu')),
                         ('~/joint_commands', LaunchConfiguration('joint_commands'))]),
        runner,
        # the launch ends with the runner (the world and the policy node have no end)
        RegisterEventHandler(OnProcessExit(target_action=runner, on_exit=[
            EmitEvent(event=Shutdown(reason='the episode runner finished'))])),
    ])
