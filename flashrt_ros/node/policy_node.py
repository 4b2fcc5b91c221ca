"""The flashrt_policy lifecycle node: lifecycle and composition, nothing else.

configure: typed settings (settings.py), the PolicyEngine (policy, state arena, step graph),
and the parts that serve it: RobotIO (topics), a SessionGuard per session (poison hold,
recover, checkpoints, restore_on_start), the ControlLoop (the one tick path), the Report
(status and diagnostics). activate: subscriptions and timers, a pinned 'episode_start' capsule,
the control thread. deactivate/cleanup/shutdown release them in reverse order.

Threads: whatever executor spins the node runs the capsule services, parameter changes,
lifecycle transitions and status; the control callback group (readings and control timers)
runs only on the node's own control thread (executors.ControlThread), so a busy planner
never queues the control tick behind its calls; camera frames are decoded on a camera thread
of the same kind. One lock orders them: a capsule operation or a transition never
interleaves with a tick, nor a frame's entry into the observation.

With `sessions` > 1 the node serves a fleet: one policy state per session, stepped together in
one graph replay per tick, each session's topics under ~/<session name>/, and the capsule
services addressed by their `session` field. A single-session node is a fleet of one.

main(): `autostart` configures and activates the node (a failure exits 1). Under a lifecycle
manager set it false: nav2_lifecycle_manager (node_names [flashrt_policy], autostart true)
configures then activates by id, checks get_state after each and aborts the whole bringup at
the first failure (a self-activated node refuses the configure); after the activate it awaits
a bond for bond_timeout / 2, and this node forms none: give it bond_timeout 0.0 (see
test/ros/test_lifecycle_manager.py). SIGINT, SIGTERM: shutdown transition, exit 0 (executors).
"""
from dataclasses import dataclass
from functools import partial
import sys
import threading

from diagnostic_msgs.msg import DiagnosticArray
from lifecycle_msgs.msg import Transition
import rclpy
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn

from flashrt_ros import msg as fmsg
from flashrt_ros.executors import ControlGroup, ControlThread, publisher_events, run, \
    set_process_priority
from flashrt_ros.node.capsule_services import CapsuleServices
from flashrt_ros.node.control_loop import ControlLoop
from flashrt_ros.node.diagnostics import Report
from flashrt_ros.node.guard import SessionGuard
from flashrt_ros.node.bundle_parameters import apply_bundle
from flashrt_ros.node.parameters import ParameterHandler
from flashrt_ros.node.robot_io import RobotIO
from flashrt_ros.node.settings import build_engine, load_settings
from flashrt_ros.runtime.engine import EPISODE_START
from flashrt_ros.runtime.errors import FlashRTError

GIL_SWITCH_INTERVAL = 0.0005  # s: see main()
_CHECKPOINT_SETTINGS = ('checkpoint_every', 'checkpoint_keep', 'checkpoint_to_disk')


@dataclass
class Configured:
    """What one configure built; dropped whole at cleanup (that frees the arena and graphs)."""

    settings: object
    engine: object
    robot: RobotIO
    guards: list
    loop: ControlLoop


