"""How a step reaches a policy node from outside: the links the episode runner steps through.

observation_link(client)  a flat world: its observation on the node's ~/observation, the
                          ~/action back (PolicyClient.step)
RobotLink                 an in-process RobotWorld: its readings on the node's joint_states
                          and imu, ~/action and ~/joint_commands back
request_actions(pairs)    one control step of several (RobotLink, RobotWorld) pairs at once
BatchedLink               flat worlds on the sessions of fleet nodes: one [sessions, obs_dim]
                          message per node and step
"""
from functools import partial
import threading
import time

import numpy as np
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Imu, JointState
from std_msgs.msg import Float32MultiArray, Float64MultiArray

from flashrt_ros.client import wait_matched
from flashrt_ros.messages import robot_messages


def observation_link(client):
    """The flat link: the world's observation on the node's ~/observation, its ~/action back
    (PolicyClient.step); the action is also what drives the world."""
    def act(world, obs):
        action = client.step([float(v) for v in np.asarray(obs, dtype=np.float32)])
        return action, action
    return act


class RobotLink:
    """A policy node with observation_type 'terms' (e.g. config/g1.yaml) driving an in-process
    RobotWorld. A step publishes the world's readings (sensor_msgs/JointState and Imu stamped
    with the simulation time, as the flashrt_sim mjcf world publishes them) on the node's
    joint_states and imu (relative names: in its namespace), and returns (raw action from
    ~/action, joint position targets from ~/joint_commands); the targets drive the world, so
    the node's joint_names order must be the world's joint order (as for the flashrt_sim
    world).

    The node steps once per stamp (lockstep), so unanswered readings are sent again every
    `resend` seconds (never a second step) until `timeout`. Readings with the stamp the node
    last stepped on would get no answer at all: the link refuses them with the reason (only a
    restore back to exactly that stamp does that, e.g. branches of one step).
    """

    def __init__(self, node, policy='/flashrt_policy', session='', timeout=10.0, resend=1.0,
                 qos_depth=100):
        # the readings go to the node's namespace (+ /<session> of a fleet), relative names;
        # the action and the commands come from the node's own topics
        namespace = policy.rstrip('/').rsplit('/', 1)[0]
        self.node = node
        self.policy = f'{policy.rstrip("/")}/{session}' if session else policy.rstrip('/')
        robot = f'{namespace}/{session}' if session else namespace
        self.timeout, self.resend = timeout, resend
        qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=qos_depth,
                         reliability=ReliabilityPolicy.RELIABLE)
        self._pubs = [node.create_publisher(JointState, f'{robot}/joint_states', qos),
                      node.create_publisher(Imu, f'{robot}/imu', qos)]
        self._received = {'action': [], 'joint_commands': []}
        self._cond = threading.Condition()
        self._subs = [node.create_subscription(msg_type, f'{self.policy}/{topic}',
                                               partial(self._on_message, topic), qos)
                      for topic, msg_type in (('action', Float32MultiArray),
                                              ('joint_commands', Float64MultiArray))]
        self._stepped = None        # stamp of the readings the node last answered

    def _on_message(self, topic, msg):
        with self._cond:
            self._received[topic].append(list(msg.data))
            self._cond.notify_all()

    def wait_ready(self, client, timeout=60.0, settle=0.5):
        """Waits for the node's services (those of `client`, a PolicyClient) and for this
        link's topics to be matched with the node's, then `settle` seconds: the node's side of
        a match may come later, and a command sent before it would be lost (the node answers
        a stamp once)."""
        deadline = time.monotonic() + timeout
        client.wait_services(deadline)
        wait_matched(self._pubs, self._subs, deadline,
                     f'{self.policy}: joint_states, imu, ~/action and ~/joint_commands are '
                     "not all connected: is the node active, with observation_type 'terms' and "
                     "control_mode 'lockstep'?")
        time.sleep(settle)

    def __call__(self, world, obs):
        return request_actions([(self, world)])[0]


