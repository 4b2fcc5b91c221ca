"""The README's "In an existing ROS 2 workspace" commands, run as written where the tools exist:
a fresh colcon workspace with this package in src/, `colcon build --packages-select`, and
`colcon test` finding the suite. rosdep runs where it is installed with its database (it needs
the network once: `rosdep init && rosdep update`); otherwise its test skips and says so.
"""
import os
import pathlib
import re
import shlex
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / 'README.md'
# what a clone holds: the tracked tree, without this checkout's build products
IGNORED = shutil.ignore_patterns('.git', '.venv', 'build', 'install', 'log', '__pycache__',
                                 '.pytest_cache', '*.pyc', '.whl', '.baseline')


def _workspace_commands():
    """The shell lines of the README's workspace section."""
    text = README.read_text()
    section = text.split('## In an existing ROS 2 workspace', 1)[1].split('\n## ', 1)[0]
    block = re.search(r'```bash\n(.*?)```', section, re.S).group(1)
    return [line.split('#')[0].strip() for line in block.splitlines() if line.strip()]


def _colcon():
    colcon = shutil.which('colcon')
    if colcon is None:
        pytest.skip('colcon is not on PATH: run tools/test.sh (it sources tools/env.sh)')
    return colcon


@pytest.fixture(scope='module')
def workspace(tmp_path_factory):
    ws = tmp_path_factory.mktemp('ros2_ws')
    shutil.copytree(ROOT, ws / 'src' / 'flashrt_ros', ignore=IGNORED)
    return ws


def _run(cmd, cwd, timeout=900):
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, COLCON_LOG_PATH=str(cwd / 'log')))
    assert out.returncode == 0, f'{" ".join(cmd)} failed:\n{out.stdout[-3000:]}\n' \
                                f'{out.stderr[-3000:]}'
    return out.stdout + out.stderr


def _readme(prefix):
    """The README's workspace command that starts with `prefix`, up to any `&&`, as argv."""
    line = next((ln for ln in _workspace_commands() if ln.startswith(prefix)), None)
    assert line is not None, f'no "{prefix} ..." line in the README workspace section'
    return shlex.split(line.split('&&')[0])


@pytest.mark.slow
def test_the_readme_colcon_build_and_test_commands_work_as_written(workspace):
    """The README's own colcon lines, run in a fresh workspace: the build, the build with
    tests, and `colcon test` finding the suite."""
    colcon = _colcon()
    build = _readme('colcon build --packages-select flashrt_ros &&')
    _run([colcon] + build[1:], workspace)
    prefix = workspace / 'install' / 'flashrt_ros'
    assert (prefix / 'lib' / 'flashrt_ros' / 'policy_node').exists()
    assert (prefix / 'share' / 'flashrt_ros' / 'launch' / 'policy.launch.py').exists()
    build_tests = _readme('colcon build --packages-select flashrt_ros --cmake-args')
    assert '-DBUILD_TESTING=ON' in build_tests
    _run([colcon] + build_tests[1:], workspace)
    # ctest -N lists what `colcon test` runs without running it (running it here would run
    # this suite inside itself)
    test = _readme('colcon test ')
    listed = _run([colcon] + test[1:] + ['--event-handlers', 'console_direct+',
                                         '--ctest-args', '-N'], workspace)
    assert re.search(r'Test +#1: flashrt_ros_tests', listed), listed[-2000:]
    assert 'Total Tests: 1' in listed
    # the test's command: pytest over this package's test/ directory
    ctest_file = workspace / 'build' / 'flashrt_ros' / 'CTestTestfile.cmake'
    command = ctest_file.read_text()
    assert '-m' in command and 'pytest' in command and \
        str(workspace / 'src' / 'flashrt_ros' / 'test') in command


def test_rosdep_resolves_every_key_of_package_xml(workspace):
    rosdep = shutil.which('rosdep')
    if rosdep is None:
        pytest.skip('rosdep is not installed here (a distribution ROS install has it): the '
                    "package.xml keys were checked by hand against rosdistro's rosdep/*.yaml")
    probe = subprocess.run([rosdep, 'db'], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip('rosdep has no database here (rosdep init && rosdep update need the '
                    f'network): {probe.stderr.strip()[-300:]}')
    install = shlex.split(next(ln for ln in _workspace_commands()
                               if 'rosdep install' in ln).split('&&')[-1])
    _run([rosdep] + install[1:] + ['--simulate'], workspace, timeout=300)
