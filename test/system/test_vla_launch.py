"""`ros2 launch flashrt_ros smolvla.launch.py` for real: the installed policy node on a LeRobot
checkpoint folder, subscribed to the cameras and joint states this test publishes over Fast DDS
(control_mode timer, the launch's default); the first action is the engine's for the same
observation, each chunk goes out as a trajectory on the remapped controller topic, and Ctrl-C
ends the launch with status 0.
"""
import os
import signal
import subprocess
import time

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy', reason='needs rclpy (ROS 2 Jazzy): run tools/test.sh')
pytest.importorskip('lerobot.policies.smolvla.modeling_smolvla',
                    reason='needs lerobot 0.4.4 and transformers (requirements/vla.txt)')
from sensor_msgs.msg import Image, JointState  # noqa: E402
from std_msgs.msg import Float32MultiArray, Float64MultiArray  # noqa: E402
import torch  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

from flashrt_ros.client import spin_in_thread  # noqa: E402
from flashrt_ros.runtime.engine import PolicyEngine  # noqa: E402
from flashrt_ros.runtime.policies.lerobot_smolvla import SmolVLAChunkPolicy  # noqa: E402
from support.common import wait_for  # noqa: E402
from support.ros_tools import NEEDS_ROS2, ROS2  # noqa: E402
from support.smolvla import (ACT_DIM, CAMERAS, checkpoint, STATE_DIM, TASKS,  # noqa: E402
                             vectors, vlm_folder)


def _needs_ros2(test):
    for mark in NEEDS_ROS2:
        test = mark(test)
    return test


RTC = {'rtc_delay': 2, 'rtc_queue_threshold': 3, 'rtc_schedule': 'exp'}


@_needs_ros2
@pytest.mark.slow
@pytest.mark.parametrize('options', [
    {}, RTC, {'denoise_kernels': 'compiled', 'prefix_kernels': 'compiled'}],
    ids=['queue', 'real_time_chunking', 'compiled_kernels'])
def test_smolvla_launch_acts_on_cameras_and_joint_states(tmp_path, options):
    """With the rtc_* launch arguments the whole chunk goes out (8 actions); with
    denoise_kernels and prefix_kernels compiled the launched node compiles in its process and
    its actions are those of an engine compiled in this one, bit for bit."""
    rtc = 'rtc_delay' in options
    folder = checkpoint(vlm_folder(tmp_path / 'vlm'), tmp_path / 'checkpoint')
    joints = [f'j{i}' for i in range(STATE_DIM)]
    arm = [f'arm_{i}' for i in range(ACT_DIM)]
    log = open(tmp_path / 'launch.log', 'w')
    launch = subprocess.Popen(
        [ROS2, 'launch', 'flashrt_ros', 'smolvla.launch.py', f'checkpoint:={folder}',
         'camera_topics:=' + ','.join(f'{k}=/cam{i}' for i, k in enumerate(CAMERAS)),
         'joint_names:=' + ','.join(joints), f'instruction:={TASKS[0]}', 'device:=cpu',
         'action_joint_names:=' + ','.join(arm), 'chunk_period:=0.1',
         'action_chunk_topic:=/arm_controller/joint_trajectory',
         'joint_commands_topic:=/forward_position_controller/commands',
         *[f'{k}:={v}' for k, v in options.items()]],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONUNBUFFERED='1', ROS_HOME=str(tmp_path)))
    rclpy.init()
    node = rclpy.create_node('vla_launch_test')
    spinner = spin_in_thread(node)
    try:
        actions, chunks, commands = [], [], []
        node.create_subscription(Float32MultiArray, '/flashrt_policy/action',
                                 lambda m: actions.append(list(m.data)), 10)
        node.create_subscription(Float64MultiArray, '/forward_position_controller/commands',
                                 lambda m: commands.append(list(m.data)), 10)
        node.create_subscription(JointTrajectory, '/arm_controller/joint_trajectory',
                                 chunks.append, 10)
        cams = [node.create_publisher(Image, f'/cam{i}', 10) for i in range(len(CAMERAS))]
        js = node.create_publisher(JointState, '/joint_states', 10)
        rng = np.random.default_rng(0)
        images = {k: rng.integers(0, 256, (s[1], s[2], 3), dtype=np.uint8)
                  for k, s in CAMERAS.items()}
        state = rng.standard_normal(STATE_DIM).astype(np.float32)

        def publish():      # the same readings again, 5 times a second, until an action
            time.sleep(0.2)
            for pub, image in zip(cams, images.values()):
                h, w, _ = image.shape
                pub.publish(Image(height=h, width=w, encoding='rgb8', step=3 * w,
                                  data=image.tobytes()))
            js.publish(JointState(name=joints, position=[float(v) for v in state]))
            return bool(actions)
        try:
            wait_for(publish, 120, what='an action from the launched nodes')
        except TimeoutError as exc:
            raise AssertionError((tmp_path / 'launch.log').read_text()[-3000:]) from exc
        wait_for(lambda: chunks, 30, what='the chunk on the controller topic')
        wait_for(lambda: commands, 30, what="the step's command on the forward controller's")
        frame = {'observation.state': torch.from_numpy(state), 'task': TASKS[0],
                 **{k: torch.from_numpy(im.transpose(2, 0, 1).astype(np.float32) /
                                        np.float32(255)) for k, im in images.items()}}
        engine = PolicyEngine(SmolVLAChunkPolicy.from_pretrained(folder, **options),
                              device='cpu',
                              capsule_dir=str(tmp_path / 'reference'))
        assert actions[0] == engine.step(vectors(folder, [frame])[0]).tolist() == commands[0]
        assert list(chunks[0].joint_names) == arm
        assert len(chunks[0].points) == (8 if rtc else 5)
        assert list(chunks[0].points[0].positions) == pytest.approx(actions[0], abs=0)
        if not options:     # a new instruction while running, through the real `ros2 param`
            for verb, *args in (('set', TASKS[1]), ('get',)):
                r = subprocess.run([ROS2, 'param', verb, '--no-daemon', '--timeout', '30',
                                    '/flashrt_policy', 'instruction', *args],
                                   capture_output=True, text=True, timeout=120)
                assert r.returncode == 0, r.stdout + r.stderr
            assert TASKS[1] in r.stdout
            wait_for(lambda: f'instruction: {TASKS[1]!r}' in (tmp_path / 'launch.log')
                     .read_text(), 30, what='the node to take the new instruction')
    finally:
        spinner.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
        launch.send_signal(signal.SIGINT)
        try:
            status = launch.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launch.kill()
            status = launch.wait()
        log.close()
    assert status == 0, (tmp_path / 'launch.log').read_text()[-3000:]


