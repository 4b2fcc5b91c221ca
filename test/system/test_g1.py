"""A Unitree G1 walks in MuJoCo through the policy node: node and world in separate processes,
over ROS (Fast DDS), with the real upstream model and pretrained policy (../shared/robots).

Also on the G1: the episode runner's what-if branches from a world + policy snapshot at 10 s,
and the node killed with SIGKILL mid-walk, restarted with restore_on_start: latest.
"""
from functools import partial
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy', reason='needs rclpy (ROS 2 Jazzy): run tools/test.sh')
import torch  # noqa: E402
from geometry_msgs.msg import PoseStamped  # noqa: E402
from lifecycle_msgs.msg import Transition  # noqa: E402
from lifecycle_msgs.srv import ChangeState, GetState  # noqa: E402
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402
from sensor_msgs.msg import Imu, JointState  # noqa: E402
from std_msgs.msg import Float32MultiArray, Float64MultiArray  # noqa: E402

from flashrt_ros.client import spin_in_thread  # noqa: E402
from flashrt_ros.harness.episode_runner import declare_parameters, run_episodes  # noqa: E402
from flashrt_ros.runtime.recovery import checkpoint_sequence  # noqa: E402
from support.robots import G1 as ROBOT, G1_YAML, NEEDS_G1  # noqa: E402
from support.ros_tools import installed_executable  # noqa: E402

pytestmark = NEEDS_G1
# deploy_mujoco.py: default_angles = np.array(config['default_angles'], dtype=np.float32)
DEFAULT = np.array([-0.1, 0.0, 0.0, 0.3, -0.2, 0.0, -0.1, 0.0, 0.0, 0.3, -0.2, 0.0],
                   dtype=np.float32)
STEPS_20S = 1000        # policy steps in 20 s at 50 Hz
FIRST_STAMP = 20_000_000    # ns: the world's first readings, after one period at the defaults


def _start(name, args, log, params_file=G1_YAML):
    files = ['--params-file', str(params_file)] if params_file else []
    cmd = [installed_executable(name), '--ros-args', *files, *args]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _policy_args(tmp_path, *extra):
    return ['-p', f'policy_file:={ROBOT / "motion.pt"}', '-p', 'device:=cpu',
            '-p', f'capsule_dir:={tmp_path / "capsules"}', *extra]


def _wait(condition, seconds, procs, what):
    """Polls condition() until true; raises (never an AssertionError) on timeout or when one
    of procs exited, so that an xfail(raises=AssertionError) never hides a broken set-up."""
    deadline = time.monotonic() + seconds
    while not condition():
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f'a node exited while waiting for {what}; see the logs')
        if time.monotonic() > deadline:
            raise TimeoutError(f'{what}: not within {seconds} s; see the logs')
        time.sleep(0.02)


def reference_observation(k, joint_state, imu, last_action):
    """The G1 policy's observation, written out from unitree_rl_gym's deploy loop with its
    dtypes (float32 default angles, command and cmd_scale) and its phase (counter of 0.002 s
    simulation steps, 10 per policy step; np.sin / np.cos)."""
    names, q, dq = joint_state
    (x, y, z, w), omega = imu
    gravity = [2 * (-z * x + w * y), -2 * (z * y + w * x), 1 - 2 * (w * w + z * z)]
    count = ((k + 1) * 10) * 0.002
    phase = count % 0.8 / 0.8
    obs = np.zeros(47, dtype=np.float32)
    obs[0:3] = np.asarray(omega) * 0.25
    obs[3:6] = gravity
    obs[6:9] = np.array([0.5, 0.0, 0.0], np.float32) * np.array([2.0, 2.0, 0.25], np.float32)
    obs[9:21] = (np.asarray(q) - DEFAULT) * 1.0
    obs[21:33] = np.asarray(dq) * 0.05
    obs[33:45] = last_action
    obs[45:47] = [np.sin(2 * np.pi * phase), np.cos(2 * np.pi * phase)]
    return obs


