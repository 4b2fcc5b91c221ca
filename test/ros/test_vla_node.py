"""The policy node with a LeRobot SmolVLA checkpoint (policy_type smolvla, policy_file the
checkpoint folder): observations in over ~/observation (state, camera images, the
instruction's token ids and mask) or assembled by the node from camera, joint state and
instruction topics (observation_type cameras), actions out bit for bit those of the same
checkpoint on an engine without ROS, and the capsule services mid-chunk: a snapshot restored
replays the same actions across the next chunk. The checkpoint is a tiny SmolVLA LeRobot
writes offline.
"""
import pytest

pytest.importorskip('lerobot.policies.smolvla.modeling_smolvla',
                    reason='needs lerobot 0.4.4 and transformers (requirements/vla.txt)')

from flashrt_ros.runtime.camera_inputs import as_floats  # noqa: E402
from support.smolvla import ACT_DIM, checkpoint, frames, OBS_DIM, vectors, vlm_folder  # noqa

STEPS = 5       # the checkpoint's n_action_steps


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
    return checkpoint(vlm_folder(tmp_path_factory.mktemp('smolvlm')),
                      tmp_path_factory.mktemp('checkpoint'))


def _params(folder, **more):
    """A SmolVLA checkpoint's parameters, `more` added or overriding (policy_type too)."""
    return dict(dict(policy_type='smolvla', policy_file=folder, obs_dim=OBS_DIM,
                     act_dim=ACT_DIM, seed=3), **more)


def test_node_steps_the_checkpoint_and_restores_mid_chunk(make, folder):
    """Mid-chunk: a snapshot restored replays, twice; a fork of it runs a what-if (the
    engine's actions on those other observations) and leaves the original branch as it
    was."""
    h = make(_params(folder))
    obs = vectors(folder, frames(3 * STEPS, seed=2))
    first = h.steps(obs[:STEPS + 2])
    assert first == h.reference(obs[:STEPS + 2])
    assert h.call('snapshot', name='mid').success
    later = h.steps(obs[STEPS + 2:])                     # crosses into the third chunk
    assert first + later == h.reference(obs)
    for _ in range(2):
        assert h.call('restore', name='mid').success
        assert h.steps(obs[STEPS + 2:]) == later
    # a what-if from the same point: a fork of the capsule, other observations on it; the
    # original branch is untouched by it
    assert h.call('fork', source='mid', target='what_if').success
    assert h.call('restore', name='what_if').success
    other = vectors(folder, frames(len(later), seed=9))
    assert h.steps(other) == h.reference(obs[:STEPS + 2] + other)[STEPS + 2:] != later
    assert h.call('restore', name='mid').success
    assert h.steps(obs[STEPS + 2:]) == later
    # an instruction parameter here would change nothing (the tokens come in ~/observation)
    from rclpy.parameter import Parameter
    result = h.node.set_parameters([Parameter('instruction', value='pick')])[0]
    assert not result.successful and 'cameras and a checkpoint' in result.reason


def test_restore_of_the_kv_kind_keeps_the_prefix_across_a_restart(make, folder):
    """~/restore with kinds [kv]: an episode restarted from its start capsule, given back the
    prefix of its first chunk, skips that chunk's prefix pass with the same actions; an
    unknown kind is refused and changes nothing."""
    h = make(_params(folder))
    obs = vectors(folder, frames(STEPS + 1, seed=4))
    assert h.call('snapshot', name='start').success
    first = h.steps(obs[:1])
    assert h.call('snapshot', name='first').success
    rest = h.steps(obs[1:])
    policy = h.node.parts.engine.policy
    reused = policy.prefix_reused
    assert h.call('restore', name='start').success
    answer = h.call('restore', name='first', kinds=['kv'])
    assert answer.success and 'kv' in answer.message, answer.message
    assert h.steps(obs) == first + rest
    assert policy.prefix_reused == reused + 1
    bad = h.call('restore', name='first', kinds=['weights'])
    assert not bad.success and 'weights' in bad.message
    assert h.steps(obs[-1:]) == h.reference(obs + obs[-1:])[-1:]     # the state unmoved


@pytest.mark.parametrize('wrong', [
    dict(obs_dim=OBS_DIM - 1), dict(act_dim=ACT_DIM + 1), dict(policy_file=''),
    dict(noise_std=0.1),
    # a joint named twice: a trajectory controller would leave one joint unset
    dict(action_joint_names=['a'] * 2 + [f'j{i}' for i in range(ACT_DIM - 2)],
         chunk_period=0.05),
    # no chunk_period, ~/observation: 1 / control_rate would not be the policy's period
    dict(action_joint_names=[f'j{i}' for i in range(ACT_DIM)]),
    # chunk_period without action_joint_names: no chunk would go out
    dict(chunk_period=0.05),
    # real-time chunking's settings without rtc_delay: it would be off
    dict(rtc_queue_threshold=3), dict(rtc_schedule='exp')])
def test_what_is_not_the_checkpoint_is_refused_at_configure(make, folder, wrong):
    h = make(dict(_params(folder), **wrong), start=False)
    assert not h.client.change_state('configure')
    assert h.node.parts is None


def _image_msgs(image, key, t):
    """One uint8 image [H, W, 3] as the camera of `key` publishes it: for the top camera
    rgb8, bgr8 and bgra8 (a simulator's, its alpha ignored) on frames t in turn, a PNG
    CompressedImage for the wrist one (lossless)."""
    import io

    import numpy as np
    from PIL import Image as PILImage
    from sensor_msgs.msg import CompressedImage, Image
    if key.endswith('top'):
        h, w, _ = image.shape
        encoding = ('rgb8', 'bgr8', 'bgra8')[t % 3]
        data = image if encoding == 'rgb8' else image[..., ::-1]
        if encoding == 'bgra8':
            data = np.concatenate([data, np.full((h, w, 1), 200, np.uint8)], axis=2)
        return Image(height=h, width=w, encoding=encoding, step=data.shape[2] * w,
                     data=data.tobytes())
    buffer = io.BytesIO()
    PILImage.fromarray(image).save(buffer, format='PNG')
    return CompressedImage(format='png', data=buffer.getvalue())


def _send_frames(rng, cams, readings, t, stamp=None):
    """A random uint8 frame per camera, published (_image_msgs of frame t, stamped `stamp`,
    a builtin_interfaces Time, if given) until `readings` (a session's CameraReadings) holds
    each as LeRobot's datasets give it: those frames, float32 [3, H, W] in [0, 1], as
    tensors."""
    import numpy as np
    import torch

    from support.common import publish_until
    from support.smolvla import CAMERAS
    images = {k: rng.integers(0, 256, (s[1], s[2], 3), dtype=np.uint8)
              for k, s in CAMERAS.items()}
    floats = {k: torch.from_numpy(as_floats(im)) for k, im in images.items()}
    msgs = [_image_msgs(image, key, t) for key, image in images.items()]
    for msg in msgs if stamp is not None else ():
        msg.header.stamp = stamp
    publish_until(lambda: [pub.publish(msg) for pub, msg in zip(cams, msgs)],
                  lambda: all(torch.equal(readings.observation.image(k), f)
                              and k in readings.observation.has for k, f in floats.items()),
                  what='the frames to reach the node')
    return floats


