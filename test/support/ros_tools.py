"""What the system tests start as a user would: the installed executables, and the upstream
ros2 CLI and launch (../shared/ros-tools, installed into .venv by tools/bootstrap.sh). No rclpy
at import: the skip marks must work where ROS is absent."""
import os
import pathlib
import shutil
import signal
import subprocess

import pytest

ROS_TOOLS = pathlib.Path(__file__).resolve().parents[3] / 'shared' / 'ros-tools'
ROS2 = shutil.which('ros2')
# pytestmark of a module that runs `ros2 ...`: skipped, with the reason, where it is absent
NEEDS_ROS2 = [
    pytest.mark.ros,
    pytest.mark.skipif(not ROS_TOOLS.is_dir(), reason=f'no {ROS_TOOLS}: the upstream ros2 CLI '
                       'and launch tools exist only beside a developer or CI checkout'),
    pytest.mark.skipif(ROS2 is None, reason='no ros2 executable: run tools/bootstrap.sh (it '
                       'installs ../shared/ros-tools into .venv) and source tools/env.sh'),
]


def installed_executable(name):
    """The path of this package's installed executable `name` (lib/flashrt_ros/<name> under
    the first AMENT_PREFIX_PATH entry that has it). None installed is a broken set-up, not a
    reason to skip: FileNotFoundError."""
    for prefix in os.environ.get('AMENT_PREFIX_PATH', '').split(os.pathsep):
        exe = pathlib.Path(prefix) / 'lib' / 'flashrt_ros' / name
        if prefix and exe.exists():
            return str(exe)
    raise FileNotFoundError(f'{name} is not installed on AMENT_PREFIX_PATH: run tools/test.sh '
                            '(it builds the package and sources tools/env.sh)')


def stop_gently(proc, timeout=30.0):
    """Ends a node process started by a test: SIGINT (its shutdown transition runs and its
    endpoints leave the graph, so the next node of that name starts clean), SIGKILL if it is
    still there after `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
