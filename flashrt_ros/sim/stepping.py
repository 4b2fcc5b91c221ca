"""How the `flashrt_sim` world steps (SimNode's stepping, a mixin): the simulation state
(simulation_interfaces' PAUSED, PLAYING, STOPPED, QUITTING), the lock-step modes (`lockstep`:
command, steps, off; see sim_node.py), the steps of StepSimulation, SimulateSteps and ~/step,
and following a policy's rollbacks (`follow_rollbacks`: the world's state after each step, by
the stamp of the readings its command answered, restored when the policy's safety supervisor
rolls back).

The node provides world, lock, publish(), changed(), _publish_clock(), robot, lockstep and the
attributes __init__ of SimNode sets (sim_state, busy, held, _answer, _published, _play_timer,
_history, _following).
"""
import rclpy

from flashrt_ros.messages import sim_stamp
from flashrt_ros.sim import simulation_services

# simulation_interfaces/msg/SimulationState values (also where that package is not built)
STOPPED, PLAYING, PAUSED, QUITTING, NO_WORLD, LOADING_WORLD = range(6)
LOCKSTEP_MODES = ('command', 'steps', 'off')


class Stepping:
    """SimNode's stepping: see the module docstring."""

    # -- stepping -------------------------------------------------------------------------

    def _step(self, command):
        """One control period holding `command` (None: the last one). False if refused."""
        answered = _ns(self.world.sim_time)
        try:
            obs, reward = self.world.step(command)
        except ValueError as exc:
            self.get_logger().warning(f'command refused: {exc}', throttle_duration_sec=1.0)
            return False
        self.held = None
        if self._following:
            self._remember(answered)
        if self.lockstep == 'steps' and self.sim_state != PLAYING:
            self._published = False
            self._publish_clock()
        else:
            self.publish(obs, reward)
        return True

    # -- following a policy's rollbacks (its safety supervisor) ------------------------------

    def _remember(self, answered):
        name = f'follow-{answered}'
        self.world.snapshot(name)
        self._history.append(answered)
        while len(self._history) > max(1, self.get_parameter('rollback_window').value):
            self.world.delete(f'follow-{self._history.popleft()}')

    def _on_safety_event(self, msg):
        if msg.response != 'rollback':
            return          # a hold or ramp: the world goes on under the held commands
        stamp = msg.restored_stamp.sec * 1_000_000_000 + msg.restored_stamp.nanosec
        if stamp not in self._history:
            self.get_logger().error(
                f'policy rolled back to {msg.restored_capsule!r} (readings of '
                f'{stamp * 1e-9:.4f} s); the world keeps no state of that moment (last '
                f'{len(self._history)} steps: rollback_window) and goes on')
            return
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(('rollback', stamp, msg.restored_capsule))
            return
        with self.lock:
            self._roll_back(stamp, msg.restored_capsule)

    def _roll_back(self, stamp, capsule):
        obs = self.world.restore(f'follow-{stamp}')
        while self._history and self._history[-1] != stamp:
            self.world.delete(f'follow-{self._history.pop()}')
        self.get_logger().warning(f'policy rolled back to {capsule!r}: world back to '
                                  f'{self.world.sim_time:.4f} s with it')
        self.changed(obs)

    def action_callback(self, msg):
        command = list(msg.data)
        if self.lockstep == 'command' and self.sim_state == PAUSED and not self.busy:
            with self.lock:
                self._step(command)
            return
        self.held = command
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(command)

    async def _answered(self):
        """lockstep 'steps': the current readings out (once), then the command that answers
        them; None after command_timeout."""
        if not self._published:
            with self.lock:
                self.publish(self.world.observation(), self.world.reward())
        answer = self._answer
        if not answer.done():
            timer = self.create_timer(self.get_parameter('command_timeout').value,
                                      lambda: answer.done() or answer.set_result(None))
            try:
                await answer
            finally:
                self.destroy_timer(timer)
        return answer.result()

    async def advance(self, steps, what, feedback=None, cancelled=None):
        """`steps` control periods while paused (the caller checked): (steps done, error or
        ''). Between steps other callbacks run (a cancel, a state query)."""
        self.busy = what
        try:
            for done in range(steps):
                if cancelled is not None and cancelled():
                    return done, 'canceled'
                command = self.held
                if self.lockstep == 'steps':
                    command = await self._answered()
                    while isinstance(command, tuple):       # the policy rolled back instead
                        with self.lock:
                            self._roll_back(*command[1:])
                        command = await self._answered()
                    if command is None:
                        topic = '~/joint_commands' if self.robot is not None else '~/action'
                        return done, (f'no command on {self.get_name()}/{topic[2:]} answered '
                                      f'the readings at {self.world.sim_time:.4f} s within '
                                      f'{self.get_parameter("command_timeout").value} s '
                                      '(lockstep steps): is the policy running?')
                else:
                    await _Yield(self.executor)     # a cancel or a query may run in between
                with self.lock:
                    if not self._step(command):
                        return done, 'the command was refused (see the log)'
                if feedback is not None:
                    feedback(done + 1)
            return steps, ''
        finally:
            self.busy = ''

    def _play_tick(self):
        if self.sim_state == PLAYING and not self.busy:
            with self.lock:
                self._step(self.held)

    def set_sim_state(self, target):
        """simulation_interfaces SetSimulationState: (result code, message)."""
        R, T = simulation_services.R, simulation_services.si_srv.SetSimulationState.Response
        if target == self.sim_state:
            return T.ALREADY_IN_TARGET_STATE, f'already in state {target}'
        if target in (NO_WORLD, LOADING_WORLD):
            return R.RESULT_FEATURE_UNSUPPORTED, 'worlds are not loaded or unloaded here'
        if target not in (STOPPED, PLAYING, PAUSED, QUITTING):
            return R.RESULT_OPERATION_FAILED, f'unknown simulation state {target}'
        if self.busy:
            return R.RESULT_INCORRECT_STATE, f'{self.busy} is running: cancel it first'
        if self._play_timer is not None:
            self.destroy_timer(self._play_timer)
            self._play_timer = None
        if target == QUITTING:
            self.get_logger().info('simulation state QUITTING: the node ends')
            once = []
            self.create_timer(0.1, lambda: once or once.append(
                rclpy.try_shutdown(context=self.context)))
            return R.RESULT_OK, ''
        self.sim_state = target
        if target == PLAYING:
            period = self.world.control_period / self.get_parameter('real_time_factor').value
            self._play_timer = self.create_timer(period, self._play_tick)
        elif target == STOPPED:
            self.reset_world(True, True)
        return R.RESULT_OK, ''

    def reset_world(self, state=True, time=True):
        with self.lock:
            obs = self.world.reset_scoped(self.get_parameter('seed').value, state, time)
            self.changed(obs)


def _ns(seconds):
    """Simulation time as the integer nanoseconds its readings' stamps carry."""
    stamp = sim_stamp(seconds)
    return stamp.sec * 1_000_000_000 + stamp.nanosec


class _Yield:
    """Awaitable: hands the executor one turn (woken at once), so that a cancel request or a
    query runs between two steps of a long SimulateSteps goal."""

    def __init__(self, executor):
        self.executor = executor

    def __await__(self):
        if self.executor is not None:
            self.executor.wake()
        yield