def _camera_node(make, folder, cameras, **more):
    """A node with observation_type cameras (lock-step) on `cameras` ({key: topic}; the
    second one compressed) and a robot node publishing them, /joint_states and the
    node's ~/instruction: (harness, robot node, camera publishers, joint state publisher,
    instruction publisher)."""
    import rclpy
    from sensor_msgs.msg import CompressedImage, Image, JointState
    from std_msgs.msg import String

    from support.common import wait_for
    keys = list(cameras)
    h = make(_params(folder, observation_type='cameras', camera_topics=[
        f'{k}={t}' for k, t in cameras.items()], compressed_cameras=keys[1:2], **more))
    node = rclpy.create_node(h.name + '_robot')
    cams = [node.create_publisher(CompressedImage if i else Image, t, 10)
            for i, t in enumerate(cameras.values())]
    js = node.create_publisher(JointState, '/joint_states', 10)
    say = node.create_publisher(String, f'/{h.name}/instruction', 10)
    wait_for(lambda: all(p.get_subscription_count() for p in cams + [js, say]),
             what='the camera, joint state and instruction topics to match')
    return h, node, cams, js, say


def test_cameras_joint_states_and_an_instruction_drive_the_node(make, folder):
    """observation_type cameras: the node takes Image (rgb8, bgr8) and CompressedImage (PNG)
    frames, JointState (other joints, another order) and the instruction (parameter, then
    ~/instruction, then the parameter set while running), and assembles the observation on
    its device: its actions are the engine's on the same frames as LeRobot's datasets give
    them (uint8 / 255), tokenized by LeRobot's own pre-processor. A frame or joint state it
    cannot take is refused, named and counted, and changes no action."""
    import numpy as np
    from builtin_interfaces.msg import Time
    from rclpy.parameter import Parameter
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import Header, String
    import torch

    from support.common import publish_until, wait_for
    from support.smolvla import CAMERAS, STATE_DIM, TASKS
    joints = [f'j{i}' for i in range(STATE_DIM)]
    topics = {k: f'/cam{i}_{k.split(".")[-1]}' for i, k in enumerate(CAMERAS)}
    h, robot, cams, js, say = _camera_node(make, folder, topics, joint_names=joints,
                                           instruction=TASKS[0])
    try:
        readings = h.node.parts.loop.cameras[0]
        rng = np.random.default_rng(5)
        frames, sent = [], 0

        def joint_state(stamp, state, order):     # lock-step: one stamp per step
            return JointState(name=order, header=Header(stamp=stamp), position=[
                float(state[joints.index(n)]) if n in joints else 9.0 for n in order])
        for t in range(2 * STEPS + 1):
            if t == STEPS + 1:              # a new instruction mid-run
                say.publish(String(data=TASKS[1]))
                wait_for(lambda: readings.text == TASKS[1], what='the new instruction')
            if t == 2 * STEPS:              # and another one, as a parameter (live)
                for text in ('', TASKS[0]):     # '' too: what the parameter says runs
                    assert h.node.set_parameters([Parameter('instruction', value=text)])[
                        0].successful
                    assert readings.text == text
            floats = _send_frames(rng, cams, readings, t)
            state = rng.standard_normal(STATE_DIM).astype(np.float32)
            if t == 2:      # what the node cannot take: refused, named, no step
                h_, w_ = CAMERAS[next(iter(CAMERAS))][1:]
                report = h.node.report
                for bad, words in ((Image(height=h_ + 1, width=w_, encoding='rgb8', step=3 * w_,
                                          data=bytes(3 * w_ * (h_ + 1))), 'checkpoint takes'),
                                   (Image(height=h_, width=w_, encoding='yuv422', step=2 * w_,
                                          data=bytes(2 * w_ * h_)), "'yuv422'")):
                    count = report.rejected     # (a camera keeps one frame: one at a time)
                    publish_until(lambda: cams[0].publish(bad),
                                  lambda: report.rejected > count, what='the refusal')
                    assert words in report.last_refusal, report.last_refusal
                lacks = [k for k in report.refusals if k.startswith('joint state lacks')]
                js.publish(joint_state(Time(sec=t + 1, nanosec=5), state, joints[1:]))
                wait_for(lambda: [k for k in report.refusals
                                  if k.startswith("joint state lacks joints ['j0']")] != lacks,
                         what='the refusal')
                assert report.refusals['image'] >= 2
                assert all(torch.equal(readings.observation.image(k), f)
                           for k, f in floats.items())        # the frames before them kept
            order = list(reversed(joints)) + ['extra']
            js.publish(joint_state(Time(sec=t + 1), state, order))
            sent += 1
            h.client.wait_actions(sent)
            frames.append({'observation.state': torch.from_numpy(state), **floats,
                           'task': TASKS[0] if t <= STEPS or t == 2 * STEPS else TASKS[1]})
        got = h.client.wait_actions(sent)
        assert got == h.reference(vectors(folder, frames))
    finally:
        robot.destroy_node()


def test_lockstep_after_a_restore_waits_for_new_frames(make, folder):
    """Lock-step (a simulator): a restore replaces the world's episode too, so the frames
    from before it are stale, as its joint states are. A joint state that comes before a new
    frame from every camera waits for them, refused nothing: it steps once the last camera's
    frame has come, the restored state's step on the new frames."""
    import time

    import numpy as np
    from builtin_interfaces.msg import Time
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Header
    import torch

    from support.common import wait_for
    from support.smolvla import CAMERAS, STATE_DIM, TASKS
    joints = [f'j{i}' for i in range(STATE_DIM)]
    topics = {k: f'/lock{i}_{k.split(".")[-1]}' for i, k in enumerate(CAMERAS)}
    h, robot, cams, js, _ = _camera_node(make, folder, topics, joint_names=joints,
                                         instruction=TASKS[0])
    try:
        readings, report = h.node.parts.loop.cameras[0], h.node.report
        rng = np.random.default_rng(8)
        sent, frames = 0, []

        def send_state(t):
            state = rng.standard_normal(STATE_DIM).astype(np.float32)
            js.publish(JointState(name=joints, header=Header(stamp=Time(sec=t + 1)),
                                  position=[float(v) for v in state]))
            return state

        assert h.call('snapshot', name='start').success
        for t in range(2):
            floats = _send_frames(rng, cams, readings, t)
            state = send_state(t)
            sent += 1
            h.client.wait_actions(sent)
            frames.append({'observation.state': torch.from_numpy(state), **floats,
                           'task': TASKS[0]})
        assert h.call('restore', name='start').success
        refused, session = dict(report.refusals), h.node.parts.robot.sessions[0]
        state = send_state(2)   # before any new frame: the old episode's frames are stale
        wait_for(lambda: session.inputs.get('joint_state', (0, None))[1] == (3, 0),
                 what='the joint state to reach the node')
        time.sleep(0.5)
        assert h.client.actions_received() == sent      # it waits for the frames
        floats = _send_frames(rng, cams, readings, 3)
        sent += 1
        got = h.client.wait_actions(sent)
        assert len(got) == sent and report.refusals == refused
        restarted = {'observation.state': torch.from_numpy(state), **floats, 'task': TASKS[0]}
        assert got[-1] == h.reference(vectors(folder, [restarted]))[0]
        assert got[:2] == h.reference(vectors(folder, frames))
    finally:
        robot.destroy_node()


