"""Where the episode runner's parallel branches run: `Fleet` (a policy node session per
branch, each with its own copy of the world) and `parse_addresses` for its 'parallel'
parameter."""
from copy import deepcopy
import time

import numpy as np

from flashrt_ros.client import PolicyClient
from flashrt_ros.harness.links import BatchedLink, request_actions, RobotLink


def parse_addresses(text, default_policy):
    """'node:session,node:session' (a bare 'session' means default_policy's) -> [(node path,
    session)]."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(','))):
        policy, _, session = item.rpartition(':')
        out.append(((policy or default_policy).rstrip('/'), session))
    return out


class Fleet:
    """Where parallel branches run: (node path, session) per branch, the PolicyClients of
    those nodes, and the links that step all their worlds at once, one round of messages per
    step."""

    def __init__(self, node, addresses, main_policy, make_world, robot, timeout):
        self.addresses, self.make_world = addresses, make_world
        self.clients = {p: PolicyClient(node, p, timeout=timeout)
                        for p in dict.fromkeys(p for p, _ in addresses)}
        self.others = [c for p, c in self.clients.items() if p != main_policy.rstrip('/')]
        if robot:
            self.links = [RobotLink(node, p, s, timeout=timeout) for p, s in addresses]
            for link, (policy, _) in zip(self.links, addresses):
                link.wait_ready(self.clients[policy], timeout=60.0, settle=0.0)
            time.sleep(0.5)     # see RobotLink.wait_ready
        else:
            self.batched = BatchedLink(node, addresses, self.clients, timeout)

    def worlds(self, count, world, snapshot):
        """count copies of `world` holding its world snapshot named `snapshot` (the branch
        point)."""
        if count > len(self.addresses):
            raise ValueError(f'{count} branches need as many sessions in parallel; '
                             f'{len(self.addresses)} given')
        copies = []
        for _ in range(count):
            copy = self.make_world()
            copy.snapshots[snapshot] = deepcopy(world.snapshots[snapshot])
            copies.append(copy)
        return copies

    def step(self, worlds, obs):
        """(action, command) per world for its observation, in one round of messages."""
        if hasattr(self, 'links'):
            return request_actions(list(zip(self.links, worlds)))
        actions = self.batched([np.asarray(o, dtype=np.float32) for o in obs])
        return [(a, a) for a in actions]

    def describe(self):
        nodes = len(self.clients)
        return f'{len(self.addresses)} sessions of {nodes} node{"s" * (nodes > 1)}'