def reference_actions(readings):
    """motion.pt run directly (no_grad), without a break, on the world's readings in order:
    the uninterrupted policy's actions."""
    reference = torch.jit.load(str(ROBOT / 'motion.pt'))
    last, out = np.zeros(12, dtype=np.float32), []
    for k, (joint_state, imu) in enumerate(readings):
        obs = reference_observation(k, joint_state, imu, last)
        with torch.no_grad():
            last = reference(torch.from_numpy(obs).unsqueeze(0)).numpy().reshape(-1)
        out.append(last)
    return out


def _stamp(msg):
    return msg.header.stamp.sec * 10 ** 9 + msg.header.stamp.nanosec


class Hub:
    """This test's node on the G1's topics. Records the world's readings and base poses by
    stamp (the world re-sends unanswered readings with the same stamp: the first copy is kept)
    and the node's raw actions in order. With relay=True it also stands between world and
    node: readings go on to the node (/g1_relay/joint_states, /g1_relay/imu) only while
    `open`; the node's commands (/g1_relay/joint_commands) wait in `inbox` until the test
    forwards them to the world (`forward`), so the test decides what the world receives and
    when the node may step."""

    def __init__(self, relay=False):
        self.node = rclpy.create_node('g1_test_hub')
        qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=5000,
                         reliability=ReliabilityPolicy.RELIABLE)
        self.joints, self.imus, self.poses, self.actions, self.inbox = {}, {}, {}, [], []
        self.open, self.taken, self.cond = False, 0, threading.Condition()
        self.out = {}
        if relay:
            self.out = {JointState: self.node.create_publisher(
                JointState, '/g1_relay/joint_states', qos), Imu: self.node.create_publisher(
                Imu, '/g1_relay/imu', qos)}
            self.commands_in = self.node.create_subscription(
                Float64MultiArray, '/g1_relay/joint_commands', self._command, qos)
            self.commands_out = self.node.create_publisher(
                Float64MultiArray, '/flashrt_sim/joint_commands', qos)

        def sub(msg_type, topic, store, value):
            self.node.create_subscription(msg_type, f'/flashrt_sim/{topic}',
                                          partial(self._reading, store, value), qos)
        sub(JointState, 'joint_states', self.joints, lambda m: (
            list(m.name), np.array(m.position), np.array(m.velocity)))
        sub(Imu, 'imu', self.imus, lambda m: (
            (m.orientation.x, m.orientation.y, m.orientation.z, m.orientation.w),
            (m.angular_velocity.x, m.angular_velocity.y, m.angular_velocity.z)))
        sub(PoseStamped, 'base_pose', self.poses, lambda m: (
            m.pose.position.x, m.pose.position.y, m.pose.position.z))
        self.action_sub = self.node.create_subscription(
            Float32MultiArray, '/flashrt_policy/action',
            lambda m: self.actions.append(np.array(m.data, dtype=np.float32)), qos)
        self.executor = spin_in_thread(self.node)

    def _reading(self, store, value, msg):
        store.setdefault(_stamp(msg), value(msg))
        if self.open and type(msg) in self.out:
            self.out[type(msg)].publish(msg)

    def _command(self, msg):
        with self.cond:
            self.inbox.append(msg)
            self.cond.notify_all()

    def next_command(self, procs, seconds=60.0):
        """The node's next command, in order of arrival."""
        _wait(lambda: len(self.inbox) > self.taken, seconds, procs, 'the next joint command')
        self.taken += 1
        return self.inbox[self.taken - 1]

    def forward(self, command):
        self.commands_out.publish(command)

    def relay_endpoints(self):
        """{relay topic: GIDs of the other nodes' endpoints on it} (command publishers, reading
        subscriptions). The graph keeps a SIGKILLed node's until its lease runs out (and the
        match counts count them), so a restarted node is told apart by new GIDs."""
        node = self.node
        return {topic: {tuple(i.endpoint_gid) for i in get(topic)} for topic, get in (
            ('/g1_relay/joint_commands', node.get_publishers_info_by_topic),
            ('/g1_relay/joint_states', node.get_subscriptions_info_by_topic),
            ('/g1_relay/imu', node.get_subscriptions_info_by_topic))}

    def open_when_matched(self, procs, before):
        """Lets readings through once the new policy node's endpoints (GIDs not in `before`)
        are in this hub's graph on all three relay topics, then a moment for the node's side
        of the matching. Its first command can still go out before its publisher matched this
        hub's subscription: it then reached nobody, and the node sends it again on the
        world's next re-send of those readings (control_loop.py)."""
        _wait(lambda: all(gids - before[topic] for topic, gids in
                          self.relay_endpoints().items()), 120, procs,
              'the policy node matched to the relay')
        # A margin, not a wait on something this process could see: the node's own view of
        # the match happens in its process and no graph query here reports it.
        time.sleep(0.5)
        self.open = True

    def readings(self, n):
        """The world's first n readings (joint state, IMU), in stamp order."""
        stamps = sorted(self.joints)[:n]
        return [(self.joints[s], self.imus[s]) for s in stamps]

    def walked(self, n):
        """(forward distance, lowest pelvis height) over the world's first n readings."""
        xyz = np.array([self.poses[s] for s in sorted(self.poses)[:n]])
        return xyz[-1, 0] - xyz[0, 0], xyz[:, 2].min()

    def close(self):
        self.executor.shutdown()
        self.node.destroy_node()