def test_lockstep_a_step_that_could_not_run_answers_no_stamp(make, folder):
    """Lock-step: a joint state that comes before the instruction waits for it (held, not
    refused) and steps when it comes; a joint state refused (a joint missing) answers nothing,
    so the world's corrected reading of that stamp steps. Before, both used up their stamp:
    the world, waiting for an answer to it, stalled."""
    import time

    import numpy as np
    from builtin_interfaces.msg import Time
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Header, String
    import torch

    from support.common import wait_for
    from support.smolvla import CAMERAS, STATE_DIM, TASKS
    joints = [f'j{i}' for i in range(STATE_DIM)]
    topics = {k: f'/untold{i}_{k.split(".")[-1]}' for i, k in enumerate(CAMERAS)}
    h, robot, cams, js, say = _camera_node(make, folder, topics, joint_names=joints)
    try:
        readings, report = h.node.parts.loop.cameras[0], h.node.report
        session, rng, frames = h.node.parts.robot.sessions[0], np.random.default_rng(3), []

        def observe(t, names=joints):
            floats = _send_frames(rng, cams, readings, t)
            state = rng.standard_normal(STATE_DIM).astype(np.float32)
            js.publish(JointState(name=names, header=Header(stamp=Time(sec=t + 1)),
                                  position=[float(v) for v in state[:len(names)]]))
            return {'observation.state': torch.from_numpy(state), **floats, 'task': TASKS[0]}
        frames.append(observe(0))
        wait_for(lambda: session.inputs.get('joint_state', (0, None))[1] == (1, 0),
                 what='the joint state')
        time.sleep(0.5)
        assert h.client.actions_received() == 0 and report.rejected == 0    # it waits
        say.publish(String(data=TASKS[0]))
        h.client.wait_actions(1)
        frames.append(observe(1, joints[:-1]))          # refused: a joint missing
        wait_for(lambda: report.rejected == 1, what='the refusal')
        assert 'j5' in report.last_refusal, report.last_refusal
        state = rng.standard_normal(STATE_DIM).astype(np.float32)     # the corrected one
        frames[-1]['observation.state'] = torch.from_numpy(state)
        js.publish(JointState(name=joints, header=Header(stamp=Time(sec=2)),
                              position=[float(v) for v in state]))
        got = h.client.wait_actions(2)
        assert report.rejected == 1 and got == h.reference(vectors(folder, frames))
    finally:
        robot.destroy_node()


def test_one_robots_bad_token_ids_refuse_its_own_step_only(make, folder):
    """A fleet of two on ~/<name>/observation: one robot's observation with a token id the
    model cannot embed is refused alone, naming that robot; the other robot's steps go on, its
    actions a one-robot engine's. Before, the row was kept among the fleet's observations and
    refused every later tick, the other robot's too."""
    import numpy as np

    from flashrt_ros.client import PolicyClient
    from support.common import wait_for
    from support.smolvla import TOKENS
    names = ['left', 'right']
    h = make(_params(folder, sessions=2, session_names=names), start=False)
    h.transition('configure')
    h.transition('activate')
    clients = {n: PolicyClient(h.client_node, '/' + h.name, session=n, timeout=10.0)
               for n in names}
    wait_for(lambda: all(s.action_pub.get_subscription_count() and
                         c._obs_pub.get_subscription_count()
                         for s, c in zip(h.node.parts.robot.sessions, clients.values())),
             what='both robots matched')
    obs = vectors(folder, frames(3, seed=2))
    got = [clients['left'].step(obs[0])]
    bad = np.array(obs[1], dtype=np.float32)
    bad[-TOKENS - 1] = 0.5                  # a token id that is not an integer
    clients['right'].publish_only(bad)
    wait_for(lambda: h.node.report.rejected == 1, what='the refusal')
    assert h.node.report.last_refusal.startswith('session right: '), \
        h.node.report.last_refusal
    got += [clients['left'].step(o) for o in obs[1:]]
    assert h.node.report.rejected == 1
    assert [list(a) for a in got] == h.reference(obs, params=dict(sessions=1,
                                                                  session_names=[]))


def test_lockstep_a_world_resending_after_a_restore_gets_its_command_and_chunk(make, folder):
    """Lock-step, a chunk policy with command outputs: after a restore, a world that re-sends
    the readings the restored state answered last (it never got their command) gets that
    step's command again, the restored state's action, and the rest of its chunk from it;
    not a second step. A chunk policy keeps no last_action buffer: the action is its queue's
    (the world waited, stalled, for a command that never came)."""
    import numpy as np
    from builtin_interfaces.msg import Time
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray, Header
    from trajectory_msgs.msg import JointTrajectory

    from support.common import wait_for
    from support.smolvla import CAMERAS, STATE_DIM, TASKS
    joints = [f'j{i}' for i in range(STATE_DIM)]
    topics = {k: f'/again{i}_{k.split(".")[-1]}' for i, k in enumerate(CAMERAS)}
    h, robot, cams, js, _ = _camera_node(make, folder, topics, joint_names=joints,
                                         instruction=TASKS[0], chunk_period=0.05,
                                         action_joint_names=joints[:ACT_DIM])
    chunks, commands = [], []
    subs = [h.client_node.create_subscription(JointTrajectory, f'/{h.name}/action_chunk',
                                              chunks.append, 10),
            h.client_node.create_subscription(Float64MultiArray, f'/{h.name}/joint_commands',
                                              commands.append, 10)]
    wait_for(lambda: all(s.get_publisher_count() for s in subs), what='the outputs')
    try:
        readings, rng, states = h.node.parts.loop.cameras[0], np.random.default_rng(8), []
        for t in range(STEPS + 2):
            _send_frames(rng, cams, readings, t)
            states.append([float(v) for v in rng.standard_normal(STATE_DIM)])
            js.publish(JointState(name=joints, header=Header(stamp=Time(sec=t + 1)),
                                  position=states[-1]))
            actions = h.client.wait_actions(t + 1)
            if t == 2:
                assert h.call('snapshot', name='mid').success
        wait_for(lambda: len(chunks) == 2 and len(commands) == STEPS + 2, what='the outputs')
        assert h.call('restore', name='mid').success
        js.publish(JointState(name=joints, header=Header(stamp=Time(sec=3)), position=states[2]))
        wait_for(lambda: len(commands) == STEPS + 3 and len(chunks) == 3,
                 what='the command and the chunk again')
        assert [float(v) for v in commands[-1].data] == [float(v) for v in actions[2]]
        assert [[float(v) for v in p.positions] for p in chunks[-1].points] == \
            [[float(v) for v in a] for a in actions[2:STEPS]]
        assert h.client.actions_received() == STEPS + 3     # ~/action again, no step
    finally:
        robot.destroy_node()


def test_lockstep_refuses_a_joint_state_long_after_a_cameras_newest_frame(make, folder):
    """Lock-step, camera_sync newest (a simulator's cameras at their own rate): a joint state
    stamped more than max_input_age after a camera's newest frame (a camera that stopped)
    is refused, naming the camera, and steps nothing; a new frame steps it. Within
    max_input_age the newest frames are stepped on, as before. (Unstamped frames are not
    aged: the other lock-step tests send them.)"""
    import time

    import numpy as np
    from builtin_interfaces.msg import Time
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Header
    import torch

    from support.common import wait_for
    from support.smolvla import CAMERAS, STATE_DIM, TASKS
    joints = [f'j{i}' for i in range(STATE_DIM)]
    topics = {k: f'/behind{i}_{k.split(".")[-1]}' for i, k in enumerate(CAMERAS)}
    h, robot, cams, js, _ = _camera_node(make, folder, topics, joint_names=joints,
                                         instruction=TASKS[0], max_input_age=0.1)
    try:
        readings, report = h.node.parts.loop.cameras[0], h.node.report
        rng, frames = np.random.default_rng(6), []

        def send_state(stamp, floats):
            state = rng.standard_normal(STATE_DIM).astype(np.float32)
            js.publish(JointState(name=joints, header=Header(stamp=stamp),
                                  position=[float(v) for v in state]))
            frames.append({'observation.state': torch.from_numpy(state), 'task': TASKS[0],
                           **floats})

        floats = _send_frames(rng, cams, readings, 0, Time(sec=1))
        send_state(Time(sec=1), floats)
        h.client.wait_actions(1)
        send_state(Time(sec=1, nanosec=90_000_000), floats)    # 0.09 s on: the same frames
        h.client.wait_actions(2)
        refused = report.refusals.get('stale input', 0)
        send_state(Time(sec=2), floats)                         # 1 s on: none came since
        wait_for(lambda: report.refusals.get('stale input', 0) > refused,
                 what='the stale frames refused')
        assert 'the joint state stamped 2.000000000 is more than 0.1 s (max_input_age) ' \
            'after the frames of observation.images.top (its newest frame stamped ' \
            '1.000000000)' in report.last_refusal, report.last_refusal
        time.sleep(0.5)
        assert h.client.actions_received() == 2
        frames[-1].update(_send_frames(rng, cams, readings, 1, Time(sec=2)))
        got = h.client.wait_actions(3)
        assert got == h.reference(vectors(folder, frames))
    finally:
        robot.destroy_node()


