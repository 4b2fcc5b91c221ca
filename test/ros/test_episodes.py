"""Closed-loop episodes: the MuJoCo world, the flashrt_sim node and the episode runner.

A PolicyNode (small recurrent policy, obs_dim 4, act_dim 1, CPU) runs in-process with a
PolicyClient on a second node and a flashrt_sim node, all over real rclpy and Fast DDS. Checks:
world snapshot/restore is exact, replaying a branch from a world + policy snapshot gives
bit-identical actions and world states, and K branches from one snapshot stay independent.
"""
import os
import pathlib
import threading
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytest.importorskip('mujoco', reason='mujoco missing: pip install -r requirements/runtime.txt')
pytestmark = pytest.mark.ros

import numpy as np  # noqa: E402
from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from std_msgs.msg import Float32MultiArray  # noqa: E402
from std_srvs.srv import Trigger  # noqa: E402

from flashrt_ros import srv as fsrv  # noqa: E402
from flashrt_ros.client import call_service, PolicyClient, spin_in_thread  # noqa: E402
from flashrt_ros.harness.episode_runner import EpisodeRunner  # noqa: E402
from flashrt_ros.harness.fleet import Fleet, parse_addresses  # noqa: E402
from flashrt_ros.harness.simulator_world import SimulatorWorld  # noqa: E402
from flashrt_ros.node.policy_node import PolicyNode  # noqa: E402
from flashrt_ros.sim.cartpole import MujocoWorld  # noqa: E402
from flashrt_ros.sim.sim_node import make_sim_node  # noqa: E402
from support.common import wait_for  # noqa: E402


def wait_and_call(client, request, timeout):
    """A service call once the service has appeared: the response."""
    assert client.wait_for_service(timeout_sec=timeout), f'{client.srv_name} did not appear'
    return call_service(client, request, timeout)[0]


@pytest.fixture(scope='module')
def system(tmp_path_factory):
    """policy node + client node + sim node on one executor; the policy active."""
    rclpy.init()
    tag = f'{os.getpid()}'
    policy_name = f'flashrt_policy_ep{tag}'
    params = dict(device='cpu', obs_dim=4, act_dim=1, rnn_hidden_dim=16, status_period=0.5,
                  capsule_dir=str(tmp_path_factory.mktemp('capsules')))
    policy = PolicyNode(policy_name, parameter_overrides=[
        Parameter(k, value=v) for k, v in params.items()])
    client_node = rclpy.create_node(f'episode_test_client{tag}')
    sim = make_sim_node(f'flashrt_sim_ep{tag}')
    node_spinner = spin_in_thread(policy, sim)
    executor = spin_in_thread(client_node)
    assert policy.trigger_configure() == TransitionCallbackReturn.SUCCESS
    assert policy.trigger_activate() == TransitionCallbackReturn.SUCCESS
    client = PolicyClient(client_node, '/' + policy_name, timeout=30.0)
    client.wait_ready(timeout=20.0)
    yield dict(client=client, client_node=client_node, sim=sim, policy=policy)
    executor.shutdown()
    node_spinner.shutdown()
    for node in (policy, client_node, sim):
        node.destroy_node()
    rclpy.try_shutdown()


def quiet(_):
    pass


def test_world_snapshot_restore_is_exact():
    world = MujocoWorld()
    world.reset(3)
    for t in range(40):
        world.step([np.sin(0.2 * t)])
    world.snapshot('mid')
    qpos_qvel, state = world.qpos_qvel_bytes(), world.state_bytes()
    actions = [[np.cos(0.3 * t)] for t in range(50)]
    first = [(world.step(a)[0].tobytes(), world.state_bytes()) for a in actions]
    assert world.qpos_qvel_bytes() != qpos_qvel
    world.restore('mid')
    assert world.qpos_qvel_bytes() == qpos_qvel
    assert world.state_bytes() == state
    assert [(world.step(a)[0].tobytes(), world.state_bytes()) for a in actions] == first
    with pytest.raises(KeyError, match='no world snapshot'):
        world.restore('nope')
    with pytest.raises(ValueError, match='takes 1'):
        world.step([0.0, 1.0])


