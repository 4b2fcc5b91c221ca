"""The README's main job under ros2 launch: the policy node plus the demo driver.

ros2 launch flashrt_ros demo.launch.py [params_file:=my.yaml obs_dim:=<its obs_dim>]
The launch ends when the driver exits; its report says whether every check held, and the
exit status of `ros2 launch` says it too: 0 when the driver passed, 1 when it failed (or when
the policy node exited before the driver was done).

launch has no action that sets its exit status: `ros2 launch` returns what LaunchService.run()
returns, which is 0 after any Shutdown event and 1 only when an exception escapes an action or
event handler. So a failed driver raises one here, from its OnProcessExit handler; launch logs
it ("Caught exception in launch ...: demo driver exited with code 1 ..."), shuts everything
down, and exits 1. A Ctrl-C ends the launch with status 0, as any ros2 launch.
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, RegisterEventHandler
from launch.event_handlers import OnProcessExit
from launch.events import Shutdown
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node


class DemoFailed(RuntimeError):
    """Raised from an event handler: what makes `ros2 launch` exit non-zero."""


def _driver_exited(event, context):
    if context.is_shutdown:     # stopped by the launch (Ctrl-C, or the policy node failed)
        return None
    if event.returncode != 0:
        raise DemoFailed(f'demo driver exited with code {event.returncode}: the demo failed '
                         '(see its output above)')
    return [EmitEvent(event=Shutdown(reason='demo driver finished'))]


def _policy_exited(event, context):
    if not context.is_shutdown:     # exiting on the launch's own shutdown is the normal end
        raise DemoFailed(f'policy node exited with code {event.returncode} before the demo '
                         'driver was done (its reason is logged above)')


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory('flashrt_ros'), 'config',
                                  'policy.yaml')
    policy = Node(package='flashrt_ros', executable='policy_node', name='flashrt_policy',
                  parameters=[LaunchConfiguration('params_file')], output='screen')
    driver = Node(package='flashrt_ros', executable='demo_driver', name='flashrt_demo_driver',
                  parameters=[{'obs_dim': LaunchConfiguration('obs_dim')}], output='screen')
    return LaunchDescription([
        DeclareLaunchArgument('params_file', default_value=default_params,
                              description='YAML file with ros__parameters for flashrt_policy'),
        DeclareLaunchArgument('obs_dim', default_value='48',
                              description="observation size the driver sends: the policy's "
                              'obs_dim (48 in config/policy.yaml)'),
        policy,
        driver,
        RegisterEventHandler(OnProcessExit(target_action=driver, on_exit=_driver_exited)),
        RegisterEventHandler(OnProcessExit(target_action=policy, on_exit=_policy_exited)),
    ])
