"""episode_runner: closed-loop episodes of a world and a flashrt_policy node, with what-ifs.

Resets world and policy (policy: ~/reset_episode) to a start point, runs an episode, snapshots
world + policy at step k, branches K what-if continuations from there (each with its own initial
push and observation-noise seed), restoring both between branches, reports per-branch returns,
then replays every branch and checks that actions and world trajectories repeat bit for bit, and
that an episode reset reproduces the first episode. Exits 0 only if those checks held.

Worlds (`World` in flashrt_ros/sim.py): `mujoco` (the in-process MuJoCo cart-pole) or `gazebo`
(`GazeboWorld`: ROS 2 simulation_interfaces services, ros_gz ControlWorld as a fallback).
The policy node must run with obs_dim = the world's observation size and act_dim = 1.
"""
import math
import statistics
import sys
import time

import numpy as np
import rclpy

from flashrt_ros.client import PolicyClient, spin_in_thread
from flashrt_ros.sim import MujocoWorld, World

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


class EpisodeRunner:
    """Coordinates a World and a policy node (through a PolicyClient)."""

    def __init__(self, world, client, seed=0, log=print):
        self.world, self.client, self.seed, self.log = world, client, seed, log
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
        return self.client.step([float(v) for v in np.asarray(obs, dtype=np.float32)])

    def rollout(self, obs, steps):
        """steps control steps from obs: (actions, world states, rewards, last obs)."""
        actions, states, rewards = [], [], []
        for _ in range(steps):
            action = self.act(obs)
            obs, reward = self.world.step(action)
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

    def run(self, steps=200, branch_at=50, branches=4, push=0.5, noise_std=0.01, resets=10):
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
        main = self.rollout(prefix[3], tail)
        results = [self.branch(i, tail, pushes[i], noise_std) for i in range(branches)]

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
        self.log(f'  {"run":<12}{"push m/s":>10}{"return":>12}{"final x":>10}{"final th":>10}')
        rows = [('main', 0.0, main)] + [(f'branch {i}', pushes[i], r)
                                        for i, r in enumerate(results)]
        for label, push, run in rows:
            last = run[3]
            self.log(f'  {label:<12}{push:>10.2f}{head + sum(run[2]):12.3f}'
                     f'{last[0]:10.3f}{last[1]:10.3f}')
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


PARAMETERS = {
    'policy': '/flashrt_policy',
    'world': 'mujoco',          # mujoco | gazebo
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
    raise ValueError(f"parameter 'world' = {kind!r}: must be 'mujoco' or 'gazebo'")


def main(args=None):
    rclpy.init(args=args)
    node = rclpy.create_node('flashrt_episode_runner')
    for name, default in PARAMETERS.items():
        node.declare_parameter(name, default)
    params = {name: node.get_parameter(name).value for name in PARAMETERS}
    executor = spin_in_thread(node)
    ok = False
    try:
        world = make_world(params['world'], node, params)
        client = PolicyClient(node, params['policy'], timeout=params['timeout'])
        client.wait_ready(timeout=60.0)
        print(f'flashrt_ros episode runner: {params["world"]} world (obs_dim {world.obs_dim}, '
              f'act_dim {world.act_dim}), policy {params["policy"]} (run it with '
              f'-p obs_dim:={world.obs_dim} -p act_dim:={world.act_dim})', flush=True)
        runner = EpisodeRunner(world, client, seed=params['seed'],
                               log=lambda s: print(s, flush=True))
        ok = runner.run(steps=params['steps'], branch_at=params['branch_at'],
                        branches=params['branches'], push=params['push'],
                        noise_std=params['noise_std'], resets=params['resets'])
    except (TimeoutError, RuntimeError, ValueError) as exc:
        print(f'episode runner failed: {exc}', file=sys.stderr)
        if isinstance(exc, TimeoutError):
            print('(does the policy node run with obs_dim = the world\'s observation size and '
                  'act_dim = 1?)', file=sys.stderr)
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    sys.exit(0 if ok else 1)


if __name__ == '__main__':
    main()