def _stop(*procs):
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


_TARGET = {Transition.TRANSITION_CONFIGURE: ('unconfigured', 'inactive'),
           Transition.TRANSITION_ACTIVATE: ('inactive', 'active')}


def _state(node, procs):
    """The policy node's lifecycle state label (~/get_state), or None when no answer came."""
    client = node.create_client(GetState, '/flashrt_policy/get_state')
    try:
        _wait(client.service_is_ready, 30, procs, 'the policy node\'s get_state')
        future = client.call_async(GetState.Request())
        _wait(future.done, 10, procs, 'get_state')
        return future.result().current_state.label
    except TimeoutError:
        return None
    finally:
        node.destroy_client(client)


def _transition(node, transition_id, procs):
    """A lifecycle transition of the policy node (started with autostart:=false).

    The server being in the graph does not mean it has matched this client yet: a request
    sent before that reaches nobody (seen in clean-clone CI runs: the node never configured,
    nothing in its log). So when no answer comes in 15 s, the node's state says whether the
    transition ran, and the request is sent again only if it did not."""
    before, after = _TARGET[transition_id]
    client = node.create_client(ChangeState, '/flashrt_policy/change_state')
    _wait(client.service_is_ready, 120, procs, 'the policy node up (see nodes.log)')
    deadline = time.monotonic() + 120
    while True:
        future = client.call_async(ChangeState.Request(transition=Transition(id=transition_id)))
        try:
            _wait(future.done, 15, procs, f'lifecycle transition {transition_id}')
        except TimeoutError:
            state = _state(node, procs)
            while (state not in (before, after) or time.monotonic() > deadline) and \
                    not future.done():
                # in the middle of the transition, or no answer yet: neither resend nor give up
                if time.monotonic() > deadline:
                    raise TimeoutError(f'lifecycle transition {transition_id}: not within '
                                       f'120 s (state {state!r}); see the logs') from None
                state = _state(node, procs)
            if not future.done():
                if state == after:
                    return          # it ran; its answer was what got lost
                continue            # it did not run: the request got lost; send it again
        assert future.result().success, f'lifecycle transition {transition_id} failed'
        return


