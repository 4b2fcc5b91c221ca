"""policy.launch.py under the real `ros2 launch` (from ../shared/ros-tools): how it ends.

A node that cannot start makes the launch exit non-zero; a Ctrl-C ends it with status 0, no
traceback, and the node's shutdown transition run. Each launch runs in a session of its own,
with stdin from /dev/null: launch then runs non-interactive and forwards a SIGINT to the node
on top of the one the test sends the whole process group (a terminal's Ctrl-C), as under an
IDE, a CI job or ssh. The test then repeats SIGINT to the node until it says it is shutting
down, so that one lands while the node handles the first, whatever the timing of launch's.
"""
import os
import pathlib
import signal
import subprocess
import time

import pytest

from support.ros_tools import NEEDS_ROS2, ROS2

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = NEEDS_ROS2
yaml = pytest.importorskip('yaml')

PARAMS = {'device': 'cpu', 'obs_dim': 7, 'act_dim': 3, 'rnn_hidden_dim': 24}
ACTIVE = "snapshot 'episode_start'"     # logged by the last step of activate


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # a background shell may have ignored it


class Launch:
    """`ros2 launch flashrt_ros policy.launch.py` with a params file of PARAMS and `values`."""

    def __init__(self, tmp_path, *args, **values):
        params = tmp_path / 'params.yaml'
        values = dict(PARAMS, capsule_dir=str(tmp_path / 'capsules'), **values)
        params.write_text(yaml.safe_dump({'/**': {'ros__parameters': values}}))
        # the test session's ROS domain (conftest.py), kept to this host
        env = dict(os.environ, PYTHONUNBUFFERED='1', ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST')
        self.log = tmp_path / 'launch.log'
        with open(self.log, 'w') as log:
            self.proc = subprocess.Popen(
                [ROS2, 'launch', 'flashrt_ros', 'policy.launch.py', f'params_file:={params}',
                 *args], env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_default_sigint)

    def output(self):
        return self.log.read_text()

    def wait_for(self, text, timeout=120.0):
        """Waits until `text` is in the output; fails at once if the launch ended first."""
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert self.proc.poll() is None, f'launch ended before {text!r}:\n{self.output()}'
            assert time.monotonic() < deadline, f'no {text!r} in {timeout} s:\n{self.output()}'
            time.sleep(0.1)

    def wait(self, timeout=60.0):
        return self.proc.wait(timeout=timeout)

    def interrupt(self):
        """Ctrl-C as a terminal sends it: SIGINT to every process of the launch's group; then
        SIGINT after SIGINT to the node alone (an impatient user, or launch's own one late)
        until it says it is shutting down or is gone: one of them lands in whatever the node
        does after the first."""
        node = int(self.output().split('process started with pid [')[1].split(']')[0])
        os.killpg(self.proc.pid, signal.SIGINT)
        deadline = time.monotonic() + 30.0
        while 'SIGINT: shutting down' not in self.output() and time.monotonic() < deadline:
            try:
                os.kill(node, signal.SIGINT)
            except ProcessLookupError:
                break
            time.sleep(0.005)

    def close(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # whatever is left of the group
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture
def launches():
    started = []
    yield lambda *args, **values: started.append(Launch(*args, **values)) or started[-1]
    for launch in started:
        launch.close()


def test_policy_that_cannot_load_fails_the_launch(launches, tmp_path):
    missing = tmp_path / 'no_such_policy.pt'
    launch = launches(tmp_path, policy_file=str(missing))
    code = launch.wait()
    out = launch.output()
    assert code != 0, out
    assert str(missing) in out and 'autostart failed' in out, out
    assert 'policy node exited with code 1' in out, out


def test_launch_arguments_reach_the_node(launches, tmp_path):
    """autostart:=true overrides the params file's false (so the missing policy fails the
    launch); the others show in the command line launch logs for the failed process."""
    launch = launches(tmp_path, 'namespace:=la', 'autostart:=true', 'use_sim_time:=true',
                      'log_level:=debug', 'joint_states:=/robot/joint_states',
                      'joint_commands:=/robot/commands', autostart=False,
                      policy_file=str(tmp_path / 'no_such_policy.pt'))
    assert launch.wait() != 0, launch.output()
    out = launch.output()
    assert '[DEBUG]' in out and 'autostart failed' in out, out
    cmd = out.split(" cmd '")[1].split("'")[0].split()
    assert ' '.join(cmd[cmd.index('--log-level'):][:2]) == '--log-level debug', cmd
    for rule in ('__ns:=/la', 'joint_states:=/robot/joint_states',
                 '~/joint_commands:=/robot/commands', 'imu:=imu'):
        assert rule in cmd, (rule, cmd)
    files = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == '--params-file']
    assert len(files) == 2, cmd     # params_file, then the arguments given: they win
    overrides = yaml.safe_load(pathlib.Path(files[1]).read_text())
    assert overrides == {'/**': {'ros__parameters': {'autostart': True, 'use_sim_time': True}}}


@pytest.fixture(scope='module')
def interrupted(tmp_path_factory):
    """One running launch, Ctrl-C'd: (exit status, output)."""
    launch = Launch(tmp_path_factory.mktemp('interrupted'))
    try:
        launch.wait_for(ACTIVE)
        launch.interrupt()
        code = launch.wait()
        return code, launch.output()
    finally:
        launch.close()


def test_ctrl_c_ends_the_launch_with_status_0_and_no_traceback(interrupted):
    code, out = interrupted
    assert code == 0, out
    assert 'Traceback' not in out and 'KeyboardInterrupt' not in out, out
    assert 'process has finished cleanly' in out, out      # the node exited 0 too


def test_ctrl_c_runs_the_shutdown_transition(interrupted):
    code, out = interrupted
    assert 'SIGINT: shutting down' in out, out
    assert 'shutdown from active: engine, topics and timers released' in out, out
