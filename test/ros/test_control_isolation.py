"""The control path is isolated from the executor that spins the node.

Readings and control timers run on the node's own control thread (executors.ControlThread);
services, parameters and status run on whatever executor spins the node. A callback that holds
that executor (a slow service, a planner's flood of calls, a user's own timer on the same
node) therefore never delays an action. Before the redesign one executor ran both, and these
observations waited behind it.
"""
import threading
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytestmark = pytest.mark.ros

from support.common import obs_range  # noqa: E402


def test_actions_flow_while_the_node_executor_is_blocked(make):
    h = make()
    observations = obs_range(0, 20)
    ref = h.reference(observations)
    assert h.steps(observations[:5]) == ref[:5]
    # A callback of the node's own executor that does not return for 3 s. (Nothing of the
    # control path may wait on it; it takes no lock of the node.)
    entered, release = threading.Event(), threading.Event()

    def hog():
        entered.set()
        release.wait(3.0)
    timer = h.node.create_timer(0.01, hog)
    try:
        assert entered.wait(10), 'the blocking callback never ran'
        timer.cancel()
        started = time.monotonic()
        got = h.steps(observations[5:15])       # each waits for its action
        took = time.monotonic() - started
        assert not release.is_set() and took < 2.5, \
            f'10 actions took {took:.2f} s while the executor was blocked'
        assert got == ref[5:15]                 # and they are the right ones, in order
        # the steps ran on the control thread, not the blocked executor's
        control = [t for t in threading.enumerate() if t.name == f'{h.name} control']
        assert len(control) == 1 and h.node._control_group.thread_id == control[0].ident
    finally:
        release.set()
        h.node.destroy_timer(timer)
    # services answer again once the executor is free
    assert h.call('snapshot', name='after').success


def test_deactivate_stops_the_control_thread_and_activate_starts_it(make):
    h = make()
    name = f'{h.name} control'
    assert [t.name for t in threading.enumerate()].count(name) == 1
    h.deactivate()
    assert name not in [t.name for t in threading.enumerate()]
    h.activate()
    assert [t.name for t in threading.enumerate()].count(name) == 1
    observations = obs_range(0, 3)
    assert h.steps(observations) == h.reference(observations)


def test_stop_wakes_the_control_thread_at_once(ros):
    """stop() (every deactivate, cleanup and Ctrl-C) ends the control thread's wait itself:
    with a one-minute poll, only the wake-up can end it within the test's 20 s."""
    from flashrt_ros.executors import ControlGroup, ControlThread
    node = rclpy.create_node(f'control_stop_{id(object())}')
    try:
        thread = ControlThread(node, ControlGroup())
        thread.poll_s = 60.0
        thread.start()
        time.sleep(0.2)     # let it enter its wait (an earlier stop would not test the wake)
        done = threading.Event()
        threading.Thread(target=lambda: (thread.stop(), done.set()), daemon=True).start()
        assert done.wait(20.0), 'stop() waited for the control thread\'s poll'
    finally:
        node.destroy_node()
