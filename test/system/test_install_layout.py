"""The colcon install tree has what `ros2 run` / `ros2 launch` and Python users look for."""
import os
import pathlib

import pytest

pytestmark = pytest.mark.ros
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _prefix():
    """The package's install prefix from AMENT_PREFIX_PATH (set by install/setup.bash)."""
    for entry in os.environ.get('AMENT_PREFIX_PATH', '').split(os.pathsep):
        if (pathlib.Path(entry) / 'share' / 'flashrt_ros' / 'package.xml').exists():
            return pathlib.Path(entry)
    pytest.skip('flashrt_ros is not built/sourced: run tools/bootstrap.sh, source tools/env.sh')


def test_executables_are_installed_for_ros2_run():
    lib = _prefix() / 'lib' / 'flashrt_ros'
    for name in ('policy_node', 'demo_driver'):
        exe = lib / name
        assert exe.is_file(), exe
        assert os.access(exe, os.X_OK), '%s is not executable' % exe


def test_launch_config_and_interfaces_are_installed():
    share = _prefix() / 'share' / 'flashrt_ros'
    for sub in ('launch', 'config'):
        src = sorted(p.name for p in (ROOT / sub).iterdir() if not p.name.startswith('.'))
        assert src, 'nothing in %s/' % sub
        dst = sorted(p.name for p in (share / sub).iterdir() if not p.name.startswith('.'))
        assert dst == src
    assert (share / 'srv' / 'Snapshot.srv').is_file()
    assert (share / 'msg' / 'CapsuleInfo.msg').is_file()


def test_python_package_merges_runtime_and_generated_modules():
    import flashrt_ros
    from flashrt_ros.runtime import state  # noqa: F401
    from flashrt_ros.srv import Snapshot  # noqa: F401
    installed = [p for p in flashrt_ros.__path__ if 'install' in pathlib.Path(p).parts]
    assert installed, flashrt_ros.__path__
