"""flashrt_policy under nav2_lifecycle_manager: the manager's bringup replayed in Python
against a real PolicyNode in-process (nav2 is not installable here: no ROS apt repository).

Transcribed from navigation2 (Humble to Jazzy; nav2_lifecycle_manager/src/
lifecycle_manager.cpp and nav2_util's LifecycleServiceClient):
- createLifecycleServiceClients(): a LifecycleServiceClient per name in node_names; its
  constructor blocks until <node>/get_state answers: while (!get_state_.wait_for_service(2s)).
- startup(): changeStateForAllNodes(TRANSITION_CONFIGURE), then (TRANSITION_ACTIVATE), node
  by node in node_names order; the first false aborts ("Failed to bring up all requested
  nodes. Aborting bringup."), with nothing rolled back.
- changeStateForNode(): change_state(transition): wait_for_service up to 5 s (else a
  runtime_error, which changeStateForAllNodes logs and turns into false), a request with
  transition.id only (no label), its answer awaited without a timeout (transition_timeout -1);
  then get_state() (2 s) must equal transition_state_map_[transition] (configure: inactive,
  activate: active), else "Failed to change state for node". After an activate,
  createBondConnection(): with bond_timeout > 0, a bond::Bond on topic "bond" with the node's
  name as id, and false unless it forms within bond_timeout / 2 (a heartbeat from the node).
- shutdown(): deactivate, cleanup, then unconfigured-shutdown (finalized), in reverse order.
"""
import os
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytestmark = pytest.mark.ros

from lifecycle_msgs.msg import State, Transition  # noqa: E402
from lifecycle_msgs.srv import ChangeState, GetState  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from flashrt_ros.client import call_service, spin_in_thread  # noqa: E402
from flashrt_ros.node import policy_node  # noqa: E402
from support.nodes import RECURRENT  # noqa: E402

CONFIGURE, ACTIVATE = Transition.TRANSITION_CONFIGURE, Transition.TRANSITION_ACTIVATE
STATE_AFTER = {CONFIGURE: State.PRIMARY_STATE_INACTIVE, ACTIVATE: State.PRIMARY_STATE_ACTIVE,
               Transition.TRANSITION_DEACTIVATE: State.PRIMARY_STATE_INACTIVE,
               Transition.TRANSITION_CLEANUP: State.PRIMARY_STATE_UNCONFIGURED,
               Transition.TRANSITION_UNCONFIGURED_SHUTDOWN: State.PRIMARY_STATE_FINALIZED}
WAIT_FOR_CHANGE_STATE = 5.0     # LifecycleServiceClient::change_state: 5000 ms
GET_STATE_TIMEOUT = 2.0         # LifecycleServiceClient::get_state: 2000 ms
TRANSITION_BOUND = 60.0         # the manager waits for the answer forever; a test must end
_names = iter(range(10 ** 6))


class LifecycleManager:
    """nav2_lifecycle_manager's startup and shutdown, as the module docstring transcribes
    them; `log` gathers its error messages."""

    def __init__(self, node, node_names, bond_timeout=4.0):
        self.node, self.node_names, self.bond_timeout = node, node_names, bond_timeout
        self.clients, self.log = {}, []

    def create_clients(self):
        for name in self.node_names:
            get_state = self.node.create_client(GetState, f'{name}/get_state')
            while not get_state.wait_for_service(timeout_sec=2.0):
                self.node.get_logger().info(f'Waiting for service {name}/get_state...')
            self.clients[name] = (self.node.create_client(ChangeState, f'{name}/change_state'),
                                  get_state)

    def startup(self):
        if not (self.change_all(CONFIGURE) and self.change_all(ACTIVATE)):
            self.log.append('Failed to bring up all requested nodes. Aborting bringup.')
            return False
        return True

    def shutdown(self):
        for transition in (Transition.TRANSITION_DEACTIVATE, Transition.TRANSITION_CLEANUP,
                           Transition.TRANSITION_UNCONFIGURED_SHUTDOWN):
            self.change_all(transition)

    def change_all(self, transition):
        forward = transition in (CONFIGURE, ACTIVATE)
        for name in self.node_names if forward else reversed(self.node_names):
            try:
                if not self.change_node(name, transition):
                    return False
            except RuntimeError as exc:
                self.log.append(f'Failed to change state for node: {name}. Exception: {exc}.')
                return False
        return True

    def change_node(self, name, transition):
        change_state = self.clients[name][0]
        if not change_state.wait_for_service(timeout_sec=WAIT_FOR_CHANGE_STATE):
            raise RuntimeError('change_state service is not available!')
        request = ChangeState.Request()
        request.transition.id = transition
        if not self._call(change_state, request, TRANSITION_BOUND).success or \
                self.get_state(name) != STATE_AFTER[transition]:
            self.log.append(f'Failed to change state for node: {name}')
            return False
        return self.bond(name) if transition == ACTIVATE else True

    def get_state(self, name):
        get_state = self.clients[name][1]
        if not get_state.wait_for_service(timeout_sec=GET_STATE_TIMEOUT):
            raise RuntimeError('get_state service is not available!')
        return self._call(get_state, GetState.Request(), GET_STATE_TIMEOUT).current_state.id

    def bond(self, name):
        """createBondConnection(), but for the heartbeat itself: bond/msg/Status is not
        installable here, so 'formed' is read as 'the node publishes on /bond at all' (a node
        with no bond publisher can never form one)."""
        if self.bond_timeout <= 0.0:
            return True
        deadline = time.monotonic() + self.bond_timeout / 2
        while time.monotonic() < deadline:
            if self.node.count_publishers('/bond'):
                return True
            time.sleep(0.05)
        self.log.append(f'Server {name} was unable to be reached after '
                        f'{self.bond_timeout:.2f}s by bond. This server may be misconfigured.')
        return False

    @staticmethod
    def _call(client, request, timeout):
        try:
            return call_service(client, request, timeout)[0]
        except TimeoutError as exc:     # nav2's ServiceClient::invoke throws a runtime_error
            raise RuntimeError(str(exc)) from exc


