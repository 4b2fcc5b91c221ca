"""Any simulator that serves simulation_interfaces, driven by the episode runner
(`SimulatorWorld`): this package's flashrt_sim, Gazebo (ros_gz), Isaac Sim, O3DE.

Paused lock-step: the runner pauses the simulator and advances it with the SimulateSteps
action; the simulator sends each step's readings to the policy node, waits for its command and
steps (flashrt_sim with lockstep 'steps'), so world and policy advance exactly together however
loaded the machine is. The runner records the policy's actions (its ~/action topic).

Branch points: world capsules where the simulator serves them (`<prefix>/snapshot` and
`<prefix>/restore` with flashrt_ros/srv/Snapshot and Restore: flashrt_sim), so world and
policy restore to one step bit for bit. Otherwise the entities' poses and twists
(GetEntitiesStates, then SetEntityState for each that can be set), which is all the standard
exposes: joint angles, contacts and solver warm starts are not restored, so branches are then
approximate, and the runner says so. A push is SetEntityState on `push_entity`'s linear
velocity (read, add, write back: exact when the simulator keeps what it reports, as flashrt_sim
does). Observation noise lives in a simulator's sensors, not in the standard: it is refused.
"""
import threading
import time

import numpy as np

from flashrt_ros.client import call_service, wait_matched

try:
    from simulation_interfaces import action as si_action, msg as si_msg, srv as si_srv
except ImportError:
    si_action = si_msg = si_srv = None


CHUNK = 50      # steps per SimulateSteps goal: below the policy's ~/action history (qos_depth)


