"""episode_runner: closed-loop episodes of a world and a flashrt_policy node, with what-ifs.

Resets world and policy (policy: ~/reset_episode) to a start point, runs an episode, snapshots
world + policy at step k, branches K what-if continuations from there (each with its own initial
push and observation-noise seed), restoring both between branches, reports per-branch returns,
then replays every branch and checks that actions and world trajectories repeat bit for bit, and
that an episode reset reproduces the first episode. Exits 0 only if those checks held.

Worlds (`World` in flashrt_ros/sim/world.py): `mujoco` (the in-process MuJoCo cart-pole),
stepped through the node's flat ~/observation and ~/action (run the node with obs_dim = the
world's observation size and act_dim = 1); `simulator`, any simulator serving the ROS standard
simulation_interfaces at `simulator` (flashrt_sim with lockstep 'steps', Gazebo, Isaac Sim:
`SimulatorWorld` in simulator_world.py), which talks to the policy node directly while the
runner pauses, steps, snapshots and pushes it; or `mjcf`, an in-process
floating-base robot (`RobotWorld`, parameters as the flashrt_sim node's mjcf world:
mjcf_path, kps, kds, ...) stepped through the node's robot topics (`RobotLink` in links.py:
JointState + Imu in, joint position targets out; the node runs with observation_type 'terms').
The Unitree G1:

  ros2 run flashrt_ros policy_node --ros-args --params-file config/g1.yaml \
      -p policy_file:=<robot_dir>/motion.pt
  ros2 run flashrt_ros episode_runner --ros-args --params-file config/g1.yaml \
      -p mjcf_path:=<robot_dir>/scene.xml

(g1.yaml: a snapshot at 10 s of walking, 3 branches pushed sideways by -0.5, 0, +0.5 m/s.)
"""
from functools import partial
import statistics
import sys
import time

import rclpy

from flashrt_ros.client import PolicyClient, spin_in_thread
from flashrt_ros.harness.fleet import Fleet, parse_addresses
from flashrt_ros.harness.links import observation_link, RobotLink
from flashrt_ros.harness.simulator_world import SimulatorWorld
from flashrt_ros.sim.cartpole import MujocoWorld
from flashrt_ros.sim.robot_world import RobotWorld
from flashrt_ros.sim.sim_node import robot_world_from_parameters

POLICY_CAPSULE = 'runner_branch_point'
WORLD_SNAPSHOT = 'branch_point'


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
        if getattr(self.world, 'remote', False):    # the simulator and the policy talk
            return self.world.rollout(steps)        # directly: paused lock-step
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
        worlds = fleet.worlds(len(pushes), self.world, WORLD_SNAPSHOT)
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
            # a simulator behind simulation_interfaces reports no reward: no return column
            ret = f'{head + sum(run[2]):12.3f}' if run[2] else f'{"n/a":>12}'
            self.log(f'  {label:<12}{push:>10.2f}{ret}{last[0]:14.3f}{last[1]:14.3f}')
        warm = self.reset_us[1:] or self.reset_us     # the first call also pays discovery
        world = [w for w, _ in warm]
        policy = [p for _, p in warm]
        total = [w + p for w, p in warm]
        # three medians side by side: the median of the sums is not the sum of the medians
        self.log(f'\nepisode reset latency (medians of {len(total)} resets after the first): '
                 f'world + policy {statistics.median(total):.1f} us; world alone '
                 f'{statistics.median(world):.1f} us, policy reset_episode round trip alone '
                 f'{statistics.median(policy):.1f} us (first reset {sum(self.reset_us[0]):.1f} '
                 'us)')
        self.log(f'branch restore latency (world + policy restore, {len(self.branch_us)} '
                 f'restores, median): {statistics.median(self.branch_us):.1f} us')
        passed = sum(ok for _, ok, _ in self.checks)
        self.log(f'\n{passed} passed, {len(self.checks) - passed} failed')


PARAMETERS = {
    'policy': '/flashrt_policy',
    'session': '',              # the policy node's session for the main run ('' = the only)
    'parallel': '',             # 'node:session,...' to run the branches on at once too
    'world': 'mujoco',          # mujoco | simulator | mjcf (+ the mjcf world's parameters)
    'steps': 200,
    'branch_at': 50,
    'branches': 4,
    'push': 0.5,
    'noise_std': 0.01,
    'seed': 0,
    'resets': 10,
    'action_scale': 1.0,
    'frame_skip': 2,
    'simulator': '/flashrt_sim',    # world 'simulator': where simulation_interfaces is served
    'push_entity': '',          # world 'simulator': the body a push acts on (G1: pelvis)
    'push_direction': 'y',      # world 'simulator': x | y | z (the cart-pole's rail is x)
    'timeout': 30.0,
}


def make_world(kind, node, params):
    if kind == 'mujoco':
        return MujocoWorld(frame_skip=params['frame_skip'], action_scale=params['action_scale'])
    if kind == 'mjcf':
        return robot_world_from_parameters(node)
    if kind == 'simulator':
        return None     # made by connect(): it records the policy client's actions
    raise ValueError(f"parameter 'world' = {kind!r}: must be 'mujoco', 'simulator' or 'mjcf'")


def connect(world, node, params, log=print):
    """(PolicyClient, link, world) to the policy node, once its services and topics are
    connected; a 'simulator' world is made here."""
    session = params['session']
    client = PolicyClient(node, params['policy'], timeout=params['timeout'], session=session)
    if world is None:
        client.wait_services(time.monotonic() + 60.0)
        world = SimulatorWorld(node, client, params['simulator'], params['push_entity'],
                               params['timeout'], log, params['push_direction'])
        return client, None, world
    if not isinstance(world, RobotWorld):
        client.wait_ready(timeout=60.0)
        return client, None, world
    link = RobotLink(node, params['policy'], session, timeout=params['timeout'])
    link.wait_ready(client, timeout=60.0)
    return client, link, world


def declare_parameters(node):
    """Declares PARAMETERS on the runner's node; returns their values."""
    for name, default in PARAMETERS.items():
        node.declare_parameter(name, default)
    return {name: node.get_parameter(name).value for name in PARAMETERS}


def run_episodes(node, params, log=print):
    """Builds the world, connects to the policy node and runs (node: spun elsewhere, with
    declare_parameters' values in params). Returns (EpisodeRunner, all checks held)."""
    world = make_world(params['world'], node, params)
    client, link, world = connect(world, node, params, log)
    sizes = '' if getattr(world, 'remote', False) else \
        f' (obs_dim {world.obs_dim}, act_dim {world.act_dim})'
    log(f'flashrt_ros episode runner: {params["world"]} world{sizes}, policy {params["policy"]}')
    runner = EpisodeRunner(world, client, seed=params['seed'], log=log, link=link)
    fleet = None
    if params['parallel'] and params['world'] == 'simulator':
        raise ValueError('parallel branches need in-process worlds (one per branch): not '
                         'with the simulator world')
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
