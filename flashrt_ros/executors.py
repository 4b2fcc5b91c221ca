"""How flashrt_ros spins: one executor choice for the nodes, the clients and the benchmarks,
one main loop for the executables, and the control thread of the policy node.

rclpy's SingleThreadedExecutor, everywhere. Tried and not kept:
- MultiThreadedExecutor (Jazzy) kept cores busy spinning once services had been called (the
  demo took 60 s instead of 2.5 s), starving the control loop on a small machine; steps and
  capsule operations meet at the engine's lock anyway.
- rclpy.experimental.EventsExecutor (rclpy 7.1.6): an idle Trigger server spun at ~56 % of a
  core, and a client spinning it in a thread never saw its service answered (60 s timeouts,
  2026-11-29, this repository's CPU VM), consistent with the Jazzy events-executor CPU
  regression reported upstream (ros2/rclcpp#2799). Revisit with a later rclpy.

Every wake of rclpy's executors rebuilds the wait set in Python, at a few microseconds per
entity (services, timers, subscriptions, and the QoS-event handlers that rclpy gives every
publisher and subscription by default: two waitables each). On a service round trip that is
paid on both sides; see `publisher_events`.
"""
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
import warnings

import rclpy
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.event_handler import PublisherEventCallbacks
from rclpy.exceptions import InvalidHandle
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy
from rclpy.lifecycle import LifecycleNode
from rclpy.signals import uninstall_signal_handlers

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def make_executor():
    """The executor every flashrt_ros node and client spins on (see the module's note)."""
    return SingleThreadedExecutor()


def publisher_events():
    """Event callbacks for flashrt_ros's publishers: none of rclpy's default handlers.

    The two default handlers (incompatible QoS, incompatible type) were 6 of the policy
    node's 10 waitables, the most costly entities of its wait set (py-spy on a ~/restore
    loop). The report is not lost: the subscriber of an incompatible pairing logs it on its
    side (rclpy and rclcpp do by default, and flashrt_ros's subscriptions keep their
    handlers).
    """
    return PublisherEventCallbacks(use_default_callbacks=False)


def wait_set_race(exc):
    """True for rclpy's (7.1, Jazzy) race in building the wait set: an entity destroyed by
    another thread (a lifecycle transition on a worker of a multi-threaded executor, or a
    trigger_* call) between the executor's check of a QoS-event waitable and its
    add_to_wait_set raises InvalidHandle out of spin(). No callback ran and nothing was
    taken: spinning again rebuilds the wait set without it."""
    frames = traceback.extract_tb(exc.__traceback__)
    return isinstance(exc, InvalidHandle) and bool(frames) and \
        frames[-1].name == 'add_to_wait_set'


# rclpy's words (7.1, Jazzy) for a response that rmw_fastrtps did not send: its server waits
# 100 ms for its response writer to match the caller's response reader, then drops the
# response (RMW_RET_TIMEOUT) and rclpy only warns. On a loaded machine a new caller's reader
# is discovered later than that, and the caller waits for an answer that never comes
# (ros2/rmw_fastrtps#390; seen here as a 60 s timeout of ~/reset_episode in the G1 test).
_RESPONSE_DROPPED = 'failed to send response (timeout)'


class ResponseDelivery:
    """Every response of `node`'s services delivered, even to a caller discovered late: a
    response that rmw_fastrtps dropped is sent again from a thread of its own (the executor
    goes on) until the caller's reader has matched, or `deadline_s` has passed (logged as an
    error). Wraps the services the node has now (the lifecycle and parameter ones too).

    rclpy reports the drop only as a RuntimeWarning. A warnings filter turns that one warning
    into an error, which reaches send_response's caller as a SystemError caused by it (the
    binding ignores the warning's status). A filter is read, never changed, by each call:
    thread-safe, unlike warnings.catch_warnings."""

    def __init__(self, node, deadline_s=10.0):
        warnings.filterwarnings('error', message=re.escape(_RESPONSE_DROPPED),
                                category=RuntimeWarning)
        self.deadline_s, self._log = deadline_s, node.get_logger()
        self.late = self.lost = 0   # responses delivered after a drop; given up on
        for service in node.services:
            if not getattr(service, 'flashrt_delivery', None):
                service.flashrt_delivery = self
                service.send_response = self._sender(service.srv_name, service.send_response)

    def _sender(self, name, send):
        def send_response(response, header):
            if not _dropped(send, response, header):
                return
            threading.Thread(target=self._resend, args=(name, send, response, header),
                             daemon=True, name=f'{name} response').start()
        return send_response

    def _resend(self, name, send, response, header):
        start = time.monotonic()
        while time.monotonic() - start < self.deadline_s:
            try:
                if not _dropped(send, response, header):    # each try waits up to 100 ms
                    self.late += 1
                    self._log.warning(f'{name}: response delivered after '
                                      f'{time.monotonic() - start:.2f} s more: the caller was '
                                      'discovered late')
                    return
            except InvalidHandle:   # the service is gone (node destroyed)
                return
            time.sleep(0.01)
        self.lost += 1
        self._log.error(f'{name}: response lost: the caller\'s response reader did not match '
                        f'in {self.deadline_s} s (a client with an incompatible QoS?)')


