"""A test's client of a flashrt_sim world through simulation_interfaces (the SimulateSteps
action, ResetSimulation, Get/SetEntityState, GetEntitiesStates), on its own node spun in a
thread. Needs rclpy and simulation_interfaces: import it after the importorskips."""
import threading

import numpy as np
import rclpy
from rclpy.action import ActionClient
from simulation_interfaces.action import SimulateSteps
from simulation_interfaces.msg import Result
from simulation_interfaces.srv import (GetEntitiesStates, GetEntityState, ResetSimulation,
                                       SetEntityState)

from flashrt_ros.client import call_service, spin_in_thread


class SimDriver:
    """This test's node: the world's SimulateSteps action, ResetSimulation and
    GetEntitiesStates (the ground truth a run ends in: compared bit for bit, it shows that
    every command the world stepped with was the same, without a side subscription that could
    miss the first ones)."""

    def __init__(self):
        self.node = rclpy.create_node('sim_driver_test')
        self.action = ActionClient(self.node, SimulateSteps, '/flashrt_sim/simulate_steps')
        self.clients = {name: self.node.create_client(srv, f'/flashrt_sim/{name}') for name, srv
                        in (('reset_simulation', ResetSimulation),
                            ('get_entities_states', GetEntitiesStates),
                            ('get_entity_state', GetEntityState),
                            ('set_entity_state', SetEntityState))}
        self.spinner = spin_in_thread(self.node)

    def call(self, name, request):
        client = self.clients[name]
        assert client.wait_for_service(timeout_sec=60.0), f'{name} did not appear'
        response = call_service(client, request, 30.0)[0]
        assert response.result.result == Result.RESULT_OK, response.result.error_message
        return response

    def simulate(self, steps, timeout=240.0):
        """SimulateSteps(steps) to its end."""
        assert self.action.wait_for_server(timeout_sec=120.0), 'the world did not come up'
        done = threading.Event()
        holder = {}
        self.action.send_goal_async(SimulateSteps.Goal(steps=steps)).add_done_callback(
            lambda f: f.result().get_result_async().add_done_callback(
                lambda r: (holder.update(result=r.result().result.result), done.set())))
        assert done.wait(timeout), f'SimulateSteps({steps}) did not finish in {timeout} s'
        assert holder['result'].result == Result.RESULT_OK, holder['result'].error_message

    def states(self):
        """Every entity's pose, twist and acceleration and the time, as bytes."""
        response = self.call('get_entities_states', GetEntitiesStates.Request())
        values = []
        for s in response.states:
            values.append(s.header.stamp.sec * 10**9 + s.header.stamp.nanosec)
            for v in (s.pose.position, s.twist.linear, s.twist.angular, s.acceleration.linear):
                values += [v.x, v.y, v.z]
            q = s.pose.orientation
            values += [q.w, q.x, q.y, q.z]
        return np.array(values, dtype=np.float64).tobytes()

    def entity(self, name):
        return self.call('get_entity_state', GetEntityState.Request(entity=name)).state

    def push(self, name, dx=0.0, dy=0.0, dz=0.0):
        """Adds (dx, dy, dz) m/s to an entity's linear velocity."""
        state = self.entity(name)
        v = state.twist.linear
        v.x, v.y, v.z = v.x + dx, v.y + dy, v.z + dz
        self.call('set_entity_state', SetEntityState.Request(entity=name, state=state,
                                                             set_twist=True))

    def close(self):
        self.spinner.shutdown()
        self.node.destroy_node()
