"""A Gazebo world for the episode runner, through ROS 2 services (`GazeboWorld`).

It implements `World` (world.py) on a node the caller spins elsewhere: the episode runner's
world 'gazebo', stepped through the policy node's flat ~/observation and ~/action.
"""
import math
import time

import numpy as np

from flashrt_ros.sim.world import World


def wait_and_call(client, request, timeout):
    """A service call from a node spun elsewhere, once the service has appeared: returns the
    response or raises TimeoutError."""
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
            self._check(wait_and_call(self._step, request, self.timeout), 'step')
        else:
            request = self._control_type.Request()
            request.world_control.pause = True
            request.world_control.multi_step = steps
            self._check(wait_and_call(self._control, request, self.timeout), 'step')
        return self._wait_observation(before)

    def reset(self, seed=0):
        self.noise_std, self.rng = 0.0, np.random.default_rng(seed)
        if self.api == 'simulation_interfaces':
            request = self._srv.ResetSimulation.Request()
            self._check(wait_and_call(self._reset, request, self.timeout), 'reset')
        else:
            request = self._control_type.Request()
            request.world_control.pause = True
            request.world_control.reset.all = True
            self._check(wait_and_call(self._control, request, self.timeout), 'reset')
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
        response = wait_and_call(self._get, self._srv.GetEntitiesStates.Request(), self.timeout)
        self._check(response, 'get_entities_states')
        self.snapshots[name] = (list(response.entities), list(response.states),
                                self.rng.bit_generator.state, self.noise_std)
        return len(response.entities)

    def restore(self, name):
        entities, states, rng_state, noise_std = self.snapshots[name]
        for entity, state in zip(entities, states):
            request = self._srv.SetEntityState.Request()
            request.entity, request.state = entity, state
            self._check(wait_and_call(self._set, request, self.timeout),
                        f'set_entity_state {entity}')
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