def _dropped(send, response, header):
    """send(response, header); True when rmw dropped the response (see ResponseDelivery)."""
    try:
        send(response, header)
    except SystemError as exc:
        if _RESPONSE_DROPPED in str(exc.__cause__):
            return True
        raise
    except RuntimeWarning as exc:   # a binding that raises the warning itself
        if _RESPONSE_DROPPED in str(exc):
            return True
        raise
    return False


def run(node, startup=None):
    """The executables' main loop: spin `node` until SIGINT or SIGTERM (or until rclpy is shut
    down), then finalize it and exit the process.

    startup(node) -> bool runs first (e.g. autostart's configure + activate); False exits
    with status 1, so launch, systemd and CI see a node that cannot work. A signal ends the
    process with status 0. A lifecycle node leaves through its shutdown transition, whatever
    ended the loop (finalize). A callback that raises is logged and dropped: it must never
    take the robot down.
    """
    executor = make_executor()
    executor.add_node(node)
    ResponseDelivery(node)
    stop = stop_on_signals(node)
    status = 1      # if startup raises
    try:
        status = 0 if startup is None or startup(node) else 1
        while status == 0 and rclpy.ok() and not stop.is_set():
            try:
                executor.spin_once()    # returns after each callback, the stop's one too
            except (KeyboardInterrupt, ExternalShutdownException):
                break
            except Exception as exc:  # noqa: B902 - a callback must never take the robot down
                if wait_set_race(exc):
                    node.get_logger().debug(f'wait set rebuilt after a destroy race: {exc!r}')
                else:
                    node.get_logger().error(f'callback failed and was dropped: {exc!r}')
    finally:
        stop.set()      # a signal taken from here on only logs (the guard goes with the node)
        if threading.current_thread() is threading.main_thread():
            # signals from here on are ignored by the kernel: Python's finalization resets
            # its own handlers to the default (terminate) but leaves SIG_IGN alone
            for signum in STOP_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
        finalize(node)
        node.destroy_node()
        executor.shutdown()
        if rclpy.ok():
            rclpy.try_shutdown()
    sys.exit(status)


def stop_on_signals(node):
    """An Event that the first SIGINT or SIGTERM sets; run() spins until it is set.

    rclpy's handlers (rclpy.init installs them) shut the context down at once and raise
    KeyboardInterrupt in the main thread: the node had no context left for its shutdown
    transition, and the second SIGINT of a Ctrl-C under `ros2 launch` (the terminal signals
    the whole process group, and launch, when its stdin is not a terminal, forwards one more)
    raised KeyboardInterrupt again in the middle of run()'s cleanup, with a traceback. These
    handlers only set the event, and run() ignores later signals (launch escalates to
    SIGKILL if the shutdown hangs).

    Python runs a signal handler in the main thread only, between bytecodes, never while the
    executor waits in rcl_wait: so the Python handlers do nothing, and a thread reading the
    wakeup fd (written by Python's C-level handler as the signal arrives, on any thread) sets
    the event and triggers a guard condition of the node, whose (empty) callback returns the
    executor's spin_once. (Executor.wake() would not: it only has the wait set rebuilt; and
    spin_until_future_complete adds a callback to its future at every spin_once.) Signals
    belong to the main thread: called from another one (a test), the event is never set.
    """
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return stop
    wake = node.create_guard_condition(lambda: None)
    # rclpy's: rclpy.shutdown would otherwise put back what they replaced (KeyboardInterrupt)
    uninstall_signal_handlers()
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda *_: None)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch(sockets=(reader, writer)):    # the sockets live as long as the thread
        log = node.get_logger()
        while True:
            for signum in sockets[0].recv(64):
                name = signal.Signals(signum).name
                if stop.is_set():
                    log.debug(f'{name} ignored: already shutting down')
                else:
                    log.info(f'{name}: shutting down')
                    stop.set()
                    try:
                        wake.trigger()
                    except InvalidHandle:   # run() ended meanwhile and destroyed the node
                        pass

    threading.Thread(target=watch, daemon=True, name='stop signals').start()
    return stop


def finalize(node):
    """Takes a lifecycle node through its shutdown transition from the primary state it is in
    (rclpy does not when a node is destroyed): on_shutdown releases what the node holds, and a
    lifecycle manager or `ros2 lifecycle` sees it finalized. Nothing for a plain node, nor for
    one already finalized or whose context is gone (its transition could not be published)."""
    if not isinstance(node, LifecycleNode) or not node.context.ok():
        return
    try:
        node.trigger_shutdown()
    except _rclpy.RCLError as exc:      # finalized already: no shutdown transition from there
        node.get_logger().debug(f'no shutdown transition: {exc}')


