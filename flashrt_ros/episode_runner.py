"""episode_runner: closed-loop episodes of a world and a flashrt_policy node, with what-ifs.

Resets world and policy (policy: ~/reset_episode) to a start point, runs an episode, snapshots
world + policy at step k, branches K what-if continuations from there (each with its own initial
push and observation-noise seed), restoring both between branches, reports per-branch returns,
then replays every branch and checks that actions and world trajectories repeat bit for bit, and
that an episode reset reproduces the first episode. Exits 0 only if those checks held.

Worlds (`World` in flashrt_ros/sim.py): `mujoco` (the in-process MuJoCo cart-pole), `gazebo`
(`GazeboWorld`: ROS 2 simulation_interfaces services, ros_gz ControlWorld as a fallback), both
stepped through the node's flat ~/observation and ~/action (run the node with obs_dim = the
world's observation size and act_dim = 1); or `mjcf`, an in-process floating-base robot
(`RobotWorld`, parameters as the flashrt_sim node's mjcf world: mjcf_path, kps, kds, ...)
stepped through the node's robot topics (`RobotLink`: JointState + Imu in, joint position
targets out; the node runs with observation_type 'terms'). The Unitree G1:

  ros2 run flashrt_ros policy_node --ros-args --params-file config/g1.yaml \
      -p policy_file:=<robot_dir>/motion.pt
  ros2 run flashrt_ros episode_runner --ros-args --params-file config/g1.yaml \
      -p mjcf_path:=<robot_dir>/scene.xml

(g1.yaml: a snapshot at 10 s of walking, 3 branches pushed sideways by -0.5, 0, +0.5 m/s.)
"""
from copy import deepcopy
from functools import partial
import math
import statistics
import sys
import threading
import time

import numpy as np
import rclpy
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from std_msgs.msg import Float32MultiArray, Float64MultiArray

from flashrt_ros.client import PolicyClient, spin_in_thread, wait_matched
from flashrt_ros.robot_world import RobotWorld
from flashrt_ros.messages import robot_messages
from flashrt_ros.sim import MujocoWorld, robot_world_from_parameters, World

POLICY_CAPSULE = 'runner_branch_point'
WORLD_SNAPSHOT = 'branch_point'


def _call(client, request, timeout):
    """A service call from a node spun elsewhere; returns the response or raises TimeoutError."""
    if not client.wait_for_service(timeout_sec=timeout):
        raise TimeoutError(f'service {client.srv_name} did not appear')
    future = client.call_async(request)
    deadline = time.monotonic() + timeout
    while not future.done():
        if time.monotonic() > deadline:
            raise TimeoutError(f'service {client.srv_name} did not answer in {timeout} s')
        time.sleep(0.0005)
    return future.result()