@pytest.mark.slow
def test_g1_walks_through_the_node_bit_for_bit(tmp_path):
    log = open(tmp_path / 'nodes.log', 'w')
    # The world re-sends unanswered readings; the walk starts when this test activates the
    # node, once this test listens to everything and the node's command publisher has been
    # out for a while (a command the world missed would stop the lock-step loop for good).
    sim = _start('sim_node', ['-p', f'mjcf_path:={ROBOT / "scene.xml"}',
                              '-p', 'republish_period:=0.2', '-r', '__node:=flashrt_sim'], log)
    policy = _start('policy_node', _policy_args(
        tmp_path, '-p', 'autostart:=false', '-r', 'joint_states:=/flashrt_sim/joint_states',
        '-r', 'imu:=/flashrt_sim/imu', '-r', '~/joint_commands:=/flashrt_sim/joint_commands'),
        log)
    rclpy.init()
    hub = Hub()
    procs = (sim, policy)
    try:
        _transition(hub.node, Transition.TRANSITION_CONFIGURE, procs)
        _wait(lambda: FIRST_STAMP in hub.joints and FIRST_STAMP in hub.imus and FIRST_STAMP in
              hub.poses and hub.action_sub.get_publisher_count() >= 1, 120, procs,
              'the world and the policy node matched (see nodes.log)')
        # A margin for what this process cannot see: the world's subscription matched by the
        # node's command publisher (both endpoints in other processes).
        time.sleep(1.0)
        _transition(hub.node, Transition.TRANSITION_ACTIVATE, procs)
        # 20 s: the readings at 20.00 s and the policy's answer to them
        _wait(lambda: len(hub.actions) >= STEPS_20S, 240, procs,
              f'the walk reaching 20 s ({len(hub.poses)} readings so far)')
        policy.send_signal(signal.SIGINT)       # the lock-step loop stops with the policy
        policy.wait(timeout=30)
        # the world's readings and poses of every action the node published (two paths: the
        # world's topics and the node's)
        _wait(lambda: min(len(hub.joints), len(hub.imus), len(hub.poses)) >= len(hub.actions),
              30, (sim,), 'the readings of every action')
    finally:
        _stop(sim, policy)
        hub.close()
        rclpy.try_shutdown()
    stamps = sorted(hub.joints)
    distance, low = hub.walked(STEPS_20S)
    print(f'G1 through the node: {len(hub.actions)} policy steps, {stamps[-1] / 1e9:.2f} s, '
          f'{distance:.3f} m forward, pelvis min {low:.4f} m')
    if os.environ.get('FLASHRT_G1_LOG'):     # for scripts/plot_walk.py --log (README picture)
        with open(os.environ['FLASHRT_G1_LOG'], 'w') as f:
            f.write('time,x,y,z\n')
            f.writelines(f'{s / 1e9},{x},{y},{z}\n' for s, (x, y, z) in sorted(hub.poses.items()))
    assert low > 0.5 and distance >= 8.0
    # every published action equals motion.pt run directly on the world's readings
    expected = reference_actions(hub.readings(len(hub.actions)))
    assert len(expected) == len(hub.actions)
    for k, (action, want) in enumerate(zip(hub.actions, expected)):
        assert np.array_equal(action, want), \
            f'step {k}: max abs diff {np.abs(action - want).max()}'