@pytest.fixture
def bringup(ros, tmp_path):
    """bringup(autostart, bond_timeout): a PolicyNode spun as main() spins it (after main's
    autostart, when set), and a LifecycleManager for it on a node of its own."""
    spinners, nodes = [], []

    def start(autostart, bond_timeout=0.0):
        name = f'flashrt_policy_lm{next(_names)}_{os.getpid()}'
        params = dict(RECURRENT, device='cpu', capsule_dir=str(tmp_path / name),
                      autostart=autostart)
        node = policy_node.PolicyNode(
            name, parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
        nodes.append(node)
        if autostart:       # what main() does before it spins
            assert policy_node._autostart(node)
        manager_node = rclpy.create_node(f'lifecycle_manager_lm{next(_names)}_{os.getpid()}')
        nodes.append(manager_node)
        spinners.extend([spin_in_thread(node), spin_in_thread(manager_node)])
        manager = LifecycleManager(manager_node, [name], bond_timeout=bond_timeout)
        manager.create_clients()
        return node, manager

    yield start
    for spinner in spinners:
        spinner.shutdown()
    for node in nodes:
        node.destroy_node()


def _state(node):
    return node._state_machine.current_state[1]


def test_manager_brings_up_and_shuts_down_the_node_with_autostart_false(bringup):
    """The documented setup: the node's autostart false, the manager's bond off."""
    node, manager = bringup(autostart=False)
    assert _state(node) == 'unconfigured'
    assert manager.startup(), manager.log
    assert _state(node) == 'active' and node.state == 'active'
    assert manager.get_state(node.get_name()) == State.PRIMARY_STATE_ACTIVE
    manager.shutdown()
    assert not manager.log, manager.log
    assert _state(node) == 'finalized' and node.engine is None


def test_manager_bringup_fails_when_the_node_started_itself(bringup, capfd):
    """autostart true (the node's default) under a manager: its configure finds the node
    active and is refused, and the manager aborts. No answer of the node could save it: the
    manager checks get_state after its configure and wants inactive, so the node refuses
    honestly, stays active and serving, and says what to change."""
    node, manager = bringup(autostart=True)
    assert not manager.startup()
    name = node.get_name()
    assert manager.log == [f'Failed to change state for node: {name}',
                           'Failed to bring up all requested nodes. Aborting bringup.']
    assert _state(node) == 'active' and node.engine is not None
    err = capfd.readouterr().err
    assert 'change_state refused: transition id 1' in err, err
    assert 'a lifecycle manager needs autostart false on this node' in err, err


def test_manager_bond_above_zero_fails_the_bringup(bringup):
    """The manager's default bond_timeout (4.0 s): the node forms no bond, so the bringup
    fails bond_timeout / 2 after its activate; hence bond_timeout: 0.0 in the setup."""
    node, manager = bringup(autostart=False, bond_timeout=4.0)
    assert not manager.startup()
    assert 'was unable to be reached after 4.00s by bond' in manager.log[0], manager.log
    assert _state(node) == 'active'     # the manager rolls nothing back