class GazeboWorld(World):
    """A Gazebo world through the ROS 2 simulation interfaces (ros_gz ControlWorld fallback).

    simulation_interfaces: `<prefix>/reset_simulation` (ResetSimulation), `<prefix>/
    step_simulation` (StepSimulation), `<prefix>/get_entities_states` (GetEntitiesStates),
    `<prefix>/set_entity_state` (SetEntityState). Fallback: ros_gz_interfaces/srv/ControlWorld
    on `/world/<world>/control` (reset + multi_step; no snapshots).
    Observations: the `joints` positions then velocities from a sensor_msgs/JointState topic;
    actions: std_msgs/Float64 on `command_topic` (e.g. a ros_gz_bridge to the cart's force).
    Snapshots hold entity poses and twists: the simulation interfaces expose no full physics
    state, so a Gazebo restore is not bit-exact (the MuJoCo world's is).
    """

    columns = ('x', 'theta')

    def __init__(self, node, prefix='/gzserver', world='default', joints=('slider', 'hinge'),
                 joint_state_topic='/joint_states', command_topic='/cartpole/cmd_force',
                 steps_per_action=2, action_scale=10.0, timeout=10.0):
        from sensor_msgs.msg import JointState
        from std_msgs.msg import Float64
        self.api = None
        try:
            from simulation_interfaces import srv as sim_srv
            from simulation_interfaces.msg import Result
            self.api, self._srv, self._ok = 'simulation_interfaces', sim_srv, Result.RESULT_OK
        except ImportError:
            try:
                from ros_gz_interfaces.srv import ControlWorld
                self.api, self._control_type = 'ros_gz', ControlWorld
            except ImportError:
                raise RuntimeError(
                    'GazeboWorld needs the ROS 2 simulation interfaces: install '
                    'ros-jazzy-simulation-interfaces (or ros-jazzy-ros-gz-interfaces for the '
                    'ControlWorld fallback) and source /opt/ros/jazzy/setup.bash; neither '
                    '`simulation_interfaces` nor `ros_gz_interfaces` imports here') from None
        self.node, self.timeout = node, timeout
        self.joints = list(joints)
        self.obs_dim, self.act_dim = 2 * len(self.joints), 1
        self.steps_per_action = int(steps_per_action)
        self.action_scale = float(action_scale)
        self.noise_std, self.rng = 0.0, np.random.default_rng(0)
        self.snapshots = {}
        self._joint_state = None
        node.create_subscription(JointState, joint_state_topic, self._on_joint_state, 10)
        self._cmd_pub = node.create_publisher(Float64, command_topic, 10)
        self._float64 = Float64
        if self.api == 'simulation_interfaces':
            s = self._srv
            self._reset = node.create_client(s.ResetSimulation, f'{prefix}/reset_simulation')
            self._step = node.create_client(s.StepSimulation, f'{prefix}/step_simulation')
            self._get = node.create_client(s.GetEntitiesStates, f'{prefix}/get_entities_states')
            self._set = node.create_client(s.SetEntityState, f'{prefix}/set_entity_state')
        else:
            self._control = node.create_client(self._control_type, f'/world/{world}/control')

    def _on_joint_state(self, msg):
        self._joint_state = msg

    def _check(self, response, what):
        result = getattr(response, 'result', None)
        ok = result.result == self._ok if result is not None else \
            getattr(response, 'success', False)
        if not ok:
            detail = getattr(result, 'error_message', '') if result is not None else ''
            raise RuntimeError(f'Gazebo {what} failed: {detail}')

    def _wait_observation(self, after):
        deadline = time.monotonic() + self.timeout
        while self._joint_state is None or self._joint_state is after:
            if time.monotonic() > deadline:
                raise TimeoutError('no sensor_msgs/JointState from Gazebo after the step')
            time.sleep(0.0005)
        return self.observation()

    def observation(self):
        msg = self._joint_state
        index = {n: i for i, n in enumerate(msg.name)}
        missing = [j for j in self.joints if j not in index]
        if missing:
            raise RuntimeError(f'JointState lacks joints {missing}')
        obs = np.array([msg.position[index[j]] for j in self.joints] +
                       [msg.velocity[index[j]] for j in self.joints])
        if self.noise_std > 0.0:
            obs = obs + self.rng.normal(0.0, self.noise_std, obs.shape)
        return obs

    def _advance(self, steps):
        before = self._joint_state
        if self.api == 'simulation_interfaces':
            request = self._srv.StepSimulation.Request()
            request.steps = steps
            self._check(_call(self._step, request, self.timeout), 'step')
        else:
            request = self._control_type.Request()
            request.world_control.pause = True
            request.world_control.multi_step = steps
            self._check(_call(self._control, request, self.timeout), 'step')
        return self._wait_observation(before)

    def reset(self, seed=0):
        self.noise_std, self.rng = 0.0, np.random.default_rng(seed)
        if self.api == 'simulation_interfaces':
            request = self._srv.ResetSimulation.Request()
            self._check(_call(self._reset, request, self.timeout), 'reset')
        else:
            request = self._control_type.Request()
            request.world_control.pause = True
            request.world_control.reset.all = True
            self._check(_call(self._control, request, self.timeout), 'reset')
        return self._advance(1)

    def step(self, action):
        a = float(np.clip(self.action_scale * float(action[0]), -self.action_scale,
                          self.action_scale))
        self._cmd_pub.publish(self._float64(data=a))
        obs = self._advance(self.steps_per_action)
        return obs, float(math.cos(obs[1]) - 0.01 * obs[0] ** 2)

    def snapshot(self, name):
        if self.api != 'simulation_interfaces':
            raise RuntimeError('ros_gz ControlWorld has no state query: snapshots need '
                               'simulation_interfaces')
        response = _call(self._get, self._srv.GetEntitiesStates.Request(), self.timeout)
        self._check(response, 'get_entities_states')
        self.snapshots[name] = (list(response.entities), list(response.states),
                                self.rng.bit_generator.state, self.noise_std)
        return len(response.entities)

    def restore(self, name):
        entities, states, rng_state, noise_std = self.snapshots[name]
        for entity, state in zip(entities, states):
            request = self._srv.SetEntityState.Request()
            request.entity, request.state = entity, state
            self._check(_call(self._set, request, self.timeout), f'set_entity_state {entity}')
        self.rng = np.random.default_rng()
        self.rng.bit_generator.state = rng_state
        self.noise_std = noise_std
        return self._advance(1)

    def perturb(self, push=0.0, noise_seed=None, noise_std=0.0):
        if push:
            self._cmd_pub.publish(self._float64(data=float(push) * self.action_scale))
            self._advance(1)
        if noise_seed is not None:
            self.rng = np.random.default_rng(noise_seed)
        self.noise_std = float(noise_std)
        return self.observation()

    def state_bytes(self):
        return self.observation().tobytes()