def request_actions(pairs):
    """One control step of several (RobotLink, RobotWorld) pairs at once: every world's
    readings are published first (a fleet node steps them in one tick), then every answer is
    awaited; unanswered readings are re-sent every link.resend seconds. Returns (raw action,
    joint targets) per pair."""
    sent = []
    for link, world in pairs:
        messages = robot_messages(world)[:2]
        stamp = (messages[0].header.stamp.sec, messages[0].header.stamp.nanosec)
        if stamp == link._stepped:
            raise RuntimeError(
                f'readings at {stamp[0] + 1e-9 * stamp[1]:.3f} s again: the policy node steps '
                'once per stamp (lockstep) and already stepped on this one; a branch must run '
                'at least 2 steps')
        with link._cond:
            seen = {topic: len(values) for topic, values in link._received.items()}
        sent.append((link, messages, stamp, seen))
    for link, messages, _, _ in sent:
        for pub, msg in zip(link._pubs, messages):
            pub.publish(msg)
    results = []
    for link, messages, stamp, seen in sent:
        answered = (lambda link=link, seen=seen: all(
            len(v) > seen[t] for t, v in link._received.items()))
        deadline = time.monotonic() + link.timeout
        with link._cond:
            while not link._cond.wait_for(answered, min(max(0.0, deadline - time.monotonic()),
                                                        link.resend)):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f'no ~/action and ~/joint_commands from {link.policy} '
                                       f'within {link.timeout} s')
                for pub, msg in zip(link._pubs, messages):
                    pub.publish(msg)
            link._stepped = stamp
            results.append((link._received['action'][seen['action']],
                            link._received['joint_commands'][seen['joint_commands']]))
    return results


class BatchedLink:
    """Flat worlds on the sessions of fleet nodes: per node, one [sessions, obs_dim] message
    on ~/observations per step (rows of sessions not in use are NaN: they keep their state),
    its ~/actions back. addresses: (node path, session name) per world."""

    def __init__(self, node, addresses, clients, timeout=10.0):
        qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100,
                         reliability=ReliabilityPolicy.RELIABLE)
        self.timeout = timeout
        self._cond = threading.Condition()
        self._rows, self._pubs, self._received, self._subs = {}, {}, {}, []
        for policy in dict.fromkeys(p for p, _ in addresses):
            status = _wait_active_status(clients[policy], timeout)
            self._rows[policy] = list(status.session_names)
            self._pubs[policy] = node.create_publisher(Float32MultiArray,
                                                       f'{policy}/observations', qos)
            self._received[policy] = []
            self._subs.append(node.create_subscription(
                Float32MultiArray, f'{policy}/actions', partial(self._on_message, policy), qos))
        self.addresses = addresses
        unknown = [f'{p}:{n}' for p, n in addresses if n not in self._rows[p]]
        if unknown:
            raise ValueError(f'no such sessions: {unknown}')
        wait_matched(self._pubs.values(), self._subs, time.monotonic() + timeout,
                     '~/observations and ~/actions of the fleet nodes are not connected: '
                     "observation_type 'float32_array', sessions > 1?")
        time.sleep(0.2)     # the node's side of the match may come a little later

    def _on_message(self, policy, msg):
        with self._cond:
            self._received[policy].append(np.asarray(msg.data, dtype=np.float32))
            self._cond.notify_all()

    def __call__(self, observations):
        """Observations per address -> actions per address (lists of floats)."""
        frames = {p: np.full((len(names), len(observations[0])), np.nan, np.float32)
                  for p, names in self._rows.items()}
        for (policy, name), obs in zip(self.addresses, observations):
            frames[policy][self._rows[policy].index(name)] = obs
        with self._cond:
            seen = {p: len(v) for p, v in self._received.items()}
        for policy, frame in frames.items():
            msg = Float32MultiArray()
            msg.data = frame.reshape(-1).tolist()
            self._pubs[policy].publish(msg)
        with self._cond:
            if not self._cond.wait_for(lambda: all(len(v) > seen[p] for p, v in
                                                   self._received.items()), self.timeout):
                raise TimeoutError(f'no ~/actions within {self.timeout} s')
            got = {p: v[seen[p]].reshape(len(self._rows[p]), -1)
                   for p, v in self._received.items()}
        return [[float(x) for x in got[p][self._rows[p].index(n)]] for p, n in self.addresses]


def _wait_active_status(client, timeout):
    deadline = time.monotonic() + timeout
    while client.last_status is None or client.last_status.state != 'active':
        if time.monotonic() > deadline:
            raise TimeoutError(f'no ~/status of an active node from {client.policy}')
        time.sleep(0.01)
    return client.last_status