def test_camera_sync_stamp_steps_each_joint_state_on_its_own_frames(make, folder):
    """camera_sync stamp (a world that renders every step): a joint state waits for each
    camera's frame of its stamp, so a frame still on its way is waited for, not replaced by
    the one before; a frame of another stamp does not step it. In timer mode it is refused
    at configure."""
    import time

    import numpy as np
    from builtin_interfaces.msg import Time
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Header
    import torch

    from support.common import publish_until, wait_for
    from support.smolvla import CAMERAS, STATE_DIM, TASKS
    joints = [f'j{i}' for i in range(STATE_DIM)]
    topics = {k: f'/sync{i}_{k.split(".")[-1]}' for i, k in enumerate(CAMERAS)}
    h, robot, cams, js, _ = _camera_node(make, folder, topics, joint_names=joints,
                                         instruction=TASKS[0], camera_sync='stamp')
    try:
        session, rng, frames = h.node.parts.robot.sessions[0], np.random.default_rng(4), []

        def send_frames(sec, images):
            for pub, (key, image) in zip(cams, images.items()):
                msg = _image_msgs(image, key, sec)
                msg.header.stamp = Time(sec=sec)
                pub.publish(msg)

        def new_images():
            return {k: rng.integers(0, 256, (s[1], s[2], 3), dtype=np.uint8)
                    for k, s in CAMERAS.items()}

        def held(sec):      # the joint state of stamp sec has come, and stepped nothing
            wait_for(lambda: session.inputs.get('joint_state', (0, None))[1] == (sec, 0),
                     what='the joint state to reach the node')
            time.sleep(0.5)
            return h.client.actions_received() == len(frames)

        for sec in (1, 2):
            state = rng.standard_normal(STATE_DIM).astype(np.float32)
            js.publish(JointState(name=joints, header=Header(stamp=Time(sec=sec)),
                                  position=[float(v) for v in state]))
            assert held(sec)                    # no frame of its stamp yet
            older = new_images()                # the step before's: not this one's
            publish_until(lambda: send_frames(sec - 1, older), lambda: all(
                session.inputs.get('camera:' + k, (0, None))[1] == (sec - 1, 0)
                for k in CAMERAS), what='the older frames')
            assert held(sec)
            images = new_images()
            frames.append({'observation.state': torch.from_numpy(state), 'task': TASKS[0],
                           **{k: torch.from_numpy(as_floats(im)) for k, im in images.items()}})
            # (best effort: a frame may be lost, so again until the step; one step a stamp)
            publish_until(lambda: send_frames(sec, images),
                          lambda: h.client.actions_received() == len(frames),
                          what='the step on its own frames')
        assert h.client.wait_actions(2) == h.reference(vectors(folder, frames))
    finally:
        robot.destroy_node()
    timer = make(_params(folder, observation_type='cameras', camera_topics=[
        f'{k}={t}' for k, t in topics.items()], joint_names=joints, control_mode='timer',
        camera_sync='stamp'), start=False)
    assert not timer.client.change_state('configure') and timer.node.parts is None


def test_timer_mode_steps_on_the_newest_frames_and_refuses_stale_ones(make, folder):
    """control_mode timer: control_rate steps over the newest frame of each camera and the
    newest joint state, each the engine's action on that observation; once a camera has
    sent nothing for max_input_age the steps are refused, naming it, no action goes out,
    and the diagnostics show each input's age."""
    import time

    import numpy as np
    from sensor_msgs.msg import JointState
    import torch

    from support.common import publish_until
    from support.smolvla import CAMERAS, STATE_DIM, TASKS
    joints = [f'j{i}' for i in range(STATE_DIM)]
    topics = {k: f'/timer_cam{i}' for i, k in enumerate(CAMERAS)}
    h, robot, cams, js, _ = _camera_node(make, folder, topics, joint_names=joints,
                                         instruction=TASKS[0], control_mode='timer',
                                         control_rate=20.0, max_input_age=0.5)
    try:
        readings = h.node.parts.loop.cameras[0]
        rng = np.random.default_rng(9)
        images = {k: rng.integers(0, 256, (s[1], s[2], 3), dtype=np.uint8)
                  for k, s in CAMERAS.items()}
        state = rng.standard_normal(STATE_DIM).astype(np.float32)
        floats = {k: as_floats(im) for k, im in images.items()}

        def send(cameras):
            for pub, (key, image) in list(zip(cams, images.items()))[:cameras]:
                pub.publish(_image_msgs(image, key, 0))
            js.publish(JointState(name=joints, position=[float(v) for v in state]))
        publish_until(lambda: send(2), lambda: all(torch.equal(
            readings.observation.image(k), torch.from_numpy(f)) for k, f in floats.items()),
            what='the frames to reach the node')
        deadline = time.monotonic() + 20      # fresh readings: a step every tick
        while h.client.actions_received() < 6 and time.monotonic() < deadline:
            send(2)
            time.sleep(0.05)
        report, wrist = h.node.report, list(CAMERAS)[1]
        stale = f'stale input: camera:{wrist} is'
        publish_until(lambda: send(1), lambda: stale in report.last_refusal, every=0.05,
                      what='the stale camera refused')     # the wrist camera went quiet
        time.sleep(0.2)             # (an action sent before the refusal has arrived by now)
        got = h.client.actions_received()
        for _ in range(6):          # still quiet: nothing more goes out
            send(1)
            time.sleep(0.05)
        assert h.client.actions_received() == got and stale in report.last_refusal
        # the diagnostics say which input went quiet (the others' ages: under 0.5 s)
        values = {v.key: v.value for v in h.node.diagnostic(h.node.status_message()).values}
        ages = {k[len('input age: '):]: int(v.split()[0]) for k, v in values.items()
                if k.startswith('input age: ')}
        top = list(CAMERAS)[0]
        assert sorted(ages) == sorted(['joint_state', f'camera:{top}', f'camera:{wrist}'])
        assert ages[f'camera:{wrist}'] > 500 > max(ages['joint_state'], ages[f'camera:{top}'])
        frame = {'observation.state': torch.from_numpy(state), 'task': TASKS[0],
                 **{k: torch.from_numpy(f) for k, f in floats.items()}}
        actions = h.client.wait_actions(got)
        assert actions == h.reference(vectors(folder, [frame] * got))
    finally:
        robot.destroy_node()