def observation_link(client):
    """The flat link: the world's observation on the node's ~/observation, its ~/action back
    (PolicyClient.step); the action is also what drives the world."""
    def act(world, obs):
        action = client.step([float(v) for v in np.asarray(obs, dtype=np.float32)])
        return action, action
    return act


class RobotLink:
    """A policy node with observation_type 'terms' (e.g. config/g1.yaml) driving an in-process
    RobotWorld. A step publishes the world's readings (sensor_msgs/JointState and Imu stamped
    with the simulation time, as the flashrt_sim mjcf world publishes them) on the node's
    ~/joint_states and ~/imu, and returns (raw action from ~/action, joint position targets from
    ~/joint_commands); the targets drive the world, so the node's joint_names order must be the
    world's joint order (as for the flashrt_sim world).

    The node steps once per stamp (lockstep), so unanswered readings are sent again every
    `resend` seconds (never a second step) until `timeout`. Readings with the stamp the node
    last stepped on would get no answer at all: the link refuses them with the reason (only a
    restore back to exactly that stamp does that, e.g. branches of one step).
    """

    def __init__(self, node, policy='/flashrt_policy', timeout=10.0, resend=1.0,
                 qos_depth=100):
        from sensor_msgs.msg import Imu, JointState
        self.node, self.policy = node, policy.rstrip('/')
        self.timeout, self.resend = timeout, resend
        qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=qos_depth,
                         reliability=ReliabilityPolicy.RELIABLE)
        self._pubs = [node.create_publisher(JointState, f'{self.policy}/joint_states', qos),
                      node.create_publisher(Imu, f'{self.policy}/imu', qos)]
        self._received = {'action': [], 'joint_commands': []}
        self._cond = threading.Condition()
        self._subs = [node.create_subscription(msg_type, f'{self.policy}/{topic}',
                                               partial(self._on, topic), qos)
                      for topic, msg_type in (('action', Float32MultiArray),
                                              ('joint_commands', Float64MultiArray))]
        self._stepped = None        # stamp of the readings the node last answered

    def _on(self, topic, msg):
        with self._cond:
            self._received[topic].append(list(msg.data))
            self._cond.notify_all()

    def wait_ready(self, client, timeout=60.0, settle=0.5):
        """Waits for the node's services (those of `client`, a PolicyClient) and for this
        link's topics to be matched with the node's, then `settle` seconds: the node's side of
        a match may come later, and a command sent before it would be lost (the node answers
        a stamp once)."""
        deadline = time.monotonic() + timeout
        client.wait_services(deadline)
        wait_matched(self._pubs, self._subs, deadline,
                     f'{self.policy}: ~/joint_states, ~/imu, ~/action and ~/joint_commands are '
                     "not all connected: is the node active, with observation_type 'terms' and "
                     "control_mode 'lockstep'?")
        time.sleep(settle)

    def __call__(self, world, obs):
        return exchange([(self, world)])[0]