class SimulatorWorld:
    """The episode runner's World for a simulator behind simulation_interfaces at `prefix`
    (e.g. /flashrt_sim, /gzserver). `client`: the PolicyClient whose ~/action it records."""

    remote = True       # the simulator and the policy talk directly; the runner orchestrates

    def __init__(self, node, client, prefix='/flashrt_sim', push_entity='', timeout=30.0,
                 log=print, push_direction='y'):
        if si_srv is None:
            raise RuntimeError(
                "world 'simulator' needs the simulation_interfaces package: install "
                'ros-jazzy-simulation-interfaces (or build it in your workspace: '
                'tools/bootstrap.sh does where ../shared/ros-src exists)')
        from rclpy.action import ActionClient
        from flashrt_ros import srv as fsrv
        self.node, self.client, self.timeout, self.log = node, client, timeout, log
        self.prefix = prefix.rstrip('/')
        self._clients = {}
        self._types = {'get_simulator_features': si_srv.GetSimulatorFeatures,
                       'set_simulation_state': si_srv.SetSimulationState,
                       'reset_simulation': si_srv.ResetSimulation,
                       'get_entities_states': si_srv.GetEntitiesStates,
                       'get_entity_state': si_srv.GetEntityState,
                       'set_entity_state': si_srv.SetEntityState,
                       'snapshot': fsrv.Snapshot, 'restore': fsrv.Restore}
        features = self._call('get_simulator_features').features
        self.features = set(features.features)
        F = si_msg.SimulatorFeatures
        needed = {'SIMULATION_RESET': F.SIMULATION_RESET,
                  'SIMULATION_STATE_PAUSE': F.SIMULATION_STATE_PAUSE,
                  'STEP_SIMULATION_ACTION': F.STEP_SIMULATION_ACTION,
                  'ENTITY_STATE_GETTING': F.ENTITY_STATE_GETTING}
        missing = [name for name, flag in needed.items() if flag not in self.features]
        if missing:
            raise RuntimeError(f'the simulator at {self.prefix} lacks features the runner '
                               f'needs: {", ".join(missing)}')
        self.exact = self._has_services('snapshot', 'restore')
        self.push_entity = push_entity
        if push_direction not in ('x', 'y', 'z'):
            raise ValueError(f"push_direction must be 'x', 'y' or 'z', got {push_direction!r}")
        self.push_direction = push_direction
        self._steps = ActionClient(node, si_action.SimulateSteps, f'{self.prefix}/simulate_steps')
        if not self._steps.wait_for_server(timeout_sec=timeout):
            raise TimeoutError(f'action {self.prefix}/simulate_steps did not appear')
        self._kept = {}
        # the actions are recorded from the policy's ~/action: matched here, then a moment for
        # the node's side of the match (an action sent before it would reach nobody; the
        # world's steps only start with the first rollout)
        wait_matched([], [client._action_sub], time.monotonic() + timeout,
                     f'{client.policy}/action has no publisher: is the policy node active?')
        time.sleep(0.5)
        log(f'simulator at {self.prefix}: ' + (
            'world capsules (exact branches)' if self.exact else
            'no world capsules: branches restore entity poses and twists only (approximate)'))
        self.columns = (f'{push_entity} x', f'{push_entity} y') if push_entity else ('x', 'y')

    # -- calls ----------------------------------------------------------------------------

    def _has_services(self, *names):
        """Whether the simulator offers all of these services (waiting up to 5 s for them
        to show in the graph)."""
        want = {f'{self.prefix}/{name}' for name in names}
        deadline = time.monotonic() + min(self.timeout, 5.0)
        while time.monotonic() < deadline:
            if want <= {n for n, _ in self.node.get_service_names_and_types()}:
                return True
            time.sleep(0.05)
        return False

    def _call(self, service, **fields):
        name = service
        client = self._clients.get(name)
        if client is None:
            client = self.node.create_client(self._types[name], f'{self.prefix}/{name}')
            if not client.wait_for_service(timeout_sec=self.timeout):
                raise TimeoutError(f'service {self.prefix}/{name} did not appear')
            self._clients[name] = client
        request = self._types[name].Request()
        for key, value in fields.items():
            setattr(request, key, value)
        response = call_service(client, request, self.timeout)[0]
        result = getattr(response, 'result', None)
        if hasattr(result, 'result') and result.result != si_msg.Result.RESULT_OK and not (
                name == 'set_simulation_state' and result.result ==
                si_srv.SetSimulationState.Response.ALREADY_IN_TARGET_STATE):
            raise RuntimeError(f'{self.prefix}/{name} refused (result {result.result}): '
                               f'{result.error_message}')
        if hasattr(response, 'success') and not response.success:
            raise RuntimeError(f'{self.prefix}/{name} refused: {response.message}')
        return response

    def _simulate(self, steps):
        done = threading.Event()
        holder = {}

        def on_result(future):
            holder['result'] = future.result()
            done.set()

        def on_goal(future):
            handle = future.result()
            if not handle.accepted:
                holder['rejected'] = True
                done.set()
                return
            handle.get_result_async().add_done_callback(on_result)
        self._steps.send_goal_async(si_action.SimulateSteps.Goal(steps=steps)) \
            .add_done_callback(on_goal)
        if not done.wait(self.timeout + steps * 1.0):
            raise TimeoutError(f'{self.prefix}/simulate_steps ({steps} steps) did not finish')
        if holder.get('rejected'):
            raise RuntimeError(f'{self.prefix}/simulate_steps rejected the goal (busy)')
        result = holder['result'].result.result
        if result.result != si_msg.Result.RESULT_OK:
            raise RuntimeError(f'{self.prefix}/simulate_steps failed: {result.error_message}')

    # -- the World the episode runner drives ----------------------------------------------

    def reset(self, seed=0):
        """Paused, back to the simulator's own start (its seed is its own parameter)."""
        self._call('set_simulation_state', state=si_msg.SimulationState(
            state=si_msg.SimulationState.STATE_PAUSED))
        self._call('reset_simulation', scope=si_srv.ResetSimulation.Request.SCOPE_ALL)
        return None

    def rollout(self, steps):
        """`steps` steps in paused lock-step: (actions, final entity states, [], final x, y).

        In goals of at most CHUNK steps, each one's actions received before the next: the
        world runs as fast as the policy answers, and a reader that fell further behind than
        the publisher's history (a loaded machine) would lose actions (KEEP_LAST)."""
        seen = self.client.actions_received()
        done = 0
        while done < steps:
            n = min(CHUNK, steps - done)
            self._simulate(n)
            done += n
            self.client.wait_actions(seen + done)
        actions = self.client.wait_actions(seen + steps)[seen:seen + steps]
        return actions, [self.state_bytes()], [], self.final_columns()

    def snapshot(self, name):
        if self.exact:
            self._call('snapshot', name=name, overwrite=True)
        else:
            states = self._call('get_entities_states')
            self._kept[name] = list(zip(states.entities, states.states))

    def restore(self, name):
        if self.exact:
            self._call('restore', name=name)
            return None
        for entity, state in self._kept[name]:
            try:
                self._call('set_entity_state', entity=entity, state=state, set_pose=True,
                           set_twist=True)
            except RuntimeError:
                pass    # fixed or jointed bodies: not settable through the standard
        return None

    def perturb(self, push=0.0, noise_seed=None, noise_std=0.0):
        if noise_std:
            raise ValueError('observation noise is not part of simulation_interfaces: set '
                             'noise_std to 0 for a simulator world')
        if push:
            if not self.push_entity:
                raise ValueError('a push needs push_entity (the body to push, e.g. pelvis)')
            state = self._call('get_entity_state', entity=self.push_entity).state
            # a number pushes along push_direction (y: sideways for a robot; x: along the
            # cart-pole's rail); three numbers are (x, y, z), as for RobotWorld.perturb
            p = np.asarray(push, dtype=np.float64).reshape(-1)
            lin = state.twist.linear
            if p.size == 1:
                axis = self.push_direction
                setattr(lin, axis, getattr(lin, axis) + float(p[0]))
            else:
                lin.x, lin.y, lin.z = lin.x + p[0], lin.y + p[1], lin.z + p[2]
            self._call('set_entity_state', entity=self.push_entity, state=state,
                       set_twist=True)
        return None

    def state_bytes(self):
        """Every entity's pose and twist now, as bytes (for identity checks)."""
        states = self._call('get_entities_states')
        values = []
        for s in states.states:
            p, q, v, w = s.pose.position, s.pose.orientation, s.twist.linear, s.twist.angular
            values += [p.x, p.y, p.z, q.w, q.x, q.y, q.z, v.x, v.y, v.z, w.x, w.y, w.z]
        return np.array(values, dtype=np.float64).tobytes()

    def final_columns(self):
        if not self.push_entity:
            return (float('nan'), float('nan'))
        p = self._call('get_entity_state', entity=self.push_entity).state.pose.position
        return (p.x, p.y)

    def close(self):
        self._steps.destroy()
