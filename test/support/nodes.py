"""A flashrt_policy node in-process with a PolicyClient on a second node (real rclpy, Fast DDS),
and the reference a test compares its actions with: the same policy on an engine without ROS.

Needs rclpy: imported by the ros and system layers only.
"""
import os

import rclpy
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.parameter import Parameter
import torch

from flashrt_ros.client import PolicyClient, spin_in_thread
from flashrt_ros.node import parameters as node_params
from flashrt_ros.node.policy_node import PolicyNode
from flashrt_ros.node.settings import build_engine, Settings
from support.common import wait_for

SUCCESS = TransitionCallbackReturn.SUCCESS
RECURRENT = dict(policy_type='recurrent', obs_dim=6, act_dim=3, rnn_hidden_dim=16)
_names = iter(range(10 ** 6))


def reference_actions(params, observations, directory):
    """Actions of the same policy on a fresh engine (no ROS) that sees only `observations`."""
    values = {f.name: node_params._default(f) for f in node_params.ALL_FIELDS}
    values.update(params)
    node_cfg, policy_cfg = node_params.build(values)
    node_cfg.device_budget_mb = node_cfg.host_budget_mb = 1024
    engine = build_engine(Settings(node_cfg, policy_cfg, torch.device('cpu'), str(directory)))
    return engine, [engine.step(o).tolist() for o in observations]


class Harness:
    """A PolicyNode plus a client node on one executor; the node configured and active."""

    def __init__(self, tmp_path, params, start=True, executor=None, timeout=30.0):
        self.name = f'flashrt_policy_t{next(_names)}_{os.getpid()}'
        self.params = dict(dict(device='cpu', capsule_dir=str(tmp_path / 'capsules'),
                                status_period=0.1), **params)
        self.tmp_path = tmp_path
        overrides = [Parameter(k, value=v) for k, v in self.params.items()]
        self.node = PolicyNode(self.name, parameter_overrides=overrides)
        self.client_node = rclpy.create_node(self.name + '_client')
        self.client = PolicyClient(self.client_node, '/' + self.name, timeout=timeout)
        # The node on its own executor thread (single-threaded, as its main() runs it, unless
        # a test composes it into another executor), the client on another.
        self.node_spinner = spin_in_thread(self.node, executor=executor)
        self.executor = spin_in_thread(self.client_node)
        if start:
            self.transition('configure')
            self.activate()

    def transition(self, label):
        """A lifecycle transition asked through <node>/change_state; it must succeed."""
        assert self.client.change_state(label), f'{label} failed on {self.name}'

    def activate(self):
        self.transition('activate')
        self.client.wait_ready(observation=self.params.get('observation_type') not in (
            'terms', 'cameras'))
        # The action publisher must also have matched the client's subscription, or the
        # first action could be published to nobody.
        wait_for(lambda: self.node.parts.robot.sessions[0].action_pub.get_subscription_count() > 0,
                 what='action subscription')

    def deactivate(self):
        self.transition('deactivate')
        wait_for(lambda: self.client._obs_pub.get_subscription_count() == 0,
                 what='observation subscription gone')

    def steps(self, observations):
        return [self.client.step(o) for o in observations]

    def call(self, service, **fields):
        return self.client.call(service, **fields)[0]

    def names(self):
        return [c.name for c in self.call('list_capsules').capsules]

    def reference(self, observations, params=None):
        p = dict(self.params, **(params or {}))
        return reference_actions(p, observations, self.tmp_path / 'reference')[1]

    def close(self):
        self.executor.shutdown()
        self.node_spinner.shutdown()
        self.node.destroy_node()
        self.client_node.destroy_node()