def test_closed_loop_branches_replay_bit_identically(system):
    runner = EpisodeRunner(MujocoWorld(), system['client'], seed=1, log=quiet)
    ok = runner.run(steps=80, branch_at=30, branches=3, push=0.6, noise_std=0.01,
                    resets=4)
    assert ok, [c for c in runner.checks if not c[1]]
    assert len(runner.reset_us) == 4 and all(w > 0 and p > 0 for w, p in runner.reset_us)
    returns = [sum(r[2]) for r in runner.results]
    assert len(set(returns)) == 3, returns


def test_branches_from_one_snapshot_stay_independent(system):
    """Branches run in any order from one snapshot; each replays identically."""
    runner = EpisodeRunner(MujocoWorld(), system['client'], seed=2, log=quiet)
    obs = runner.reset()
    runner.rollout(obs, 25)
    runner.snapshot()
    b1 = runner.branch(1, 30, push=0.4, noise_std=0.02)
    b0 = runner.branch(0, 30, push=-0.4, noise_std=0.02)
    b1_again = runner.branch(1, 30, push=0.4, noise_std=0.02)
    b0_again = runner.branch(0, 30, push=-0.4, noise_std=0.02)
    assert b1[0] == b1_again[0] and b1[1] == b1_again[1]
    assert b0[0] == b0_again[0] and b0[1] == b0_again[1]
    assert b0[0] != b1[0] and b0[1] != b1[1]
    # Same push, other noise seed: the observation noise alone changes the policy's actions.
    b2 = runner.branch(2, 30, push=0.4, noise_std=0.02)
    assert b2[0] != b1[0]


class _Observations:
    def __init__(self, node, topic):
        self.msgs = []
        self.cond = threading.Condition()
        node.create_subscription(Float32MultiArray, topic, self._on, 10)

    def _on(self, msg):
        with self.cond:
            self.msgs.append(list(msg.data))
            self.cond.notify_all()

    def next(self, seen, timeout=10.0):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.msgs) > seen, timeout)
            return self.msgs[seen]


def test_sim_node_services(system):
    node, sim = system['client_node'], system['sim']
    base = '/' + sim.get_name()
    obs = _Observations(node, base + '/observation')
    action_pub = node.create_publisher(Float32MultiArray, base + '/action', 10)
    reset = node.create_client(Trigger, base + '/reset')
    step = node.create_client(Trigger, base + '/step')
    snapshot = node.create_client(fsrv.Snapshot, base + '/snapshot')
    restore = node.create_client(fsrv.Restore, base + '/restore')
    r = wait_and_call(reset, Trigger.Request(), 10.0)
    assert r.success, r.message
    wait_for(lambda: action_pub.get_subscription_count() > 0, what='the sim node matched')

    def act(value):
        seen = len(obs.msgs)
        action_pub.publish(Float32MultiArray(data=[value]))
        return obs.next(seen)

    for t in range(20):
        act(0.5 * np.sin(0.3 * t))
    request = fsrv.Snapshot.Request()
    request.name = 'w'
    r = wait_and_call(snapshot, request, 10.0)
    assert r.success and r.capsule.nbytes == sim.world.state_size * 8, r.message
    state = sim.world.state_bytes()
    first = [act(0.3) for _ in range(10)]
    r = wait_and_call(step, Trigger.Request(), 10.0)
    assert r.success and '1 steps' in r.message
    request = fsrv.Restore.Request()
    request.name = 'w'
    r = wait_and_call(restore, request, 10.0)
    assert r.success, r.message
    assert sim.world.state_bytes() == state
    assert [act(0.3) for _ in range(10)] == first
    request.name = 'missing'
    r = wait_and_call(restore, request, 10.0)
    assert not r.success and 'missing' in r.message