def _run_g1_episodes(tmp_path, policy_args, runner_args, sim_args=None, bundle=False):
    """The episode runner (config/g1.yaml + runner_args: its world in this process, or a
    flashrt_sim node in its own process with sim_args) against a policy node in its own
    process (+ policy_args; bundle: configured from the G1 folder as a policy bundle, without
    config/g1.yaml); asserts every check held and returns (runner, its parameters, its log
    lines)."""
    log = open(tmp_path / 'policy.log', 'w')
    if bundle:
        policy = _start('policy_node', ['-p', f'policy_bundle:={ROBOT}', '-p', 'device:=cpu',
                                        '-p', f'capsule_dir:={tmp_path / "capsules"}',
                                        *policy_args], log, params_file=None)
    else:
        policy = _start('policy_node', _policy_args(tmp_path, *policy_args), log)
    sim = None if sim_args is None else _start('sim_node', [
        '-p', f'mjcf_path:={ROBOT / "scene.xml"}', '-r', '__node:=flashrt_sim', *sim_args], log)
    rclpy.init(args=['--ros-args', '--params-file', str(G1_YAML),
                     '-p', f'mjcf_path:={ROBOT / "scene.xml"}', '-p', 'timeout:=60.0',
                     *runner_args])
    node = rclpy.create_node('flashrt_episode_runner')
    params = declare_parameters(node)
    executor = spin_in_thread(node)
    lines = []
    try:
        runner, ok = run_episodes(node, params, log=lines.append)
    finally:
        _stop(policy, *([sim] if sim else []))
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    print('\n'.join(lines))
    assert ok, [c for c in runner.checks if not c[1]]
    return runner, params, lines


def test_g1_episode_runner_what_ifs_from_10_s(tmp_path):
    """The episode runner (config/g1.yaml: its world in this process, the policy node in its
    own) snapshots world + policy after 10 s of walking, runs 3 branches pushed sideways by
    -0.5, 0 and +0.5 m/s, replays each bit for bit, and an episode reset walks the first 10 s
    again bit for bit."""
    runner, params, lines = _run_g1_episodes(tmp_path, [], [])
    assert len(runner.checks) == 5      # 3 replays, independence, episode reset
    assert params['branch_at'] == 500 and params['branches'] == 3
    assert 'snapshot of world and policy at step 500 (world time 10.02 s)' in lines
    finals = [r[3] for r in runner.results]         # obs = qpos, qvel: base x, y, z first
    assert all(f[2] > 0.5 for f in finals), [f[2] for f in finals]     # still walking
    assert finals[0][1] < finals[1][1] < finals[2][1], [f[1] for f in finals]  # pushed aside
    assert len(runner.reset_us) == params['resets']


def test_g1_runner_through_simulation_interfaces_equals_the_in_process_world(tmp_path):
    """The episode runner drives a flashrt_sim G1 in its own process through the ROS standard
    simulation_interfaces only (pause, reset, the SimulateSteps action, GetEntityState /
    SetEntityState for the push) plus world capsules, in paused lock-step with a policy node in
    a third process: every branch's actions equal the in-process world's run bit for bit, and
    its own replays and episode reset hold."""
    pytest.importorskip('simulation_interfaces', reason='simulation_interfaces is not built: '
                        'it comes from ../shared/ros-src (tools/bootstrap.sh builds it there)')
    common = ['-p', 'steps:=160', '-p', 'branch_at:=100', '-p', 'resets:=2']
    local, _, _ = _run_g1_episodes(tmp_path, [], common)
    remote, _, lines = _run_g1_episodes(
        tmp_path, ['-r', 'joint_states:=/flashrt_sim/joint_states',
                   '-r', 'imu:=/flashrt_sim/imu',
                   '-r', '~/joint_commands:=/flashrt_sim/joint_commands'],
        common + ['-p', 'world:=simulator', '-p', 'push_entity:=pelvis'],
        sim_args=['-p', 'lockstep:=steps'])
    assert 'simulator at /flashrt_sim: world capsules (exact branches)' in lines
    assert len(remote.checks) == len(local.checks) == 5
    for k, (here, there) in enumerate(zip(local.results, remote.results)):
        assert len(there[0]) == 60 and there[0] == here[0], f'branch {k}: actions differ'
        assert np.allclose(there[3], here[3][:2], atol=0, rtol=0), f'branch {k}: final x, y'


