"""The G1 through the ROS standard simulator API, with the installed executables: the
g1_simulator.launch.py under the real `ros2 launch`, and a policy node killed with SIGKILL
between two SimulateSteps goals that resumes from its checkpoint file, the walk going on
exactly as without the kill. Needs ../shared (the G1 assets, simulation_interfaces, ros2).
"""
import os
import signal
import subprocess
import time

import pytest

from support.ros_tools import installed_executable, NEEDS_ROS2, ROS2

rclpy = pytest.importorskip('rclpy', reason='needs rclpy (ROS 2 Jazzy): run tools/test.sh')
pytest.importorskip('simulation_interfaces', reason='simulation_interfaces is not built: it '
                    'comes from ../shared/ros-src (tools/bootstrap.sh builds it there)')
from simulation_interfaces.msg import Result, SimulationState  # noqa: E402
from simulation_interfaces.srv import ResetSimulation, SetSimulationState  # noqa: E402

from flashrt_ros.client import call_service, spin_in_thread  # noqa: E402
from flashrt_ros.runtime.recovery import checkpoint_sequence  # noqa: E402
from support.robots import G1 as ROBOT, G1_YAML, NEEDS_G1  # noqa: E402
from support.sim_driver import SimDriver  # noqa: E402


def test_quitting_ends_the_world_node(tmp_path):
    """SetSimulationState QUITTING: answered RESULT_OK, then the flashrt_sim process ends
    with status 0 (the standard: the simulator application closes)."""
    log = open(tmp_path / 'world.log', 'w')
    sim = subprocess.Popen([installed_executable('sim_node'), '--ros-args', '-r',
                            '__node:=flashrt_sim_quit'], stdout=log, stderr=subprocess.STDOUT)
    rclpy.init()
    node = rclpy.create_node('quit_test')
    spinner = spin_in_thread(node)
    try:
        client = node.create_client(SetSimulationState, '/flashrt_sim_quit/set_simulation_state')
        assert client.wait_for_service(timeout_sec=60.0), 'the world did not come up'
        _answered_once(client, tmp_path / 'world.log')
        request = SetSimulationState.Request()
        request.state.state = SimulationState.STATE_QUITTING
        try:
            response = call_service(client, request, 30.0)[0]
        except TimeoutError as exc:
            raise AssertionError(f'{exc}; the world printed:\n'
                                 f'{(tmp_path / "world.log").read_text()}') from exc
        assert response.result.result == Result.RESULT_OK, response.result.error_message
        assert sim.wait(timeout=30) == 0, (tmp_path / 'world.log').read_text()
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait()
        spinner.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()


def _answered_once(client, log):
    """Asks for the state the world is in (PAUSED: ALREADY_IN_TARGET_STATE, no effect) until
    an answer comes. wait_for_service proves only the client's side of discovery: Fast DDS
    (rmw_fastrtps, Jazzy) drops a response, after waiting 100 ms, when the server has not yet
    matched the client's response reader ("failed to send response (timeout)" in the server's
    log). Only a request that changes nothing may be sent again, so QUITTING goes after this
    round trip has shown that answers reach this client."""
    request = SetSimulationState.Request()
    request.state.state = SimulationState.STATE_PAUSED
    for _ in range(10):
        try:
            response = call_service(client, request, 3.0)[0]
        except TimeoutError:
            continue
        assert response.result.result == SetSimulationState.Response.ALREADY_IN_TARGET_STATE, \
            response.result.error_message
        return
    raise AssertionError(f'no answer to 10 requests in 30 s; the world printed:\n'
                         f'{log.read_text()}')


def _needs_ros2(test):
    for mark in NEEDS_ROS2:
        test = mark(test)
    return test