def test_world_capsules_follow_the_policy_capsule_rules(system, tmp_path):
    """World capsules: hostile names refused, an existing name replaced only with overwrite,
    saved to a checksummed file and loaded back (the restore is exact), a file of another
    model and a damaged file refused with the reason."""
    node, sim = system['client_node'], system['sim']
    base = '/' + sim.get_name()
    calls = {name: node.create_client(t, f'{base}/{name}') for name, t in (
        ('snapshot', fsrv.Snapshot), ('restore', fsrv.Restore),
        ('save_capsule', fsrv.SaveCapsule), ('load_capsule', fsrv.LoadCapsule),
        ('list_capsules', fsrv.ListCapsules), ('delete_capsule', fsrv.DeleteCapsule))}
    tmp_path = pathlib.Path(os.path.realpath(tmp_path))
    sim.capsules.names.directory = str(tmp_path)    # files of this test under tmp_path

    def call(service, **fields):
        request = {'snapshot': fsrv.Snapshot, 'restore': fsrv.Restore,
                   'save_capsule': fsrv.SaveCapsule, 'load_capsule': fsrv.LoadCapsule,
                   'list_capsules': fsrv.ListCapsules,
                   'delete_capsule': fsrv.DeleteCapsule}[service].Request(**fields)
        return wait_and_call(calls[service], request, 10.0)

    for bad in ('../escape', 'a/b', '', 'checkpoint-0', 'x' * 200):
        r = call('snapshot', name=bad)
        assert not r.success and 'name' in r.message, (bad, r.message)
    assert call('snapshot', name='cap').success
    r = call('snapshot', name='cap')
    assert not r.success and 'overwrite' in r.message
    assert call('snapshot', name='cap', overwrite=True).success
    state = sim.world.state_bytes()
    r = call('save_capsule', name='cap')
    assert r.success and r.path == str(tmp_path / 'cap.capsule'), r.message
    for _ in range(5):
        sim.world.step([0.2])
    assert call('delete_capsule', name='cap').success
    assert not call('restore', name='cap').success
    r = call('load_capsule', path='cap.capsule')
    assert r.success and r.capsule.name == 'cap', r.message
    listed = {c.name: c for c in call('list_capsules').capsules}
    assert listed['cap'].tier == 'host' and listed['cap'].nbytes == sim.world.state_size * 8
    assert call('restore', name='cap').success
    assert sim.world.state_bytes() == state
    # another model (frame_skip does not change the model; the G1 would, but the cart-pole
    # with another timestep does): refused, naming the reason
    other = MujocoWorld(xml=MujocoWorld.__init__.__defaults__[0].replace(
        'timestep="0.01"', 'timestep="0.005"'))
    from flashrt_ros.sim.world_capsules import WorldCapsules
    with pytest.raises(Exception, match='not a world capsule of this model'):
        WorldCapsules(other, str(tmp_path)).load('cap.capsule')
    data = bytearray((tmp_path / 'cap.capsule').read_bytes())
    data[-3] ^= 0xFF
    (tmp_path / 'bad.capsule').write_bytes(bytes(data))
    r = call('load_capsule', path='bad.capsule', name='bad')
    assert not r.success and 'checksum' in r.message, r.message
    r = call('load_capsule', path='../outside.capsule')
    assert not r.success and 'outside' in r.message, r.message