def test_g1_policy_bundle_walks_as_the_hand_written_config(tmp_path):
    """The unitree_rl_gym G1 folder as a policy bundle (policy_bundle:=<folder>, no
    observation parameters at all) gives the hand-written config/g1.yaml node's walk and
    what-ifs, bit for bit; the node logs what it derived."""
    common = ['-p', 'steps:=160', '-p', 'branch_at:=100', '-p', 'resets:=2']
    written, _, _ = _run_g1_episodes(tmp_path, [], common)
    derived, _, _ = _run_g1_episodes(tmp_path, [], common, bundle=True)
    log = (tmp_path / 'policy.log').read_text()
    assert 'policy bundle (unitree_rl_gym)' in log and 'observation.phase.dt = 0.002' in log
    for k, (here, there) in enumerate(zip(written.results, derived.results)):
        assert len(there[0]) == 60 and there[0] == here[0], f'branch {k}: actions differ'


@pytest.mark.slow
def test_g1_fleet_three_robots_branch_in_parallel_bit_for_bit(tmp_path):
    """One policy node with three sessions (three G1s): the runner walks robot s0 for 5 s,
    snapshots world + policy, runs three pushed branches one after another on s0, then all
    three at once on s0, s1 and s2 (three MuJoCo worlds, one lock-step tick of the node per
    step). Each parallel branch equals its sequential run bit for bit, actions and states."""
    runner, _, lines = _run_g1_episodes(
        tmp_path, ['-p', 'sessions:=3'],
        ['-p', 'steps:=300', '-p', 'branch_at:=250', '-p', 'resets:=2', '-p', 'session:=s0',
         '-p', 'parallel:=s0,s1,s2'])
    parallel = [c for c in runner.checks if 'in parallel' in c[0]]
    assert len(parallel) == 3 and 'the 3 branches in parallel on 3 sessions of 1 node:' in lines
    finals = [r[3] for r in runner.results]
    assert finals[0][1] < finals[1][1] < finals[2][1], [f[1] for f in finals]


def walk_with_kills(tmp_path, steps, kills):
    """The G1 walks `steps` policy steps, node and world in their own processes, this test's
    Hub relaying readings and commands; the world re-sends unanswered readings every 0.2 s.
    The node checkpoints every step to disk and starts with restore_on_start: latest. When
    the command answering the world's readings j arrives, j in kills, the node gets SIGKILL
    once its checkpoint j + 1 (the state after answering j) is on disk (it waits idle: its
    command is in the relay) and restarts:
      'after'   the command goes on to the world (the kill landed after it left the node);
      'before'  the command is dropped and checkpoint j deleted (the kill landed before
                checkpoint j was written: the world waits at readings j, the newest
                checkpoint is j - 1);
      'between' the command is dropped, checkpoint j kept (the kill landed after the
                checkpoint was written, before the command reached the world).
    Returns (hub, the commands the world received in order, each node process's log)."""
    capsules, kills = tmp_path / 'capsules', dict(kills)
    sim = _start('sim_node', ['-p', f'mjcf_path:={ROBOT / "scene.xml"}',
                              '-p', 'republish_period:=0.2', '-r', '__node:=flashrt_sim'],
                 open(tmp_path / 'world.log', 'w'))
    args = _policy_args(tmp_path, '-p', 'checkpoint_every:=1', '-p', 'checkpoint_to_disk:=true',
                        '-p', 'restore_on_start:=latest',
                        '-r', 'joint_states:=/g1_relay/joint_states',
                        '-r', 'imu:=/g1_relay/imu',
                        '-r', '~/joint_commands:=/g1_relay/joint_commands')
    logs, procs = [], [sim]

    def start_policy():
        logs.append(tmp_path / f'policy{len(logs)}.log')
        before = hub.relay_endpoints()
        procs.append(_start('policy_node', args, open(logs[-1], 'w')))
        hub.open_when_matched(procs[-1:], before)

    rclpy.init()
    hub = Hub(relay=True)
    world_got = []
    try:
        _wait(lambda: FIRST_STAMP in hub.joints and FIRST_STAMP in hub.imus and
              hub.commands_out.get_subscription_count() >= 1, 120, procs, 'the world up')
        start_policy()
        while len(world_got) < steps:
            command = hub.next_command(procs[-1:])
            j = len(world_got)
            how = kills.pop(j, None)
            if how is not None:     # the node writes checkpoint j + 1 (its state after
                # answering readings j) after it published the command: the kill waits for it
                _wait(lambda: any(checkpoint_sequence(p.name) == j + 1
                                  for p in capsules.glob('checkpoint-*.capsule')), 60,
                      procs[-1:], f'checkpoint {j + 1} on disk')
            if how is None or how == 'after':
                hub.forward(command)
                world_got.append(np.array(command.data))
            if how is not None:
                hub.open = False
                procs[-1].send_signal(signal.SIGKILL)
                procs[-1].wait()
                if how == 'before':
                    newest = max(capsules.glob('checkpoint-*.capsule'),
                                 key=lambda p: checkpoint_sequence(p.name))
                    newest.unlink()
                start_policy()
        _wait(lambda: len(hub.joints) > steps, 60, (sim, procs[-1]), 'the last readings')
    finally:
        _stop(*procs)
        hub.close()
        rclpy.try_shutdown()
    return hub, world_got, [log.read_text() for log in logs]