@_needs_ros2
@pytest.mark.parametrize('argument, words', [
    # a Pi0 / Pi0.5 option with a SmolVLA checkpoint: it would change nothing
    ('vision_dtype:=bfloat16', 'vision_dtype is an option of pi0 / pi05;'),
    ('rtc_delay:=3.0', "rtc_delay:='3.0' is not an integer"),
    ('joint_scale:=57.3,deg', "joint_scale:='57.3,deg' is not a list of numbers"),
    # dropped, the empty entry would put the offsets after it on the wrong joints
    ('joint_offset:=0.1,,0.3', "joint_offset:='0.1,,0.3' has an empty entry"),
    # a controller's topic for chunks that never go out (no joints named)
    ('action_chunk_topic:=/jtc/joint_trajectory', 'chunks go out only with action_joint_names'),
    ('joint_commands_topic:=/fwd/commands', 'joint commands go out only with action_joint'),
    # blank (ros2 launch refuses an empty value itself): launch_ros's own error for an
    # empty list names no argument
    ('joint_names:= ', "joint_names:=' ': the node needs at least one")])
def test_arguments_that_cannot_work_end_the_launch_with_their_name(tmp_path, argument, words):
    """A launch argument that cannot work ends the launch with an error that names it, before
    any node starts."""
    folder = checkpoint(vlm_folder(tmp_path / 'vlm'), tmp_path / 'checkpoint')
    out = subprocess.run(
        [ROS2, 'launch', 'flashrt_ros', 'smolvla.launch.py', f'checkpoint:={folder}',
         'camera_topics:=' + ','.join(f'{k}=/cam{i}' for i, k in enumerate(CAMERAS)),
         'joint_names:=a', argument], capture_output=True, text=True,
        timeout=120, env=dict(os.environ, ROS_HOME=str(tmp_path)))
    assert out.returncode != 0
    assert words in out.stdout + out.stderr, (out.stdout + out.stderr)[-2000:]
    assert 'policy_node' not in out.stdout + out.stderr
