"""The ROS standard simulator API (simulation_interfaces) served by the `flashrt_sim` node.

Under the node's own namespace, as Gazebo serves them under /gzserver: for node flashrt_sim,
/flashrt_sim/get_simulator_features, reset_simulation, get_simulation_state,
set_simulation_state, step_simulation, the simulate_steps action, get_entities,
get_entity_state, set_entity_state and get_entities_states. What each does here:

- One simulation step = one control period of the world (cart-pole: frame_skip physics steps;
  the mjcf robot: `decimation` physics steps under joint PD control), the unit of ~/step and of
  one command message. Steps hold the last command; with lockstep 'steps' each step first
  sends the readings and waits for the policy's answer (sim_node.py).
- States: PAUSED at start; PLAYING steps in real time (real_time_factor); STOPPED resets the
  world and holds it; QUITTING ends the node. Stepping is refused unless paused.
- ResetSimulation: DEFAULT/ALL or TIME|STATE: the seeded start; STATE alone keeps the time;
  TIME alone keeps the state. Nothing is ever spawned, so SCOPE_SPAWNED (unless ALL) is
  unsupported.
- Entities: the model's named bodies. States are ground truth in the world frame. Only free
  bodies (floating bases) can be set; setting what was read changes nothing, bit for bit.
  set_acceleration is ignored (the standard allows it). The robot's sensor readings are those
  of the end of the last control period: a set state shows in the next period's readings.
- Filters: a name regular expression (Python `re.search`, which reads the POSIX extended
  syntax the standard names the same way for ordinary patterns); categories, tags and bounds
  are unsupported features and refused as such.

Result codes follow the interface files: RESULT_FEATURE_UNSUPPORTED for what the features do
not list, RESULT_NOT_FOUND for an unknown entity, RESULT_INCORRECT_STATE while a step or goal
is running, RESULT_OPERATION_FAILED (stepping unless paused, bad input) and the services' own
codes (ALREADY_IN_TARGET_STATE, INVALID_POSE). Every refusal says why in error_message.
"""
import re

import numpy as np
from rclpy.action import ActionServer, CancelResponse, GoalResponse

try:
    from simulation_interfaces import action as si_action, msg as si_msg, srv as si_srv
except ImportError:     # not built: ../shared/ros-src absent, no ros-jazzy-simulation-interfaces
    si_action = si_msg = si_srv = None

from flashrt_ros.messages import sim_stamp

if si_msg is not None:
    R = si_msg.Result
    F = si_msg.SimulatorFeatures
    S = si_msg.SimulationState
    FEATURES = (F.SIMULATION_RESET, F.SIMULATION_RESET_TIME, F.SIMULATION_RESET_STATE,
                F.SIMULATION_STATE_GETTING, F.SIMULATION_STATE_SETTING,
                F.SIMULATION_STATE_PAUSE, F.STEP_SIMULATION_SINGLE,
                F.STEP_SIMULATION_MULTIPLE, F.STEP_SIMULATION_ACTION,
                F.ENTITY_STATE_GETTING, F.ENTITY_STATE_SETTING)


def available():
    return si_msg is not None


def _result(response, code, message=''):
    response.result.result, response.result.error_message = code, message
    return response


def _fill_state(out, state, stamp):
    pos, quat, lin, ang, lin_acc, ang_acc = state
    out.header.frame_id, out.header.stamp = 'world', stamp
    p, q = out.pose.position, out.pose.orientation
    p.x, p.y, p.z = (float(v) for v in pos)
    q.w, q.x, q.y, q.z = (float(v) for v in quat)
    for vec, values in ((out.twist.linear, lin), (out.twist.angular, ang),
                        (out.acceleration.linear, lin_acc),
                        (out.acceleration.angular, ang_acc)):
        vec.x, vec.y, vec.z = (float(v) for v in values)
    return out


def _xyz(v):
    return np.array([v.x, v.y, v.z], dtype=np.float64)