def test_a_frame_being_decoded_holds_up_no_step(make, folder, monkeypatch):
    """Frames are decoded on the node's camera thread, without its lock: while a
    CompressedImage's decode is held (an Event here, around PIL's real decode: a slow JPEG),
    joint states still step the node, on the frames it had, and the frame enters the
    observation whole once decoded. Every action is the engine's on the frames the node had
    at that step."""
    import threading

    import numpy as np
    from builtin_interfaces.msg import Time
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Header
    import torch

    from flashrt_ros.node import camera_readings
    from support.common import publish_until, wait_for
    from support.smolvla import CAMERAS, STATE_DIM, TASKS
    joints = [f'j{i}' for i in range(STATE_DIM)]
    topics = {k: f'/held_cam{i}' for i, k in enumerate(CAMERAS)}
    h, robot, cams, js, _ = _camera_node(make, folder, topics, joint_names=joints,
                                         instruction=TASKS[0])
    entered, release, decode = threading.Event(), threading.Event(), \
        camera_readings.compressed_pixels

    def held(*args):
        entered.set()
        assert release.wait(60), 'the test never released the decode'
        return decode(*args)
    try:
        readings, rng = h.node.parts.loop.cameras[0], np.random.default_rng(4)
        wrist = list(CAMERAS)[1]        # the compressed one (_camera_node)
        images = [{k: rng.integers(0, 256, (s[1], s[2], 3), dtype=np.uint8)
                   for k, s in CAMERAS.items()} for _ in range(2)]
        images[1] = {**images[0], wrist: images[1][wrist]}     # a new wrist frame only
        floats = [{k: torch.from_numpy(as_floats(im)) for k, im in ims.items()}
                  for ims in images]

        def arrived(f):
            return all(torch.equal(readings.observation.image(k), v) for k, v in f.items())
        publish_until(lambda: [pub.publish(_image_msgs(image, key, 0)) for pub, (key, image)
                               in zip(cams, images[0].items())], lambda: arrived(floats[0]),
                      what='the first frames to reach the node')
        frames, sent = [], 0

        def step(on):
            nonlocal sent
            state = rng.standard_normal(STATE_DIM).astype(np.float32)
            js.publish(JointState(name=joints, header=Header(stamp=Time(sec=sent + 1)),
                                  position=[float(v) for v in state]))
            sent += 1
            h.client.wait_actions(sent)
            frames.append({'observation.state': torch.from_numpy(state), 'task': TASKS[0],
                           **floats[on]})
        step(0)
        monkeypatch.setattr(camera_readings, 'compressed_pixels', held)
        publish_until(lambda: cams[1].publish(_image_msgs(images[1][wrist], wrist, 0)),
                      entered.is_set, what='the wrist frame to be decoding')
        for _ in range(2 * STEPS):      # two chunks while the decode is held
            step(0)
        assert not release.is_set() and arrived(floats[0])
        release.set()
        wait_for(lambda: arrived(floats[1]), what='the held frame to enter the observation')
        step(1)
        assert h.client.wait_actions(sent) == h.reference(vectors(folder, frames))
    finally:
        release.set()
        robot.destroy_node()


def test_a_fleet_of_robots_with_cameras(make, folder):
    """sessions 2: each robot's cameras and joint states under its session name, its own
    instruction on its ~/<name>/instruction, both sessions' observations assembled in one
    device tensor and stepped together (lock-step); each session's actions are those of an
    engine of its own on that robot's frames and instruction."""
    import numpy as np
    import rclpy
    from builtin_interfaces.msg import Time
    from sensor_msgs.msg import CompressedImage, Image, JointState
    from std_msgs.msg import Header, String
    import torch

    from flashrt_ros.client import PolicyClient
    from support.common import publish_until, wait_for
    from support.smolvla import CAMERAS, STATE_DIM, TASKS
    joints, names = [f'j{i}' for i in range(STATE_DIM)], ['left', 'right']
    keys = list(CAMERAS)
    topics = [f'{k}=camera{i}/image' for i, k in enumerate(keys)]
    h = make(_params(folder, observation_type='cameras', camera_topics=topics,
                     compressed_cameras=keys[1:], joint_names=joints, sessions=2,
                     session_names=names), start=False)
    h.transition('configure')
    h.transition('activate')
    node = rclpy.create_node(h.name + '_robots')
    try:
        pubs = {n: ([node.create_publisher(CompressedImage if i else Image,
                                           f'/{n}/camera{i}/image', 10) for i in range(2)],
                    node.create_publisher(JointState, f'/{n}/joint_states', 10),
                    node.create_publisher(String, f'/{h.name}/{n}/instruction', 10))
                for n in names}
        clients = {n: PolicyClient(h.client_node, '/' + h.name, session=n) for n in names}
        wait_for(lambda: all(p.get_subscription_count() for cams, js, say in pubs.values()
                             for p in cams + [js, say]) and all(
            s.action_pub.get_subscription_count() for s in h.node.parts.robot.sessions),
            what='every robot\'s topics to match')
        readings, rng = h.node.parts.loop.cameras, np.random.default_rng(11)
        tasks = dict(zip(names, TASKS))
        for n, (_, _, say) in pubs.items():
            publish_until(lambda say=say, n=n: say.publish(String(data=tasks[n])),
                          lambda i=names.index(n): readings[i].text == tasks[n],
                          what='each robot\'s instruction')
        frames = {n: [] for n in names}
        for t in range(2 * STEPS + 1):
            for i, n in enumerate(names):
                cams, js, _ = pubs[n]
                floats = _send_frames(rng, cams, readings[i], t)
                state = rng.standard_normal(STATE_DIM).astype(np.float32)
                frames[n].append({'observation.state': torch.from_numpy(state),
                                  'task': tasks[n], **floats})
            for n in names:         # both joint states of the stamp: one tick steps both
                pubs[n][1].publish(JointState(
                    name=joints, header=Header(stamp=Time(sec=t + 1)),
                    position=[float(v) for v in frames[n][-1]['observation.state']]))
            for n in names:
                clients[n].wait_actions(t + 1)
        for n in names:
            assert clients[n].wait_actions(2 * STEPS + 1) == h.reference(
                vectors(folder, frames[n]), params=dict(sessions=1, session_names=[]))
    finally:
        node.destroy_node()


@pytest.mark.parametrize('wrong, named', [
    ({}, None),                                                     # the setup that works
    (dict(camera_topics=['observation.images.top=/cam0']), 'camera_topics'),    # one missing
    (dict(camera_topics=['observation.images.top=/a', 'observation.images.side=/b']),
     'camera_topics'),
    (dict(camera_topics=['observation.images.top=/cam 0', 'observation.images.wrist=/c']),
     'camera_topics'),                                              # not a topic name
    (dict(compressed_cameras=['observation.images.elsewhere']), 'compressed_cameras'),
    (dict(joint_names=['j0']), 'joint_names'),
    (dict(policy_file=''), 'policy_file'),
    (dict(policy_type='recurrent', policy_file=''), 'observation_type'),
    (dict(sessions=2), 'camera_topics'),            # a fleet on one robot's cameras
    (dict(joint_scale=[1.0, 2.0]), 'joint_scale'),  # not one per joint
    (dict(joint_scale=[1.0] * 5 + [0.0]), 'joint_scale'),
    (dict(joint_offset=[0.0] * 5 + [float('nan')]), 'joint_offset'),
    # units without named actions: ~/action could not go back to ROS units by joint
    (dict(joint_scale=[2.0] * 6), 'action_joint_names'),
    (dict(joint_offset=[1.0] * 6, action_joint_names=['j0', 'j1', 'j2', 'j3', 'gripper'],
          chunk_period=0.05), 'action_joint_names'),
    # units where the node does not assemble the state: they would change nothing
    (dict(observation_type='float32_array', joint_scale=[2.0] * 6), 'joint_scale'),
    (dict(observation_type='float32_array', instruction='pick'), 'instruction'),
    # the terms mode's joint targets and supervisor: cameras builds neither, and a robot
    # would run without the limits and the supervision it was configured with
    (dict(safety=['joint_position:hold']), 'safety'),
    (dict(joint_lower_limits=[-1.0] * 6, joint_upper_limits=[1.0] * 6), 'joint_lower_limits'),
    (dict(default_angles=[0.0] * 6), 'default_angles')])