class PolicyNode(LifecycleNode):
    """Lifecycle node `flashrt_policy`: see the module docstring."""

    def __init__(self, node_name='flashrt_policy', **kwargs):
        super().__init__(node_name, **kwargs)
        # Every transition, capsule operation and control callback runs under this lock,
        # whatever thread calls it: none sees half a configure or a cleared engine, and no
        # capsule operation interleaves with a tick. Callbacks made for one activation do
        # nothing after it (_activations).
        self.lock = threading.RLock()
        self.state = 'unconfigured'
        self.parts = None               # Configured, while configured
        self._resumed = False           # restore_on_start restored a session at configure
        self.report = Report(self.get_logger(), self.get_fully_qualified_name())
        self.parameter_handler = ParameterHandler(self, self.lock)
        self.parameter_handler.on_update('status_period', self._restart_status_timer)
        for name in _CHECKPOINT_SETTINGS:
            self.parameter_handler.on_update(name, self._checkpoint_settings_changed)
        self.parameter_handler.on_update('instruction', self._instruction_changed)
        self._activations = 0
        self._control_group, self._camera_group = ControlGroup(), ControlGroup()
        self._control = ControlThread(self, self._control_group)
        self._cameras = ControlThread(self, self._camera_group, 'cameras')
        self._timers = []               # control timers (control group)
        self._status_timer = self.status_pub = self.diagnostics_pub = None
        self.capsule_services = CapsuleServices(
            self.get_name(), self.get_logger(), self.lock, lambda: self.parts,
            lambda: self.state, self.create_service, ReentrantCallbackGroup())
        # rclpy (Jazzy) serves a change_state request by transition id that the current state
        # does not offer (configure while active) by raising RCLError out of the callback: the
        # caller never gets an answer. Refuse it with success=False first.
        service = self._service_change_state
        service.callback = partial(self._change_state_checked, service.callback)

    def _change_state_checked(self, serve, request, response):
        transition = request.transition
        offered = {t[0]: t[1] for t in self._state_machine.available_transitions}
        if not transition.label and transition.id not in offered:
            # what a lifecycle manager meets when the node started itself (module docstring)
            hint = '; a lifecycle manager needs autostart false on this node' if \
                transition.id == Transition.TRANSITION_CONFIGURE and \
                self.get_parameter('autostart').value else ''
            self.get_logger().warning(
                f'change_state refused: transition id {transition.id} is not available in '
                f'state {self.state!r} (available: {offered or "none"}){hint}')
            response.success = False
            return response
        return serve(request, response)

    @property
    def engine(self):
        return self.parts.engine if self.parts is not None else None

    @property
    def settings(self):
        return self.parts.settings if self.parts is not None else None

    # -- lifecycle -----------------------------------------------------------------------------

    def on_configure(self, state):
        with self.lock:
            try:
                self._configure()
            except Exception as exc:  # noqa: B902 - rclpy would swallow it without a word
                self.get_logger().error(f'configure failed: {exc}')
                self._release_configured()
                return TransitionCallbackReturn.FAILURE
            self.state = 'inactive'
            return TransitionCallbackReturn.SUCCESS

    def _configure(self):
        apply_bundle(self, self.parameter_handler)
        settings = load_settings(self)
        # capsule stamps on the node's clock: sim time under use_sim_time
        engine = build_engine(settings, clock=lambda: self.get_clock().now().nanoseconds * 1e-9)
        self.report.reset()
        robot = RobotIO(settings, engine.session_names, now=self._now,
                        create_publisher=self._publisher,
                        destroy_publisher=self.destroy_lifecycle_publisher,
                        create_subscription=self.create_subscription,
                        destroy_subscription=self.destroy_subscription,
                        on_lost=self.report.readings_lost,
                        chunks=getattr(engine.policy, 'gives_chunks', False))
        log = self.get_logger()
        guards = []     # filled below: each guard tells the loop when it replaced a state
        loop = ControlLoop(engine, settings, robot, guards, self.report, log)
        # from here on a failure releases what was made (_release_configured)
        self.parts = Configured(settings, engine, robot, guards, loop)
        self.status_pub = self._publisher(fmsg.PolicyStatus, '~/status', 10)
        self.diagnostics_pub = self._publisher(DiagnosticArray, '/diagnostics', 10)
        guards += [SessionGuard(engine, i, settings, log, loop.state_replaced)
                   for i in range(engine.sessions)]
        self.report.determinism(engine)
        self._resumed = any([g.resume(settings.node.restore_on_start) for g in guards])
        self.parameter_handler.settings = settings
        log.info(f'configured: {settings.node.policy_type} policy on {engine.device}, cuda '
                 f'graph {"captured" if engine.graph_captured else "off (eager)"}, state '
                 f'{engine.arena.storage.numel()} bytes, capsules in {engine.store.directory}')

    def on_activate(self, state):
        with self.lock:
            self._activate()
        cfg = self.parts.settings.node
        set_process_priority(cfg.process_priority, self.get_logger())
        self._control.start(cfg.control_priority)
        if self.parts.loop.cameras is not None:
            self._cameras.start()
        return super().on_activate(state)

    def _activate(self):
        parts, cfg = self.parts, self.parts.settings.node
        self._activations += 1          # callbacks of an earlier activation go quiet
        parts.robot.counter.reset()   # a gap spanning the inactive time lost nothing
        parts.robot.subscribe(parts.loop, self._control_group, self._guarded,
                              self._camera_group)
        parts.loop.state_replaced()
        if parts.settings.lockstep and len(parts.guards) > 1:
            self._timers.append(self.create_timer(
                cfg.lockstep_wait / 4, self._guarded(parts.loop.lockstep_deadline,
                                                     'lock-step deadline'),
                callback_group=self._control_group))
        if parts.settings.readings and cfg.control_mode == 'timer':
            self._timers.append(self.create_timer(
                1.0 / cfg.control_rate, self._guarded(parts.loop.timer_tick, 'control'),
                callback_group=self._control_group))
        self._restart_status_timer(cfg.status_period)
        self._pin_episode_start(parts)
        self.state = 'active'

    def _pin_episode_start(self, parts):
        engine = parts.engine
        if EPISODE_START in engine.store or self._resumed:
            return      # kept across deactivate/activate; a resumed process keeps its own
        try:
            # every session starts from the same initial state: session 0's is it
            self.get_logger().info(engine.snapshot(EPISODE_START, pin=True, session=0).message)
        except FlashRTError as exc:   # e.g. zero budgets: run on, reset uses the initial state
            self.get_logger().warning(f'no {EPISODE_START!r} capsule: {exc}; reset_episode '
                                      'will start from the initial state')
            return
        if parts.settings.node.checkpoint_to_disk:
            try:
                engine.save(EPISODE_START)
            except FlashRTError as exc:   # e.g. an unwritable capsule_dir: memory still has it
                self.get_logger().warning(f'{EPISODE_START!r} is kept in memory (reset_episode '
                                          f'uses it) but not on disk: {exc}')

    def _stop_threads(self):            # first: a callback in progress may wait on the lock
        self._control.stop()
        self._cameras.stop()

    def on_deactivate(self, state):
        self._stop_threads()
        with self.lock:
            self.state = 'inactive'
            self._release_active()
            return super().on_deactivate(state)

    def on_cleanup(self, state):
        return self._tear_down('unconfigured')

    def on_shutdown(self, state):
        result = self._tear_down('finalized')
        self.get_logger().info(f'shutdown from {state.label}: engine, topics and timers '
                               'released')
        return result

    def _tear_down(self, final_state):
        self._stop_threads()
        with self.lock:
            self._release_active()
            self._release_configured()
            self.state = final_state
            return TransitionCallbackReturn.SUCCESS

    def destroy_node(self):
        self._stop_threads()
        super().destroy_node()

    def _release_active(self):
        if self.parts is not None:
            self.parts.robot.unsubscribe()
        for timer in self._timers + [self._status_timer]:
            if timer is not None:
                self.destroy_timer(timer)
        self._timers, self._status_timer = [], None

    def _release_configured(self):
        for pub in (self.status_pub, self.diagnostics_pub):
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        self.status_pub = self.diagnostics_pub = None
        if self.parts is not None:
            self.parts.robot.release()
        self.parts = self.parameter_handler.settings = None    # frees the arena and graphs

    # -- what the parts are given --------------------------------------------------------------

    def _publisher(self, msg_type, topic, qos):
        return self.create_lifecycle_publisher(msg_type, topic, qos,
                                               event_callbacks=publisher_events())

    def _now(self):
        return self.get_clock().now().to_msg()

    def _guarded(self, callback, what):
        """`callback` as the node runs it: under the lock, only while active and only for the
        activation that made it (a message taken before a cleanup must not step the next
        configure's engine). An exception is logged and counted (diagnostics), never raised
        into the executor: that would end its spin thread, and the node with it."""
        activation = self._activations

        def guarded(*args):
            with self.lock:
                if self.state != 'active' or activation != self._activations:
                    return
                try:
                    callback(*args)
                except Exception as exc:  # noqa: B902 - a callback must never kill the node
                    self.report.callback_failed(what, exc)
        return guarded

    def _instruction_changed(self, text):   # every session's, as on its ~/instruction
        for s, readings in zip(self.parts.loop.sessions, self.parts.loop.cameras or ()):
            # '' too (the parameter says what runs); a held lock-step may go on
            if readings.on_instruction(s, text) and self.state == 'active':
                self.parts.loop.on_reading(s, 'instruction')

    def _checkpoint_settings_changed(self, _):
        for guard in self.parts.guards:
            guard.settings_changed()

    def _restart_status_timer(self, period):
        if self._status_timer is not None:
            self.destroy_timer(self._status_timer)
        self._status_timer = self.create_timer(period,
                                               self._guarded(self.publish_status, 'status'))

    # -- status --------------------------------------------------------------------------------

    def rejected_observations(self):
        return self.report.rejected_observations(self.engine)

    def status_message(self):
        parts = self.parts
        if parts is None:
            return self.report.status(self.state, self._now())
        return self.report.status(self.state, self._now(), parts.engine, parts.settings,
                                  parts.guards)

    def diagnostic(self, status):
        parts = self.parts
        return self.report.diagnostic(status, self.engine, parts.guards if parts else (),
                                      parts.robot.reading_ages() if parts else ())

    def publish_status(self):
        if self.parts is not None:
            self.parts.loop.resend_unheard()
        status = self.status_message()
        self.status_pub.publish(status)
        diagnostics = DiagnosticArray()
        diagnostics.header.stamp = status.header.stamp
        diagnostics.status = self.report.diagnostics(status, self.engine, self.parts.guards,
                                                     self.parts.robot.reading_ages())
        self.diagnostics_pub.publish(diagnostics)


def _autostart(node):
    """What nav2's lifecycle manager would do: configure, then activate, when `autostart` is
    set. False (a robot without its policy must not look alive) makes main exit 1."""
    if not node.get_parameter('autostart').value:
        return True
    if node.trigger_configure() == TransitionCallbackReturn.SUCCESS and \
            node.trigger_activate() == TransitionCallbackReturn.SUCCESS:
        return True
    node.get_logger().fatal('autostart failed (the reason is logged above); exiting with '
                            'status 1')
    return False


def main(args=None):
    # Python hands the GIL to a waiting thread only after the holder ran this long (default
    # 5 ms): the control thread, woken by an observation while a service call runs Python on
    # the executor's thread, waited up to that long for it. 0.5 ms (measured with
    # benchmarks/starvation.py; see the README) bounds that wait for a small cost in switches.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    rclpy.init(args=args)
    # The executor of executors.make_executor spins services, parameters and status; the
    # control group spins on the node's own control thread.
    run(PolicyNode(), startup=_autostart)


if __name__ == '__main__':
    main()