def exchange(pairs):
    """One control step of several (RobotLink, RobotWorld) pairs at once: every world's
    readings are published first (a fleet node steps them in one tick), then every answer is
    awaited; unanswered readings are re-sent every link.resend seconds. Returns (raw action,
    joint targets) per pair."""
    sent = []
    for link, world in pairs:
        messages = robot_messages(world)[:2]
        stamp = (messages[0].header.stamp.sec, messages[0].header.stamp.nanosec)
        if stamp == link._stepped:
            raise RuntimeError(
                f'readings at {stamp[0] + 1e-9 * stamp[1]:.3f} s again: the policy node steps '
                'once per stamp (lockstep) and already stepped on this one; a branch must run '
                'at least 2 steps')
        with link._cond:
            seen = {topic: len(values) for topic, values in link._received.items()}
        sent.append((link, messages, stamp, seen))
    for link, messages, _, _ in sent:
        for pub, msg in zip(link._pubs, messages):
            pub.publish(msg)
    results = []
    for link, messages, stamp, seen in sent:
        answered = (lambda link=link, seen=seen: all(
            len(v) > seen[t] for t, v in link._received.items()))
        deadline = time.monotonic() + link.timeout
        with link._cond:
            while not link._cond.wait_for(answered, min(max(0.0, deadline - time.monotonic()),
                                                        link.resend)):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f'no ~/action and ~/joint_commands from {link.policy} '
                                       f'within {link.timeout} s')
                for pub, msg in zip(link._pubs, messages):
                    pub.publish(msg)
            link._stepped = stamp
            results.append((link._received['action'][seen['action']],
                            link._received['joint_commands'][seen['joint_commands']]))
    return results


class BatchedLink:
    """Flat worlds on the sessions of fleet nodes: per node, one [sessions, obs_dim] message
    on ~/observations per step (rows of sessions not in use are NaN: they keep their state),
    its ~/actions back. addresses: (node path, session name) per world."""

    def __init__(self, node, addresses, clients, timeout=10.0):
        qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100,
                         reliability=ReliabilityPolicy.RELIABLE)
        self.timeout = timeout
        self._cond = threading.Condition()
        self._rows, self._pubs, self._received, self._subs = {}, {}, {}, []
        for policy in dict.fromkeys(p for p, _ in addresses):
            status = _wait_status(clients[policy], timeout)
            self._rows[policy] = list(status.session_names)
            self._pubs[policy] = node.create_publisher(Float32MultiArray,
                                                       f'{policy}/observations', qos)
            self._received[policy] = []
            self._subs.append(node.create_subscription(
                Float32MultiArray, f'{policy}/actions', partial(self._on, policy), qos))
        self.addresses = addresses
        unknown = [f'{p}:{n}' for p, n in addresses if n not in self._rows[p]]
        if unknown:
            raise ValueError(f'no such sessions: {unknown}')
        wait_matched(self._pubs.values(), self._subs, time.monotonic() + timeout,
                     '~/observations and ~/actions of the fleet nodes are not connected: '
                     "observation_type 'float32_array', sessions > 1?")
        time.sleep(0.2)     # the node's side of the match may come a little later

    def _on(self, policy, msg):
        with self._cond:
            self._received[policy].append(np.asarray(msg.data, dtype=np.float32))
            self._cond.notify_all()

    def __call__(self, observations):
        """Observations per address -> actions per address (lists of floats)."""
        frames = {p: np.full((len(names), len(observations[0])), np.nan, np.float32)
                  for p, names in self._rows.items()}
        for (policy, name), obs in zip(self.addresses, observations):
            frames[policy][self._rows[policy].index(name)] = obs
        with self._cond:
            seen = {p: len(v) for p, v in self._received.items()}
        for policy, frame in frames.items():
            msg = Float32MultiArray()
            msg.data = frame.reshape(-1).tolist()
            self._pubs[policy].publish(msg)
        with self._cond:
            if not self._cond.wait_for(lambda: all(len(v) > seen[p] for p, v in
                                                   self._received.items()), self.timeout):
                raise TimeoutError(f'no ~/actions within {self.timeout} s')
            got = {p: v[seen[p]].reshape(len(self._rows[p]), -1)
                   for p, v in self._received.items()}
        return [[float(x) for x in got[p][self._rows[p].index(n)]] for p, n in self.addresses]