def _resumed_at(log):
    """The step a restarted node resumed at, from its log."""
    marker = 'restore_on_start: resumed from '
    line = next((ln for ln in log.splitlines() if marker in ln), None)
    if line is None:
        raise RuntimeError(f'the restarted node did not resume from a checkpoint:\n{log}')
    return int(line.rsplit(' at step ', 1)[1])


def _first_wrong(hub, world_got):
    """The first command the world received that differs from the uninterrupted policy's
    (joint targets = action x 0.25 + default in float32, as the vendor loop and the node
    compute them), or None."""
    expected = reference_actions(hub.readings(len(world_got)))
    if len(expected) != len(world_got):
        raise RuntimeError(f'{len(world_got)} commands but {len(expected)} world readings')
    for j, (got, action) in enumerate(zip(world_got, expected)):
        if not np.array_equal(got, (action * np.float32(0.25) + DEFAULT).astype(np.float64)):
            return j
    return None


@pytest.mark.slow
def test_g1_recovers_from_sigkill_mid_walk(tmp_path):
    """Killed twice in a 20 s walk (at 5 s: after its command left; at 10 s: before its
    checkpoint was written), the node resumes from its newest checkpoint file and the walk
    goes on exactly as the uninterrupted one: every command the world received is the
    uninterrupted policy's, bit for bit."""
    hub, world_got, logs = walk_with_kills(tmp_path, STEPS_20S, {250: 'after', 500: 'before'})
    assert len(logs) == 3
    assert _resumed_at(logs[1]) == 251     # checkpoint 250: the state after step 250
    assert _resumed_at(logs[2]) == 500     # checkpoint 500 was lost: the one before it
    distance, low = hub.walked(STEPS_20S)
    print(f'G1 recovery: {STEPS_20S} steps, 2 kills, {distance:.3f} m forward, pelvis min '
          f'{low:.4f} m')
    assert _first_wrong(hub, world_got) is None
    assert low > 0.5 and distance >= 8.0


@pytest.mark.slow
def test_g1_recovery_kill_between_checkpoint_and_command(tmp_path):
    """The kill lands after checkpoint 50 is on disk but before command 50 reached the world:
    the world re-sends readings 50; the restarted node knows from the checkpoint (its input
    tag) that it answered them, and re-sends command 50 instead of stepping twice."""
    hub, world_got, logs = walk_with_kills(tmp_path, 60, {50: 'between'})
    if _resumed_at(logs[1]) != 51:
        raise RuntimeError(f'expected the node to resume at step 51: {logs[1]}')
    wrong = _first_wrong(hub, world_got)
    if wrong not in (None, 50):
        raise RuntimeError(f'command {wrong} differs: only command 50 can (see the reason)')
    assert wrong is None, 'command 50 after the restart is not the uninterrupted one'
