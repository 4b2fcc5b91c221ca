"""PolicyClient: call the flashrt_policy node's services and step it through its topics.

For planners, simulation harnesses, the demo driver and the tests. The client owns no
executor: give it a node that some executor spins in another thread (see `spin_in_thread`).
"""
import array
import threading
import time

from lifecycle_msgs.srv import ChangeState
from rclpy.executors import ExternalShutdownException
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from std_msgs.msg import Float32MultiArray

from flashrt_ros import msg as fmsg
from flashrt_ros.executors import (make_executor, publisher_events, ResponseDelivery,
                                   wait_set_race)
from flashrt_ros.interfaces import SERVICE_TYPES


class Spinner:
    """An executor (executors.make_executor: single-threaded; that module says why, or the
    one given) spinning `nodes` in a thread, until shutdown(). A callback that raises is
    logged and kept in `failures`, and spinning goes on: as in executors.run, an exception
    must not silently end the thread (every later call to the node would time out).
    rclpy's wait-set race (executors.wait_set_race: no callback involved) is only counted in
    `wait_set_races`."""

    def __init__(self, *nodes, executor=None):
        self.executor = executor or make_executor()
        self.failures, self.wait_set_races = [], 0
        self._logger = nodes[0].get_logger() if nodes else None
        self._stopping = threading.Event()
        for node in nodes:
            self.executor.add_node(node)
            ResponseDelivery(node)  # its services' responses, also to callers found late
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def _spin(self):
        while not self._stopping.is_set():
            try:
                self.executor.spin()
                return
            except ExternalShutdownException:
                return
            except Exception as exc:  # noqa: B902 - kept for the caller, spinning goes on
                if wait_set_race(exc):
                    self.wait_set_races += 1
                    continue
                self.failures.append(exc)
                if self._logger is not None:
                    self._logger.error(f'callback failed and was dropped: {exc!r}')

    def shutdown(self):
        """Stops spinning and joins the thread (a C++ thread left running aborts at exit)."""
        self._stopping.set()
        self.executor.shutdown()
        self.thread.join(timeout=5.0)


def spin_in_thread(*nodes, executor=None):
    """Starts a Spinner for `nodes`; call .shutdown() on it when done."""
    return Spinner(*nodes, executor=executor)


def wait_matched(publishers, subscriptions, deadline, problem):
    """Waits until every publisher has a subscriber and every subscription a publisher,
    matched on both sides (not only discovered in the graph: a first message could go to
    nobody); TimeoutError(problem) after `deadline` (time.monotonic())."""
    while not (all(p.get_subscription_count() for p in publishers) and
               all(s.get_publisher_count() for s in subscriptions)):
        if time.monotonic() > deadline:
            raise TimeoutError(problem)
        time.sleep(0.01)


def call_service(client, request, timeout):
    """One call from a node spun in another thread: (response, round-trip seconds), woken by
    the future's done callback (no polling); TimeoutError when no answer comes in time."""
    done = threading.Event()
    t0 = time.perf_counter()
    future = client.call_async(request)
    future.add_done_callback(lambda _: done.set())
    if not done.wait(timeout):
        raise TimeoutError(f'{client.srv_name} did not answer in {timeout} s')
    return future.result(), time.perf_counter() - t0