def _wait_status(client, timeout):
    deadline = time.monotonic() + timeout
    while client.last_status is None or client.last_status.state != 'active':
        if time.monotonic() > deadline:
            raise TimeoutError(f'no ~/status of an active node from {client.policy}')
        time.sleep(0.01)
    return client.last_status


def parse_addresses(text, default_policy):
    """'node:session,node:session' (a bare 'session' means default_policy's) -> [(node path,
    session)]."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(','))):
        policy, _, session = item.rpartition(':')
        out.append(((policy or default_policy).rstrip('/'), session))
    return out


class EpisodeRunner:
    """Coordinates a World and a policy node (through a PolicyClient; `link`: how a step
    reaches the node, default observation_link(client), RobotLink for a robot world)."""

    def __init__(self, world, client, seed=0, log=print, link=None):
        self.world, self.client, self.seed, self.log = world, client, seed, log
        self.link = link or observation_link(client)
        self.parallel_s = self.sequential_s = None
        self.checks = []
        self.reset_us = []          # (world us, policy round-trip us)
        self.branch_us = []         # restore world + policy, us

    def check(self, name, ok, detail=''):
        self.checks.append((name, bool(ok), detail))
        self.log(f'  [{"PASS" if ok else "FAIL"}] {name}' + (f': {detail}' if detail else ''))
        return ok

    def policy_call(self, service, **fields):
        response, seconds = self.client.call(service, **fields)
        if not response.success:
            raise RuntimeError(f'policy {service} {fields} refused: {response.message}')
        return response, seconds

    def reset(self):
        """World and policy back to the start point; returns the first observation."""
        t0 = time.perf_counter()
        obs = self.world.reset(self.seed)
        world_s = time.perf_counter() - t0
        _, policy_s = self.policy_call('reset_episode')
        self.reset_us.append((world_s * 1e6, policy_s * 1e6))
        return obs

    def act(self, obs):
        """(the policy's action, what drives the world) for the world's current step."""
        return self.link(self.world, obs)

    def rollout(self, obs, steps):
        """steps control steps from obs: (actions, world states, rewards, last obs)."""
        actions, states, rewards = [], [], []
        for _ in range(steps):
            action, command = self.act(obs)
            obs, reward = self.world.step(command)
            actions.append(action)
            states.append(self.world.state_bytes())
            rewards.append(reward)
        return actions, states, rewards, obs

    def snapshot(self):
        self.world.snapshot(WORLD_SNAPSHOT)
        self.policy_call('snapshot', name=POLICY_CAPSULE, overwrite=True)

    def branch(self, index, steps, push, noise_std):
        """Both back to the branch point, the branch's what-if, then `steps` steps."""
        t0 = time.perf_counter()
        self.world.restore(WORLD_SNAPSHOT)
        self.policy_call('restore', name=POLICY_CAPSULE)
        self.branch_us.append((time.perf_counter() - t0) * 1e6)
        obs = self.world.perturb(push=push, noise_seed=1000 + index, noise_std=noise_std)
        return self.rollout(obs, steps)

    def parallel_branches(self, fleet, tail, pushes, noise_std):
        """The same what-ifs all at once: branch k on fleet.addresses[k] (a session of a fleet
        node, or of another node that loads the branch-point capsule from its file), each
        with its own copy of the world restored to the branch point; one tick per step for
        every branch. Returns per branch (actions, world states, rewards, last obs)."""
        worlds = fleet.worlds(len(pushes), self.world)
        if fleet.others:
            # capsules travel as files (checksummed, digest-checked on load): the nodes share
            # the capsule directory here; between hosts, copy the file
            path = self.policy_call('save_capsule', name=POLICY_CAPSULE)[0].path
            for client in fleet.others:
                response = client.call('load_capsule', path=path, name=POLICY_CAPSULE,
                                       overwrite=True)[0]
                if not response.success:
                    raise RuntimeError(f'{client.policy}: load_capsule refused: '
                                       f'{response.message}')
        t0 = time.perf_counter()
        obs = []
        for k, (world, push) in enumerate(zip(worlds, pushes)):
            policy, session = fleet.addresses[k]
            response = fleet.clients[policy].call('restore', name=POLICY_CAPSULE,
                                                  session=session)[0]
            if not response.success:
                raise RuntimeError(f'{policy}:{session}: restore refused: {response.message}')
            world.restore(WORLD_SNAPSHOT)
            obs.append(world.perturb(push=push, noise_seed=1000 + k, noise_std=noise_std))
        runs = [([], [], []) for _ in worlds]
        for _ in range(tail):
            answers = fleet.step(worlds, obs)
            for k, (world, (action, command)) in enumerate(zip(worlds, answers)):
                obs[k], reward = world.step(command)
                runs[k][0].append(action)
                runs[k][1].append(world.state_bytes())
                runs[k][2].append(reward)
        self.parallel_s = time.perf_counter() - t0
        return [(a, st, r, o) for (a, st, r), o in zip(runs, obs)]

    def run(self, steps=200, branch_at=50, branches=4, push=0.5, noise_std=0.01, resets=10,
            fleet=None):
        """fleet: a Fleet to run the branches on in parallel too (and check against the
        sequential ones), or None."""
        if not 0 < branch_at < steps:
            raise ValueError(f'branch_at must lie in (0, steps): {branch_at}, {steps}')
        tail = steps - branch_at
        pushes = [push * (i - (branches - 1) / 2) for i in range(branches)]
        self.log(f'episode: {steps} steps, snapshot at step {branch_at}, {branches} branches '
                 f'(pushes {", ".join(f"{p:+.2f}" for p in pushes)} m/s, observation noise '
                 f'std {noise_std}, seeds 1000..{999 + branches})')
        obs = self.reset()
        prefix = self.rollout(obs, branch_at)
        self.snapshot()
        when = getattr(self.world, 'sim_time', None)
        self.log(f'snapshot of world and policy at step {branch_at}' +
                 (f' (world time {when:.2f} s)' if when is not None else ''))
        main = self.rollout(prefix[3], tail)
        t0 = time.perf_counter()
        results = [self.branch(i, tail, pushes[i], noise_std) for i in range(branches)]
        self.sequential_s = time.perf_counter() - t0

        self.log('replaying every branch from the snapshot:')
        identical = []
        for i in range(branches):
            again = self.branch(i, tail, pushes[i], noise_std)
            same_a = again[0] == results[i][0]
            same_s = again[1] == results[i][1]
            identical.append(same_a and same_s)
            self.check(f'branch {i} replay: actions and world states identical', same_a and
                       same_s, f'{tail} steps, actions {"==" if same_a else "!="}, states '
                       f'{"==" if same_s else "!="}')
        if fleet is not None:
            parallel = self.parallel_branches(fleet, tail, pushes, noise_std)
            self.log(f'the {branches} branches in parallel on {fleet.describe()}:')
            for i in range(branches):
                same_a = parallel[i][0] == results[i][0]
                same_s = parallel[i][1] == results[i][1]
                self.check(f'branch {i} in parallel: actions and world states identical to '
                           'the sequential run', same_a and same_s,
                           f'on {fleet.addresses[i][0]}:{fleet.addresses[i][1]}')
            self.log(f'  {branches} branches x {tail} steps: sequential '
                     f'{self.sequential_s:.3f} s, parallel {self.parallel_s:.3f} s '
                     f'({self.sequential_s / self.parallel_s:.2f}x)')
        distinct = len({tuple(map(tuple, r[0])) for r in results})
        self.check('branches are independent (distinct what-ifs give distinct actions)',
                   branches < 2 or distinct > 1, f'{distinct} distinct of {branches}')

        obs = self.reset()
        again = self.rollout(obs, branch_at)
        self.check('episode reset reproduces the first episode (actions and states)',
                   again[0] == prefix[0] and again[1] == prefix[1], f'{branch_at} steps')
        for _ in range(resets - 2):         # more samples of the reset latency
            self.reset()
        self.report(prefix, main, results, pushes)
        self.results = results
        return all(ok for _, ok, _ in self.checks)

    def report(self, prefix, main, results, pushes):
        head = sum(prefix[2])
        self.log('\nreturns (sum of rewards over the episode)')
        first, second = (f'final {c}' for c in self.world.columns)
        self.log(f'  {"run":<12}{"push m/s":>10}{"return":>12}{first:>14}{second:>14}')
        rows = [('main', 0.0, main)] + [(f'branch {i}', pushes[i], r)
                                        for i, r in enumerate(results)]
        for label, push, run in rows:
            last = run[3]
            self.log(f'  {label:<12}{push:>10.2f}{head + sum(run[2]):12.3f}'
                     f'{last[0]:14.3f}{last[1]:14.3f}')
        warm = self.reset_us[1:] or self.reset_us     # the first call also pays discovery
        world = [w for w, _ in warm]
        policy = [p for _, p in warm]
        total = [w + p for w, p in warm]
        self.log(f'\nepisode reset latency (median of {len(total)} resets after the first): '
                 f'world {statistics.median(world):.1f} us + policy reset_episode round trip '
                 f'{statistics.median(policy):.1f} us = {statistics.median(total):.1f} us '
                 f'(first reset {sum(self.reset_us[0]):.1f} us)')
        self.log(f'branch restore latency (world + policy restore, {len(self.branch_us)} '
                 f'restores, median): {statistics.median(self.branch_us):.1f} us')
        passed = sum(ok for _, ok, _ in self.checks)
        self.log(f'\n{passed} passed, {len(self.checks) - passed} failed')


class Fleet:
    """Where parallel branches run: (node path, session) per branch, the PolicyClients of
    those nodes, and the link that steps all their worlds in one exchange per step."""

    def __init__(self, node, addresses, main_policy, make_world, robot, timeout):
        self.addresses, self.make_world = addresses, make_world
        self.clients = {p: PolicyClient(node, p, timeout=timeout)
                        for p in dict.fromkeys(p for p, _ in addresses)}
        self.others = [c for p, c in self.clients.items() if p != main_policy.rstrip('/')]
        if robot:
            self.links = [RobotLink(node, f'{p}/{s}', timeout=timeout) for p, s in addresses]
            for link, (policy, _) in zip(self.links, addresses):
                link.wait_ready(self.clients[policy], timeout=60.0, settle=0.0)
            time.sleep(0.5)     # see RobotLink.wait_ready
        else:
            self.batched = BatchedLink(node, addresses, self.clients, timeout)

    def worlds(self, count, world):
        """count copies of `world` holding its branch-point snapshot."""
        if count > len(self.addresses):
            raise ValueError(f'{count} branches need as many sessions in parallel; '
                             f'{len(self.addresses)} given')
        copies = []
        for _ in range(count):
            copy = self.make_world()
            copy.snapshots[WORLD_SNAPSHOT] = deepcopy(world.snapshots[WORLD_SNAPSHOT])
            copies.append(copy)
        return copies

    def step(self, worlds, obs):
        """(action, command) per world for its observation, in one exchange."""
        if hasattr(self, 'links'):
            return exchange(list(zip(self.links, worlds)))
        actions = self.batched([np.asarray(o, dtype=np.float32) for o in obs])
        return [(a, a) for a in actions]

    def describe(self):
        nodes = len(self.clients)
        return f'{len(self.addresses)} sessions of {nodes} node{"s" * (nodes > 1)}'


PARAMETERS = {
    'policy': '/flashrt_policy',
    'session': '',              # the policy node's session for the main run ('' = the only)
    'parallel': '',             # 'node:session,...' to run the branches on at once too
    'world': 'mujoco',          # mujoco | gazebo | mjcf (+ the mjcf world's parameters)
    'steps': 200,
    'branch_at': 50,
    'branches': 4,
    'push': 0.5,
    'noise_std': 0.01,
    'seed': 0,
    'resets': 10,
    'action_scale': 1.0,
    'frame_skip': 2,
    'gazebo_prefix': '/gzserver',
    'gazebo_world': 'default',
    'timeout': 30.0,
}


def make_world(kind, node, params):
    if kind == 'mujoco':
        return MujocoWorld(frame_skip=params['frame_skip'], action_scale=params['action_scale'])
    if kind == 'gazebo':
        return GazeboWorld(node, prefix=params['gazebo_prefix'], world=params['gazebo_world'],
                           action_scale=10.0 * params['action_scale'])
    if kind == 'mjcf':
        return robot_world_from_parameters(node)
    raise ValueError(f"parameter 'world' = {kind!r}: must be 'mujoco', 'gazebo' or 'mjcf'")


def connect(world, node, params):
    """(PolicyClient, link) to the policy node, once its services and topics are connected."""
    session = params['session']
    client = PolicyClient(node, params['policy'], timeout=params['timeout'], session=session)
    if not isinstance(world, RobotWorld):
        client.wait_ready(timeout=60.0)
        return client, None
    topics = f'{params["policy"].rstrip("/")}/{session}' if session else params['policy']
    link = RobotLink(node, topics, timeout=params['timeout'])
    link.wait_ready(client, timeout=60.0)
    return client, link


def declare_parameters(node):
    """Declares PARAMETERS on the runner's node; returns their values."""
    for name, default in PARAMETERS.items():
        node.declare_parameter(name, default)
    return {name: node.get_parameter(name).value for name in PARAMETERS}


def run_episodes(node, params, log=print):
    """Builds the world, connects to the policy node and runs (node: spun elsewhere, with
    declare_parameters' values in params). Returns (EpisodeRunner, all checks held)."""
    world = make_world(params['world'], node, params)
    client, link = connect(world, node, params)
    log(f'flashrt_ros episode runner: {params["world"]} world (obs_dim {world.obs_dim}, '
        f'act_dim {world.act_dim}), policy {params["policy"]}')
    runner = EpisodeRunner(world, client, seed=params['seed'], log=log, link=link)
    fleet = None
    if params['parallel']:
        fleet = Fleet(node, parse_addresses(params['parallel'], params['policy']),
                      params['policy'], partial(make_world, params['world'], node, params),
                      isinstance(world, RobotWorld), params['timeout'])
    ok = runner.run(steps=params['steps'], branch_at=params['branch_at'],
                    branches=params['branches'], push=params['push'],
                    noise_std=params['noise_std'], resets=params['resets'], fleet=fleet)
    return runner, ok


def main(args=None):
    rclpy.init(args=args)
    node = rclpy.create_node('flashrt_episode_runner')
    params = declare_parameters(node)
    executor = spin_in_thread(node)
    ok = False
    try:
        ok = run_episodes(node, params, log=lambda s: print(s, flush=True))[1]
    except (TimeoutError, RuntimeError, ValueError) as exc:
        print(f'episode runner failed: {exc}', file=sys.stderr)
        if isinstance(exc, TimeoutError) and params['world'] != 'mjcf':
            print('(does the policy node run with obs_dim = the world\'s observation size and '
                  'act_dim = 1?)', file=sys.stderr)
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    sys.exit(0 if ok else 1)


if __name__ == '__main__':
    main()