@NEEDS_G1
@_needs_ros2
def test_g1_simulator_launch_runs_the_what_ifs_through_the_standard(tmp_path):
    """`ros2 launch flashrt_ros g1_simulator.launch.py`: world, policy node and runner; the
    runner drives the world through simulation_interfaces + world capsules, every check holds
    and the launch ends with the runner."""
    env = dict(os.environ, PYTHONUNBUFFERED='1', ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST',
               ROS_HOME=str(tmp_path))
    log = tmp_path / 'launch.log'
    with open(log, 'w') as out:
        proc = subprocess.run([ROS2, 'launch', 'flashrt_ros', 'g1_simulator.launch.py',
                               f'robot_dir:={ROBOT}'], env=env, stdin=subprocess.DEVNULL,
                              stdout=out, stderr=subprocess.STDOUT, timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert 'simulator at /flashrt_sim: world capsules (exact branches)' in text, text
    assert '5 passed, 0 failed' in text and '[FAIL]' not in text, text
    assert 'process has finished cleanly' in text.split('episode_runner', 1)[1], text


def _start(name, args, log):
    cmd = [installed_executable(name), '--ros-args', '--params-file', str(G1_YAML), *args]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _policy(tmp_path, capsules, log, *extra):
    return _start('policy_node', [
        '-p', f'policy_file:={ROBOT / "motion.pt"}', '-p', 'device:=cpu',
        '-p', f'capsule_dir:={capsules}', '-r', 'joint_states:=/flashrt_sim/joint_states',
        '-r', 'imu:=/flashrt_sim/imu', '-r', '~/joint_commands:=/flashrt_sim/joint_commands',
        *extra], open(tmp_path / log, 'w'))


@NEEDS_G1
@pytest.mark.slow
def test_g1_policy_killed_between_simulate_steps_resumes_exactly(tmp_path):
    """A world in paused lock-step (lockstep 'steps') and a policy node that checkpoints every
    step to disk. 500 steps uninterrupted; then, from a reset, 250 steps, SIGKILL once
    checkpoint 250 is on disk, a new node resumes from it (restore_on_start: latest) and 250
    more steps: the world ends where the uninterrupted walk did, bit for bit (every entity's
    pose, twist and acceleration), at 250 steps and at 500."""
    sim = _start('sim_node', ['-p', f'mjcf_path:={ROBOT / "scene.xml"}', '-p', 'lockstep:=steps',
                              '-p', 'command_timeout:=120.0', '-p', 'republish_period:=0.2',
                              '-r', '__node:=flashrt_sim'], open(tmp_path / 'world.log', 'w'))
    procs = [sim]
    rclpy.init()
    driver = SimDriver()
    try:
        procs.append(_policy(tmp_path, tmp_path / 'plain', 'plain.log'))
        driver.simulate(250)
        plain_half = driver.states()
        driver.simulate(250)
        plain = driver.states()
        procs.pop().kill()
        driver.call('reset_simulation', ResetSimulation.Request(scope=255))
        capsules = tmp_path / 'capsules'
        resume = ('-p', 'checkpoint_every:=1', '-p', 'checkpoint_to_disk:=true',
                  '-p', 'restore_on_start:=latest')
        procs.append(_policy(tmp_path, capsules, 'first.log', *resume))
        driver.simulate(250)
        half = driver.states()
        deadline = time.monotonic() + 60
        while not any(checkpoint_sequence(p.name) == 250
                      for p in capsules.glob('checkpoint-*.capsule')):
            assert time.monotonic() < deadline, 'checkpoint 250 never reached the disk'
            time.sleep(0.05)
        procs[-1].send_signal(signal.SIGKILL)
        procs.pop().wait()
        procs.append(_policy(tmp_path, capsules, 'second.log', *resume))
        driver.simulate(250)
        resumed = driver.states()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        driver.close()
        rclpy.try_shutdown()
    log = (tmp_path / 'second.log').read_text()
    assert 'restore_on_start: resumed from ' in log and ' at step 250' in log, log
    assert half == plain_half, 'the first 250 steps differ'
    assert resumed == plain, 'the walk after the kill differs from the uninterrupted one'
    assert resumed != half
