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