def test_a_cameras_setup_that_cannot_work_is_refused_at_configure(make, folder, wrong, named):
    from flashrt_ros.node.settings import load_settings
    from flashrt_ros.runtime.errors import InvalidConfig
    from support.smolvla import CAMERAS, STATE_DIM
    good = dict(observation_type='cameras', joint_names=[f'j{i}' for i in range(STATE_DIM)],
                camera_topics=[f'{k}=/cam{i}' for i, k in enumerate(CAMERAS)],
                compressed_cameras=['observation.images.wrist'])
    h = make(dict(_params(folder), **dict(good, **wrong)), start=False)
    if named is None:
        setup = load_settings(h.node).cameras
        assert setup.topics == {k: f'/cam{i}' for i, k in enumerate(CAMERAS)}
        assert setup.compressed == {'observation.images.wrist'}
        return
    with pytest.raises(InvalidConfig, match=f"parameter '{named}'"):
        load_settings(h.node)
    assert not h.client.change_state('configure')
    assert h.node.parts is None


def test_joint_units_convert_the_state_in_and_the_actions_out(make, folder):
    """joint_scale / joint_offset (a checkpoint recorded in LeRobot's arm units, a robot
    publishing radians): the state the policy reads is (position - offset) * scale, and
    ~/action, ~/action_chunk and the command outputs (~/joint_commands for a forward command
    controller, ~/joint_trajectory) carry its actions back in ROS units, by joint name (the
    action joints a subset of the state's, in another order): value / scale + offset, the
    engine's actions on the converted state."""
    import numpy as np
    from builtin_interfaces.msg import Time
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray, Header
    import torch
    from trajectory_msgs.msg import JointTrajectory

    from support.common import wait_for
    from support.smolvla import CAMERAS, STATE_DIM, TASKS
    joints = [f'j{i}' for i in range(STATE_DIM)]
    actions = ['j4', 'j0', 'j3', 'j1', 'j2']        # ACT_DIM of them
    scale, offset = [57.29577951308232, 2.0, -1.5, 0.5, 100.0, 1.0], \
        [0.1, -0.2, 0.0, 0.3, 0.25, 1.0]
    topics = {k: f'/units{i}_{k.split(".")[-1]}' for i, k in enumerate(CAMERAS)}
    h, robot, cams, js, _ = _camera_node(
        make, folder, topics, joint_names=joints, instruction=TASKS[0], joint_scale=scale,
        joint_offset=offset, action_joint_names=actions, chunk_period=0.05,
        command_outputs=['float64_array', 'joint_trajectory'])
    chunks, commands, points = [], [], []
    subs = [h.client_node.create_subscription(msg_type, f'/{h.name}/{topic}', got.append, 10)
            for msg_type, topic, got in ((JointTrajectory, 'action_chunk', chunks),
                                         (Float64MultiArray, 'joint_commands', commands),
                                         (JointTrajectory, 'joint_trajectory', points))]
    wait_for(lambda: all(sub.get_publisher_count() for sub in subs), what='the output topics')
    try:
        readings, rng, frames = h.node.parts.loop.cameras[0], np.random.default_rng(4), []
        for t in range(STEPS + 1):
            floats = _send_frames(rng, cams, readings, t)
            radians = rng.uniform(-1.5, 1.5, STATE_DIM)
            js.publish(JointState(name=joints, header=Header(stamp=Time(sec=t + 1)),
                                  position=[float(v) for v in radians]))
            h.client.wait_actions(t + 1)
            state = ((radians - offset) * scale).astype(np.float32)   # the checkpoint's units
            frames.append({'observation.state': torch.from_numpy(state), 'task': TASKS[0],
                           **floats})
        want = np.array(h.reference(vectors(folder, frames)), np.float64)
        at = [joints.index(n) for n in actions]
        ros = want / np.array(scale)[at] + np.array(offset)[at]
        got = np.array(h.client.wait_actions(STEPS + 1))
        assert np.array_equal(got, ros.astype(np.float32))      # ~/action: float32
        assert not np.allclose(got, want, atol=1e-3)            # (the units changed them)
        wait_for(lambda: len(chunks) == 2, what='two chunks')
        assert list(chunks[0].joint_names) == actions
        assert np.array_equal([list(p.positions) for p in chunks[0].points], ros[:STEPS])
        wait_for(lambda: len(commands) == len(points) == STEPS + 1, what='the commands')
        assert np.array_equal([list(c.data) for c in commands], ros)   # float64, exactly
        assert all(list(p.joint_names) == actions and len(p.points) == 1 for p in points)
        assert np.array_equal([list(p.points[0].positions) for p in points], ros)
    finally:
        robot.destroy_node()


def _chunk_node(make, folder, **more):
    """A node with action_joint_names, chunk_period 0.05 s and a subscriber matched on
    ~/action_chunk: (harness, the joint names, the trajectories received)."""
    from trajectory_msgs.msg import JointTrajectory

    from support.common import wait_for
    names = [f'arm_{i}' for i in range(ACT_DIM)]
    h = make(_params(folder, action_joint_names=names, chunk_period=0.05, **more))
    chunks = []
    sub = h.client_node.create_subscription(
        JointTrajectory, f'/{h.name}/action_chunk', chunks.append, 10)
    wait_for(lambda: sub.get_publisher_count() > 0 and
             h.node.parts.robot.sessions[0].chunk_pub.get_subscription_count() > 0,
             what='the chunk topic to match')
    return h, names, chunks


def test_each_chunk_goes_out_as_a_trajectory_a_controller_takes(make, folder):
    """With action_joint_names, each chunk the policy computes goes out once on
    ~/action_chunk: its n_action_steps actions (the ones the next steps publish, in order),
    chunk_period apart, a trajectory that joint_trajectory_controller's validation accepts."""
    import importlib.util
    import pathlib
    import time

    from support.common import wait_for
    # the transcription of joint_trajectory_controller's validation (a unit-layer module)
    path = pathlib.Path(__file__).parents[1] / 'unit' / 'test_controller_acceptance.py'
    spec = importlib.util.spec_from_file_location('controller_acceptance', path)
    acceptance = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acceptance)
    h, names, chunks = _chunk_node(make, folder)
    actions = h.steps(vectors(folder, frames(2 * STEPS + 1, seed=4)))
    wait_for(lambda: len(chunks) == 3, what='three chunks')
    time.sleep(0.2)
    assert len(chunks) == 3                       # once per chunk, not per step
    for k, traj in enumerate(chunks):
        assert list(traj.joint_names) == names
        assert acceptance.jtc_refusal(traj, names, now=10 ** 18) is None
        assert [p.time_from_start.sec * 10 ** 9 + p.time_from_start.nanosec
                for p in traj.points] == [50_000_000 * (i + 1) for i in range(STEPS)]
        points = [[float(v) for v in p.positions] for p in traj.points]
        assert points[:len(actions[k * STEPS:])] == \
            [[float(v) for v in a] for a in actions[k * STEPS:(k + 1) * STEPS]]


def test_after_a_restore_mid_chunk_the_rest_of_its_chunk_goes_out_again(make, folder):
    """A restore mid-chunk replaces the chunk the controller plays: the step after it sends
    the restored state's rest (its actions from that step on), once, or the controller would
    play the abandoned branch's trajectory until the next chunk."""
    import time

    from support.common import wait_for
    h, names, chunks = _chunk_node(make, folder)
    obs = vectors(folder, frames(2 * STEPS, seed=5))
    first = h.steps(obs[:3])                # the first chunk goes out at step 0
    assert h.call('snapshot', name='mid').success
    later = h.steps(obs[3:])                # the second at step STEPS
    wait_for(lambda: len(chunks) == 2, what='two chunks')
    assert h.call('restore', name='mid').success
    assert h.steps(obs[3:4]) == later[:1]
    wait_for(lambda: len(chunks) == 3, what="the restored state's chunk")
    rest = chunks[2]
    assert [[float(v) for v in p.positions] for p in rest.points] == \
        [[float(v) for v in a] for a in (first + later)[3:STEPS]]
    assert list(rest.joint_names) == names and [
        p.time_from_start.sec * 10 ** 9 + p.time_from_start.nanosec for p in rest.points] == \
        [50_000_000 * (i + 1) for i in range(STEPS - 3)]
    assert h.steps(obs[4:5]) == later[1:2]
    time.sleep(0.2)
    assert len(chunks) == 3                 # once after the restore, not every step
    # a restore of the chunk alone (kinds [chunk]) replaces it too: its rest goes out again
    assert h.call('restore', name='mid', kinds=['chunk']).success
    assert h.steps(obs[5:6]) == later[:1]
    wait_for(lambda: len(chunks) == 4, what='the chunk restored alone')
    assert [[float(v) for v in p.positions] for p in chunks[3].points] == \
        [[float(v) for v in a] for a in (first + later)[3:STEPS]]