def test_cartpole_runner_through_simulation_interfaces_equals_the_in_process_world(system):
    """The episode runner drives a flashrt_sim cart-pole through simulation_interfaces only
    (+ world capsules) in paused lock-step, with a policy node reading the world's
    ~/observation: the what-if branches (pushes along the rail) equal the runner's in-process
    world bit for bit, and every replay and the episode reset hold."""
    pytest.importorskip('simulation_interfaces', reason='simulation_interfaces is not built: '
                        'it comes from ../shared/ros-src (tools/bootstrap.sh builds it there)')
    tag = f'{os.getpid()}'
    sim_name, policy_name = f'flashrt_sim_si{tag}', f'flashrt_policy_si{tag}'
    params = dict(device='cpu', obs_dim=4, act_dim=1, rnn_hidden_dim=16, status_period=0.5,
                  capsule_dir=system['policy'].get_parameter('capsule_dir').value + '_si')
    policy = PolicyNode(policy_name, parameter_overrides=[
        Parameter(k, value=v) for k, v in params.items()],
        cli_args=['--ros-args', '-r', f'~/observation:=/{sim_name}/observation'])
    sim = make_sim_node(sim_name, parameter_overrides=[
        Parameter('lockstep', value='steps'), Parameter('seed', value=1)],
        cli_args=['--ros-args', '-r', f'~/action:=/{policy_name}/action'])
    spinner = spin_in_thread(policy, sim)
    try:
        assert policy.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert policy.trigger_activate() == TransitionCallbackReturn.SUCCESS
        client = PolicyClient(system['client_node'], '/' + policy_name, timeout=30.0)
        client.wait_services(time.monotonic() + 20.0)
        wait_for(lambda: sim.count_subscribers(f'/{sim_name}/observation') and
                 sim.count_publishers(f'/{policy_name}/action') >= 1,
                 what='the world and the policy matched')
        world = SimulatorWorld(system['client_node'], client, '/' + sim_name, 'cart',
                               timeout=30.0, log=quiet, push_direction='x')
        remote = EpisodeRunner(world, client, seed=1, log=quiet)
        assert remote.run(steps=60, branch_at=25, branches=3, push=0.6, noise_std=0.0,
                          resets=2), [c for c in remote.checks if not c[1]]
        local = EpisodeRunner(MujocoWorld(), system['client'], seed=1, log=quiet)
        assert local.run(steps=60, branch_at=25, branches=3, push=0.6, noise_std=0.0,
                         resets=2), [c for c in local.checks if not c[1]]
        for k, (here, there) in enumerate(zip(local.results, remote.results)):
            assert len(there[0]) == 35 and there[0] == here[0], f'branch {k}: actions differ'
            assert there[3][0] == here[3][0], f'branch {k}: final cart x'
        with pytest.raises(ValueError, match='observation noise is not part'):
            world.perturb(noise_std=0.01)
        world.close()
    finally:
        spinner.shutdown()
        policy.destroy_node()
        sim.destroy_node()


def test_branches_in_parallel_on_two_fleet_nodes_equal_the_sequential_ones(system, tmp_path):
    """Four cart-pole what-ifs run one after another on session a0 of fleet node A, then all
    at once on A's two sessions and B's two (B loads the branch point from its capsule file):
    one batched message per node per step. Every parallel branch equals its sequential run bit
    for bit, actions and world states."""
    tag = f'{os.getpid()}'        # rclpy is up: the module's system fixture
    shared = dict(device='cpu', obs_dim=4, act_dim=1, rnn_hidden_dim=16, status_period=0.1,
                  capsule_dir=str(tmp_path / 'capsules'), sessions=2)
    nodes = [PolicyNode(f'fleet_{n}_{tag}', parameter_overrides=[
        Parameter(k, value=v) for k, v in dict(shared, session_names=[f'{n}0', f'{n}1']).items()])
        for n in 'ab']
    runner_node = rclpy.create_node(f'fleet_runner_{tag}')
    spinners = [spin_in_thread(*nodes), spin_in_thread(runner_node)]
    try:
        for node in nodes:
            assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
            assert node.trigger_activate() == TransitionCallbackReturn.SUCCESS
        a, b = (f'/fleet_{n}_{tag}' for n in 'ab')
        client = PolicyClient(runner_node, a, timeout=30.0, session='a0')
        client.wait_ready(timeout=20.0)
        fleet = Fleet(runner_node, parse_addresses(f'{a}:a0,{a}:a1,{b}:b0,{b}:b1', a), a,
                      MujocoWorld, robot=False, timeout=30.0)
        lines = []
        runner = EpisodeRunner(MujocoWorld(), client, seed=4, log=lines.append)
        ok = runner.run(steps=70, branch_at=30, branches=4, push=0.5, noise_std=0.01,
                        resets=2, fleet=fleet)
    finally:
        for spinner in spinners:
            spinner.shutdown()
        for node in (*nodes, runner_node):
            node.destroy_node()
    parallel = [c for c in runner.checks if 'in parallel' in c[0]]
    assert ok and len(parallel) == 4, [c for c in runner.checks if not c[1]]
    print('\n'.join(lines))
    assert any('branches x 40 steps: sequential' in line for line in lines), lines