class PolicyClient:
    """Talks to one policy node, e.g. PolicyClient(node, '/flashrt_policy'); on a fleet node
    (sessions > 1) to one of its sessions: PolicyClient(node, '/flashrt_policy', session='s1')
    uses that session's topics and puts it in every service request that has a session."""

    def __init__(self, node, policy='/flashrt_policy', timeout=10.0, session=''):
        self.node = node
        self.policy = policy.rstrip('/')
        self.session = session
        self.timeout = timeout
        # service clients are made on first use: each is an entity that the executor's wait
        # set is rebuilt with on every wake (executors.py), so a planner that only restores
        # pays for one
        self._clients, self._clients_lock = {}, threading.Lock()
        qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10,
                         reliability=ReliabilityPolicy.RELIABLE)
        topics = f'{self.policy}/{session}' if session else self.policy
        self._obs_pub = node.create_publisher(Float32MultiArray, f'{topics}/observation', qos,
                                              event_callbacks=publisher_events())
        self._actions = []
        self._action_event = threading.Condition()
        # a deep reader queue: a busy client process must not drop actions a world in
        # lock-step produces as fast as the policy answers
        deep = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1000,
                          reliability=ReliabilityPolicy.RELIABLE)
        self._action_sub = node.create_subscription(Float32MultiArray, f'{topics}/action',
                                                    self._on_action, deep)
        self.last_status = None
        self._status_sub = node.create_subscription(fmsg.PolicyStatus, f'{self.policy}/status',
                                                    self._on_status, 10)

    def _on_action(self, msg):
        with self._action_event:
            self._actions.append(list(msg.data))
            self._action_event.notify_all()

    def _on_status(self, msg):
        self.last_status = msg

    def wait_ready(self, timeout=None, observation=True):
        """Waits until every service is offered and the action topic (and, unless
        observation is False, the observation topic) is connected. observation False: a
        node that assembles its observation from readings (observation_type terms, cameras)
        takes none on ~/observation."""
        deadline = time.monotonic() + (timeout or self.timeout)
        self.wait_services(deadline)
        topics = [self._obs_pub] if observation else []
        wait_matched(topics, [self._action_sub], deadline,
                     f'{" and ".join(t.topic_name for t in topics + [self._action_sub])} not '
                     'connected: is the policy node active?')

    def wait_services(self, deadline):
        """Waits until the node offers every service (in the ROS graph; a service's client,
        made at its first call, then waits for its own connection)."""
        for name in SERVICE_TYPES:
            while self.node.count_services(f'{self.policy}/{name}') == 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f'service {self.policy}/{name} did not appear')
                time.sleep(0.01)

    def service(self, name):
        """The client of service `name`, made at first use and waited for (a request sent
        before the client's endpoints are matched with the server's would be lost)."""
        with self._clients_lock:
            client = self._clients.get(name)
            if client is None:
                client = self.node.create_client(SERVICE_TYPES[name], f'{self.policy}/{name}')
                if not client.wait_for_service(timeout_sec=self.timeout):
                    self.node.destroy_client(client)
                    raise TimeoutError(f'service {self.policy}/{name} did not appear within '
                                       f'{self.timeout} s')
                self._clients[name] = client
            return client

    def close(self):
        """Destroys this client's service clients, publisher and subscriptions (the node
        stays)."""
        with self._clients_lock:
            for client in self._clients.values():
                self.node.destroy_client(client)
            self._clients.clear()
        self.node.destroy_publisher(self._obs_pub)
        for sub in (self._action_sub, self._status_sub):
            self.node.destroy_subscription(sub)

    def change_state(self, transition):
        """Asks the node for a lifecycle transition ('configure', 'activate', 'deactivate',
        'cleanup', 'shutdown') through its ~/change_state service, as `ros2 lifecycle set` and
        nav2's lifecycle manager do: the transition runs on the node's executor. True when it
        succeeded."""
        with self._clients_lock:
            client = self._clients.get('change_state')
            if client is None:
                client = self.node.create_client(ChangeState, f'{self.policy}/change_state')
                if not client.wait_for_service(timeout_sec=self.timeout):
                    self.node.destroy_client(client)
                    raise TimeoutError(f'service {self.policy}/change_state did not appear '
                                       f'within {self.timeout} s')
                self._clients['change_state'] = client
        request = ChangeState.Request()
        request.transition.label = transition
        return call_service(client, request, self.timeout)[0].success

    def call(self, service, **fields):
        """Calls a service with request fields; returns (response, round-trip seconds)."""
        request = SERVICE_TYPES[service].Request()
        if self.session and hasattr(request, 'session'):
            request.session = self.session
        for key, value in fields.items():
            setattr(request, key, value)
        return call_service(self.service(service), request, self.timeout)

    def step(self, observation):
        """Publishes one observation and waits for its action (a lock-step control loop)."""
        with self._action_event:
            seen = len(self._actions)
        msg = Float32MultiArray()
        msg.data = array.array('f', observation)
        self._obs_pub.publish(msg)
        with self._action_event:
            if not self._action_event.wait_for(lambda: len(self._actions) > seen,
                                               self.timeout):
                raise TimeoutError(f'no action on {self.policy}/action within '
                                   f'{self.timeout} s')
            return self._actions[seen]

    def publish_only(self, observation):
        """Publishes an observation without waiting (bad inputs get no action back)."""
        msg = Float32MultiArray()
        msg.data = array.array('f', observation)
        self._obs_pub.publish(msg)

    def actions_received(self):
        with self._action_event:
            return len(self._actions)

    def wait_actions(self, count):
        """The actions received so far, once there are at least `count` (TimeoutError after
        the client's timeout)."""
        with self._action_event:
            if not self._action_event.wait_for(lambda: len(self._actions) >= count,
                                               self.timeout):
                raise TimeoutError(f'{count} actions expected on {self.policy}/action, '
                                   f'{len(self._actions)} came')
            return list(self._actions)