def test_real_time_chunking_on_the_node(make, folder):
    """rtc_* parameters: the node's actions are the engine's with real-time chunking (itself
    LeRobot's RTC loop bit for bit: test_lerobot_rtc.py), a capsule taken while a chunk is in
    flight replays over ROS, and each landed chunk goes out as a trajectory of the actions
    from that step on; settings that cannot work are refused at configure."""
    from support.common import wait_for
    h, _, chunks = _chunk_node(make, folder, rtc_delay=2, rtc_queue_threshold=3,
                               rtc_execution_horizon=4)
    obs = vectors(folder, frames(14, seed=6))
    first = h.steps(obs[:6])            # the second chunk launched at step 5, in flight
    assert h.call('snapshot', name='flight').success
    later = h.steps(obs[6:])
    assert first + later == h.reference(obs)
    assert h.call('restore', name='flight').success
    assert h.steps(obs[6:]) == later
    # landings at steps 0, 7 and 12 (chunk 8: launched with 3 left, 2 steps later), twice
    # for 7 and 12 (the replay), after the restored state's rest at 6 (what its queue holds
    # from step 6 on: actions 6 and 7 of the first chunk); each: the actions from its step
    # on, chunk_period apart
    wait_for(lambda: len(chunks) == 6, what='six chunks')
    actions = first + later
    for traj, (t, until) in zip(chunks, ((0, 7), (7, 12), (12, 14), (6, 7), (7, 12),
                                         (12, 14))):
        points = [[float(v) for v in p.positions] for p in traj.points]
        # the delay's actions dropped; the restored rest: two
        assert len(points) == {0: 8, 6: 2}.get(t, 8 - 2)
        # what the node then published, until the next chunk landed and replaced the rest
        assert points[:until - t] == [[float(v) for v in a] for a in actions[t:until]]
    bad = make(_params(folder, rtc_delay=4, rtc_queue_threshold=4), start=False)
    assert not bad.client.change_state('configure')
    assert bad.node.parts is None


def test_an_act_checkpoint_on_the_node(make, tmp_path_factory):
    """policy_type act: a LeRobot ACT checkpoint folder (state and cameras, no instruction);
    the node's actions are the engine's, and its chunks go out on ~/action_chunk."""
    import numpy as np
    from trajectory_msgs.msg import JointTrajectory

    from flashrt_ros.runtime.policies.lerobot_demo import act_checkpoint
    from support.common import wait_for
    from support.smolvla import CAMERAS, STATE_DIM
    folder = act_checkpoint(tmp_path_factory.mktemp('act'))
    dim = STATE_DIM + sum(c * h * w for c, h, w in CAMERAS.values())
    names = [f'arm_{i}' for i in range(ACT_DIM)]
    h = make(dict(policy_type='act', policy_file=folder, obs_dim=dim, act_dim=ACT_DIM,
                  action_joint_names=names, chunk_period=0.05))
    chunks = []
    sub = h.client_node.create_subscription(
        JointTrajectory, f'/{h.name}/action_chunk', chunks.append, 10)
    wait_for(lambda: sub.get_publisher_count() > 0, what='the chunk topic')
    rng = np.random.default_rng(6)
    obs = [np.concatenate([rng.standard_normal(STATE_DIM), rng.random(dim - STATE_DIM)]
                          ).astype(np.float32) for _ in range(STEPS + 1)]
    actions = h.steps(obs)
    assert actions == h.reference(obs)
    wait_for(lambda: len(chunks) == 2, what='two chunks')
    assert [list(p.positions) for p in chunks[0].points] == actions[:STEPS]
    # an ensembling checkpoint computes no chunk to send: without cameras nothing else takes
    # action_joint_names, so they are refused, not a silent topic (on cameras they give the
    # commands: test_an_ensembling_act_on_cameras_sends_commands_and_no_chunk)
    ensembles = act_checkpoint(tmp_path_factory.mktemp('act_te'), temporal_ensemble_coeff=0.01,
                               n_action_steps=1)
    bad = make(dict(policy_type='act', policy_file=ensembles, obs_dim=dim, act_dim=ACT_DIM,
                    action_joint_names=names), start=False)
    assert not bad.client.change_state('configure') and bad.node.parts is None
    # on cameras, an instruction set while running reaches no policy (ACT takes none):
    # refused as configure refuses it, not reported as set
    from rclpy.parameter import Parameter
    cams = make(dict(policy_type='act', policy_file=folder, obs_dim=dim, act_dim=ACT_DIM,
                     observation_type='cameras', joint_names=[f'j{i}' for i in range(STATE_DIM)],
                     camera_topics=[f'{k}=/act_cam{i}' for i, k in enumerate(CAMERAS)]))
    assert cams.node.parts is not None
    result = cams.node.set_parameters([Parameter('instruction', value='pick')])[0]
    assert not result.successful and 'act node' in result.reason, result.reason
    assert cams.node.get_parameter('instruction').value == ''


def test_an_ensembling_act_on_cameras_sends_commands_and_no_chunk(make, tmp_path_factory):
    """ACT with temporal ensembling on cameras (ALOHA's setting: a chunk every step, each
    action an average): action_joint_names give ~/action and ~/joint_commands in ROS units
    (joint_scale), the engine's ensembled actions; no ~/action_chunk exists (no one chunk
    holds the actions sent), and chunk_period, which would space its points, is refused.
    Lock-step: after a restore, a world re-sending the readings the restored state answered
    last gets that step's command again (the state keeps the action it sent), no step."""
    import numpy as np
    from builtin_interfaces.msg import Time
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray, Header
    import torch

    from flashrt_ros.runtime.policies.lerobot_demo import act_checkpoint
    from support.common import wait_for
    from support.smolvla import CAMERAS, STATE_DIM
    folder = act_checkpoint(tmp_path_factory.mktemp('act_te'), temporal_ensemble_coeff=0.01,
                            n_action_steps=1)
    dim = STATE_DIM + sum(c * h * w for c, h, w in CAMERAS.values())
    joints, scale = [f'j{i}' for i in range(STATE_DIM)], [2.0] * STATE_DIM
    topics = {k: f'/te{i}_{k.split(".")[-1]}' for i, k in enumerate(CAMERAS)}
    act = dict(policy_type='act', obs_dim=dim, joint_names=joints, joint_scale=scale,
               action_joint_names=joints[:ACT_DIM])
    h, robot, cams, js, _ = _camera_node(make, folder, topics, **act)
    commands = []
    sub = h.client_node.create_subscription(Float64MultiArray, f'/{h.name}/joint_commands',
                                            commands.append, 10)
    wait_for(lambda: sub.get_publisher_count() > 0, what='~/joint_commands')
    assert h.client_node.count_publishers(f'/{h.name}/action_chunk') == 0
    try:
        readings, rng, frames = h.node.parts.loop.cameras[0], np.random.default_rng(5), []
        for t in range(4):      # past the first chunk: the averages in play
            floats = _send_frames(rng, cams, readings, t)
            position = rng.uniform(-1, 1, STATE_DIM)
            js.publish(JointState(name=joints, header=Header(stamp=Time(sec=t + 1)),
                                  position=[float(v) for v in position]))
            h.client.wait_actions(t + 1)
            if t == 2:
                assert h.call('snapshot', name='third').success
                third = position
            state = torch.from_numpy((position * scale).astype(np.float32))
            frames.append(np.concatenate([state.numpy(), *[floats[k].numpy().ravel()
                                                           for k in CAMERAS]]))
        want = np.array(h.reference(frames, dict(action_joint_names=[])), np.float64) / 2.0
        assert np.array_equal(np.array(h.client.wait_actions(4)), want.astype(np.float32))
        wait_for(lambda: len(commands) == 4, what='the commands')
        assert np.array_equal([list(c.data) for c in commands], want)
        assert h.call('restore', name='third').success
        js.publish(JointState(name=joints, header=Header(stamp=Time(sec=3)),
                              position=[float(v) for v in third]))
        wait_for(lambda: len(commands) == 5, what='the command again')
        assert list(commands[-1].data) == list(want[2])
        assert h.client.actions_received() == 5     # ~/action again, no step
    finally:
        robot.destroy_node()
    bad = make(_params(folder, observation_type='cameras', camera_topics=[
        f'{k}={t}' for k, t in topics.items()], chunk_period=0.05, **act), start=False)
    assert not bad.client.change_state('configure') and bad.node.parts is None