class ControlGroup(MutuallyExclusiveCallbackGroup):
    """A callback group that only its ControlThread runs.

    rclpy asks a callback group whether an executor may run each of its entities, both when
    the executor gathers its wait set and before each call. This group answers yes only on
    its control thread: whatever executor spins the node (main()'s, a test's, a component
    container's, single- or multi-threaded) never waits on, takes or runs the control
    entities, so the control tick is never queued behind service calls, parameter changes
    or status on that executor.
    """

    def __init__(self):
        super().__init__()
        self.thread_id = None

    def can_execute(self, entity):
        return threading.get_ident() == self.thread_id and super().can_execute(entity)


class _GroupExecutor(SingleThreadedExecutor):
    """A single-threaded executor over one callback group of one node. The node is not added
    (add_node would take it from the executor that spins the rest of it): get_nodes names
    it, and can_execute keeps the wait set to the group."""

    def __init__(self, node, group):
        super().__init__(context=node.context)
        self._node, self._group = node, group

    def get_nodes(self):
        return [self._node]

    def can_execute(self, entity):
        return entity.callback_group is self._group and super().can_execute(entity)


def _sched_fifo(threads, priority, log, who, applied):
    """The threads that threads() lists (0: the calling one) under SCHED_FIFO at `priority`;
    logs `applied`, or, refused (or no /proc to list them), that `who` runs on the default
    scheduler and why. Returns whether it was applied."""
    try:
        for tid in threads():
            os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(priority))
    except (OSError, AttributeError) as exc:
        log.warning(f'{who}: could not enable SCHED_FIFO priority {priority} ({exc}); running '
                    'on the default scheduler. Grant CAP_SYS_NICE or an rtprio limit to the '
                    'user.')
        return False
    log.info(applied)
    return True


def set_process_priority(priority, log):
    """Every thread of this process (rclpy's executor, Fast DDS's reception and event threads,
    and those they start later, which inherit it) under SCHED_FIFO at `priority`; 0 does
    nothing. Measured why (benchmarks/results/*-cpu-starvation-*): on a saturated machine a
    service thread that holds the GIL and is preempted by other processes stalls the control
    thread behind it; at a real-time priority nothing of the default scheduler preempts it.
    Returns whether it was applied."""
    if not priority:
        return False
    return _sched_fifo(lambda: [int(tid) for tid in os.listdir('/proc/self/task')], priority,
                       log, 'process_priority',
                       f'process_priority: every thread under SCHED_FIFO priority {priority}')


class ControlThread:
    """Spins `group` (a ControlGroup) of `node` on a thread of its own, named after the node
    and `role`, from start() until stop(). Create the group's entities before start() and
    destroy them after stop(): the node wakes only the executor it was added to, so this
    thread would not see a change to its wait set until its next wake (at most poll_s)."""

    def __init__(self, node, group, role='control'):
        self._node, self._group, self.role = node, group, role
        self._executor = self._thread = self._wake = None
        self._stopping = False
        self.priority = 0
        self.poll_s = 0.5     # a safety net only: stop() and shutdown wake the thread

    def start(self, priority=0):
        """priority: 1-99 runs the thread under SCHED_FIFO at that priority (0: the default
        scheduler), so that other processes on a busy machine do not delay a tick."""
        self._stopping, self.priority = False, priority
        # in the control group, so that stop() ends this thread's wait at once (the executor's
        # wake() does not end a wait: the thread would see _stopping only at its 0.5 s poll,
        # and every deactivate, cleanup and Ctrl-C would wait for it)
        self._wake = self._node.create_guard_condition(lambda: None, callback_group=self._group)
        self._executor = _GroupExecutor(self._node, self._group)
        self._thread = threading.Thread(target=self._spin, daemon=True,
                                        name=f'{self._node.get_name()} {self.role}')
        self._thread.start()

    def _spin(self):
        self._group.thread_id = threading.get_ident()
        log = self._node.get_logger()
        if self.priority:   # this thread only: on Linux, pid 0 is the calling thread
            _sched_fifo(lambda: [0], self.priority, log, f'{self.role} thread',
                        f'{self.role} thread: SCHED_FIFO priority {self.priority}')
        while not self._stopping and self._node.context.ok():
            try:
                self._executor.spin_once(timeout_sec=self.poll_s)
            except ExternalShutdownException:
                break
            except Exception as exc:  # noqa: B902 - the control thread must outlive a callback
                if not wait_set_race(exc):
                    log.error(f'{self.role} callback failed and was dropped: {exc!r}')

    def stop(self):
        """Ends the thread after the callback in progress, if any (never call it from the
        control thread itself)."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake.trigger()
        self._thread.join()
        self._group.thread_id = None
        self._executor.shutdown()
        self._node.destroy_guard_condition(self._wake)
        self._executor = self._thread = self._wake = None