class SimulationServices:
    """simulation_interfaces on a SimNode (`sim`): see the module docstring. The node provides
    world, lock, sim_state, busy, set_sim_state(), reset_world(), advance(), changed()."""

    def __init__(self, sim, group):
        self.sim = sim
        s = si_srv
        for name, srv_type, callback in (
                ('get_simulator_features', s.GetSimulatorFeatures, self.get_features),
                ('reset_simulation', s.ResetSimulation, self.reset_simulation),
                ('get_simulation_state', s.GetSimulationState, self.get_simulation_state),
                ('set_simulation_state', s.SetSimulationState, self.set_simulation_state),
                ('step_simulation', s.StepSimulation, self.step_simulation),
                ('get_entities', s.GetEntities, self.get_entities),
                ('get_entity_state', s.GetEntityState, self.get_entity_state),
                ('set_entity_state', s.SetEntityState, self.set_entity_state),
                ('get_entities_states', s.GetEntitiesStates, self.get_entities_states)):
            sim.create_service(srv_type, f'~/{name}', callback, callback_group=group)
        self.action = ActionServer(
            sim, si_action.SimulateSteps, '~/simulate_steps', execute_callback=self.simulate,
            goal_callback=self._goal, cancel_callback=lambda _: CancelResponse.ACCEPT,
            callback_group=group)

    # -- simulator and simulation state ---------------------------------------------------

    def get_features(self, request, response):
        response.features.features = list(FEATURES)
        response.features.custom_info = (
            'flashrt_ros MuJoCo world: one step = one control period '
            f'({self.sim.world.control_period:g} s); world capsules beyond the standard: '
            '~/snapshot, ~/restore, ~/save_capsule, ~/load_capsule (complete integration '
            'state, restores bit for bit)')
        return response

    def get_simulation_state(self, request, response):
        response.state.state = self.sim.sim_state
        return _result(response, R.RESULT_OK)

    def set_simulation_state(self, request, response):
        return _result(response, *self.sim.set_sim_state(request.state.state))

    def reset_simulation(self, request, response):
        scope = request.scope
        r = si_srv.ResetSimulation.Request
        if scope in (r.SCOPE_DEFAULT, r.SCOPE_ALL):
            state = time = True
        elif scope & ~(r.SCOPE_TIME | r.SCOPE_STATE):
            return _result(response, R.RESULT_FEATURE_UNSUPPORTED,
                           f'scope {scope}: only SCOPE_TIME (1), SCOPE_STATE (2), both, '
                           'DEFAULT or ALL are supported (nothing is ever spawned here)')
        else:
            state, time = bool(scope & r.SCOPE_STATE), bool(scope & r.SCOPE_TIME)
        if self.sim.busy:
            return _result(response, R.RESULT_INCORRECT_STATE, f'{self.sim.busy} is running')
        self.sim.reset_world(state=state, time=time)
        return _result(response, R.RESULT_OK)

    # -- stepping -------------------------------------------------------------------------

    def _step_refusal(self, steps):
        if steps < 1:
            return R.RESULT_OPERATION_FAILED, 'steps must be at least 1'
        if self.sim.busy:
            return R.RESULT_INCORRECT_STATE, f'{self.sim.busy} is running'
        if self.sim.sim_state != S.STATE_PAUSED:
            what = 'playing' if self.sim.sim_state == S.STATE_PLAYING else 'stopped'
            return R.RESULT_OPERATION_FAILED, \
                f'the simulation is {what}: pause it first (set_simulation_state PAUSED)'
        return None

    async def step_simulation(self, request, response):
        refusal = self._step_refusal(request.steps)
        if refusal:
            return _result(response, *refusal)
        done, error = await self.sim.advance(request.steps, 'a StepSimulation call')
        if error:
            return _result(response, R.RESULT_OPERATION_FAILED,
                           f'stopped after {done} of {request.steps} steps: {error}')
        return _result(response, R.RESULT_OK)

    def _goal(self, goal):
        return GoalResponse.REJECT if self.sim.busy else GoalResponse.ACCEPT

    async def simulate(self, goal_handle):
        steps = goal_handle.request.steps
        result = si_action.SimulateSteps.Result()
        refusal = self._step_refusal(steps)
        if refusal:
            goal_handle.abort()
            return _result(result, *refusal)
        feedback = si_action.SimulateSteps.Feedback()

        def publish_feedback(done):
            feedback.completed_steps, feedback.remaining_steps = done, steps - done
            goal_handle.publish_feedback(feedback)
        done, error = await self.sim.advance(
            steps, 'a SimulateSteps goal', publish_feedback,
            lambda: goal_handle.is_cancel_requested)
        if goal_handle.is_cancel_requested:
            goal_handle.canceled()
            return _result(result, R.RESULT_OK, f'canceled after {done} of {steps} steps')
        if error:
            goal_handle.abort()
            return _result(result, R.RESULT_OPERATION_FAILED,
                           f'stopped after {done} of {steps} steps: {error}')
        goal_handle.succeed()
        return _result(result, R.RESULT_OK)

    # -- entities -------------------------------------------------------------------------

    def _filtered(self, filters):
        """(names, None) or (None, (code, message))."""
        if filters.categories:
            return None, (R.RESULT_FEATURE_UNSUPPORTED, 'entity categories are not supported')
        if filters.tags.tags:
            return None, (R.RESULT_FEATURE_UNSUPPORTED, 'entity tags are not supported')
        if filters.bounds.type != si_msg.Bounds.TYPE_EMPTY or filters.bounds.points:
            return None, (R.RESULT_FEATURE_UNSUPPORTED, 'bounds filters are not supported')
        try:
            pattern = re.compile(filters.filter)
        except re.error as exc:
            return None, (R.RESULT_OPERATION_FAILED,
                          f'filter {filters.filter!r} is not a regular expression: {exc}')
        return [n for n in self.sim.world.entities() if pattern.search(n)], None

    def get_entities(self, request, response):
        names, refusal = self._filtered(request.filters)
        if refusal:
            return _result(response, *refusal)
        response.entities = names
        return _result(response, R.RESULT_OK)

    def get_entity_state(self, request, response):
        with self.sim.lock:
            world = self.sim.world
            if request.entity not in world.entities():
                return _result(response, R.RESULT_NOT_FOUND,
                               f'no entity named {request.entity!r}')
            _fill_state(response.state, world.entity_state(request.entity),
                        sim_stamp(world.sim_time))
        return _result(response, R.RESULT_OK)

    def get_entities_states(self, request, response):
        names, refusal = self._filtered(request.filters)
        if refusal:
            return _result(response, *refusal)
        with self.sim.lock:
            world = self.sim.world
            stamp = sim_stamp(world.sim_time)
            response.entities = names
            response.states = [_fill_state(si_msg.EntityState(), state, stamp)
                               for state in world.entity_states(names)]
        return _result(response, R.RESULT_OK)

    def set_entity_state(self, request, response):
        invalid = si_srv.SetEntityState.Response.INVALID_POSE
        state = request.state
        if state.header.frame_id not in ('', 'world'):
            return _result(response, R.RESULT_OPERATION_FAILED,
                           f'frame {state.header.frame_id!r}: states are set in the world '
                           "frame ('' or 'world')")
        if self.sim.busy:
            return _result(response, R.RESULT_INCORRECT_STATE, f'{self.sim.busy} is running')
        pos = quat = lin = ang = None
        if request.set_pose:
            o = state.pose.orientation
            pos, quat = _xyz(state.pose.position), np.array([o.w, o.x, o.y, o.z])
            if not (np.all(np.isfinite(pos)) and np.all(np.isfinite(quat))):
                return _result(response, invalid, 'the pose holds NaN or Inf')
            if abs(float(np.linalg.norm(quat)) - 1.0) > 1e-3:
                return _result(response, invalid, 'the orientation is not a unit quaternion '
                               f'(norm {float(np.linalg.norm(quat)):.6g})')
        if request.set_twist:
            lin, ang = _xyz(state.twist.linear), _xyz(state.twist.angular)
        with self.sim.lock:
            world = self.sim.world
            if request.entity not in world.entities():
                return _result(response, R.RESULT_NOT_FOUND,
                               f'no entity named {request.entity!r}')
            try:
                changed = world.set_entity_state(request.entity, pos, quat, lin, ang)
            except (TypeError, ValueError) as exc:
                return _result(response, R.RESULT_OPERATION_FAILED, str(exc))
        if changed:
            self.sim.changed()
        return _result(response, R.RESULT_OK)