def test_a_diffusion_checkpoint_on_the_node(make, tmp_path_factory):
    """policy_type diffusion: a LeRobot Diffusion Policy checkpoint folder (its observation
    history and its noise's rng are state); the node's actions are the engine's, and a
    capsule taken mid-chunk through the node's services replays them across the next chunk."""
    import numpy as np

    from flashrt_ros.runtime.policies.lerobot_demo import DIFFUSION_SIZES, diffusion_checkpoint
    from support.smolvla import STATE_DIM
    folder = diffusion_checkpoint(tmp_path_factory.mktemp('diffusion'))
    dim = STATE_DIM + sum(c * h * w for c, h, w in DIFFUSION_SIZES['demo']['cameras'].values())
    h = make(dict(policy_type='diffusion', policy_file=folder, obs_dim=dim, act_dim=ACT_DIM,
                  seed=3))
    rng, steps = np.random.default_rng(8), DIFFUSION_SIZES['demo']['config']['n_action_steps']
    obs = [np.concatenate([rng.standard_normal(STATE_DIM), rng.random(dim - STATE_DIM)]
                          ).astype(np.float32) for _ in range(3 * steps)]
    first = h.steps(obs[:steps + 2])
    assert h.call('snapshot', name='mid').success
    later = h.steps(obs[steps + 2:])
    assert first + later == h.reference(obs)
    assert h.call('restore', name='mid').success
    assert h.steps(obs[steps + 2:]) == later


@pytest.mark.parametrize('kind', ['pi0', 'pi05'])
def test_pi0_and_pi05_on_cameras(make, tmp_path_factory, kind):
    """policy_type pi0 / pi05 (LeRobot >= 0.6, Python >= 3.12), observation_type cameras: a
    camera, joint states and the instruction, Pi0.5's tokens made anew from every joint state
    (its prompt holds the state); the node's actions are the engine's on the same frames
    packed by checkpoint_inputs, a capsule mid-chunk replays, and a restart given back the
    first chunk's prefix (kind kv) skips its prefix pass with the same actions."""
    from importlib.metadata import version
    if tuple(int(p) for p in version('lerobot').split('.')[:2]) < (0, 6):
        pytest.skip(f'Pi0 needs LeRobot >= 0.6 (Python >= 3.12; this has {version("lerobot")}): '
                    'bash tools/test_lerobot06.sh')
    import numpy as np
    import rclpy
    from builtin_interfaces.msg import Time
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import Header
    import torch

    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_inputs, \
        checkpoint_sizes
    from support.common import publish_until, wait_for
    from support.pi0 import CAMERA, checkpoint, IMAGE, small_sizes, STATE_DIM
    from support.pi0 import STEPS as PI_STEPS
    folder = checkpoint(tmp_path_factory.mktemp(kind), kind=kind)
    policy_type, obs_dim, act_dim = checkpoint_sizes(folder)
    _, _, tokenize = checkpoint_inputs(folder)
    joints = [f'j{i}' for i in range(STATE_DIM)]
    with small_sizes():     # the node builds LeRobot's model at the test's sizes
        # (LeRobot's from_pretrained of it takes about 30 s on a 2-core VM: configure's time)
        h = make(dict(policy_type=policy_type, policy_file=folder, obs_dim=obs_dim,
                      act_dim=act_dim, seed=3, observation_type='cameras',
                      camera_topics=[f'{CAMERA}=/cam'], joint_names=joints,
                      instruction='pick up the red cube'), timeout=180.0)
        node = rclpy.create_node(h.name + '_robot')
        try:
            cam = node.create_publisher(Image, '/cam', 10)
            js = node.create_publisher(JointState, '/joint_states', 10)
            wait_for(lambda: cam.get_subscription_count() and js.get_subscription_count(),
                     what='the camera and joint state topics to match')
            observation = h.node.parts.loop.cameras[0].observation
            frame, stamps = observation.image(CAMERA), iter(range(1, 10 ** 6))

            def drive(readings):
                """A step per (image, state): the frame, then a joint state of a new stamp.
                (The frame has come when it is in place and fresh: after a restore the
                buffer may hold the same image, forgotten until the camera sends it again.)"""
                for image, state in readings:
                    pixels = torch.from_numpy(as_floats(image))
                    publish_until(lambda: cam.publish(_image_msgs(image, 'top', 0)),
                                  lambda: torch.equal(frame, pixels) and CAMERA in
                                  observation.has, what='the frame to reach the node')
                    count = h.client.actions_received()
                    js.publish(JointState(header=Header(stamp=Time(sec=next(stamps))),
                                          name=joints, position=[float(s) for s in state]))
                    seen = h.client.wait_actions(count + 1)
                return seen[-len(readings):]
            rng = np.random.default_rng(7)
            readings = [(rng.integers(0, 256, (IMAGE[1], IMAGE[2], 3), dtype=np.uint8),
                         rng.standard_normal(STATE_DIM).astype(np.float32))
                        for _ in range(2 * PI_STEPS + 1)]
            packed = [np.concatenate([state, image.transpose(2, 0, 1).ravel().astype(
                np.float32) / np.float32(255), *tokenize('pick up the red cube', state)])
                for image, state in readings]
            assert drive(readings) == h.reference(packed)
            # the capsule services: mid-chunk, and a restart given back the prefix
            assert h.call('snapshot', name='mid').success
            later = drive(readings[:PI_STEPS + 1])
            for _ in range(2):
                assert h.call('restore', name='mid').success
                assert drive(readings[:PI_STEPS + 1]) == later
            policy = h.node.parts.engine.policy
            assert h.call('restore', name='episode_start').success
            first = drive(readings[:1])
            assert h.call('snapshot', name='first').success
            reused = policy.prefix_reused
            assert h.call('restore', name='episode_start').success
            assert h.call('restore', name='first', kinds=['kv']).success
            assert drive(readings[:1]) == first and policy.prefix_reused == reused + 1
            assert h.node.report.rejected == 0
        finally:
            node.destroy_node()
        # vision_dtype bfloat16 on this float32 checkpoint: refused at configure
        bad = make(dict(policy_type=policy_type, policy_file=folder, obs_dim=obs_dim,
                        act_dim=act_dim, vision_dtype='bfloat16'), start=False, timeout=180.0)
        assert not bad.client.change_state('configure')
        assert bad.node.parts is None
