"""The node's parameters through rclpy's parameter services, as `ros2 param` drives them (issue
21, items 1 and 2): the types `ros2 param describe` and `get` report, the values `set` and
`load` send (arrays arrive as array.array, `[]` as a bool array, `[0, 1]` as integers), and
what is checked, applied at once or refused when a value is set.

Requests are built as the CLI builds them (rclpy.parameter.get_parameter_value on the text a
user types) and sent by rclpy's AsyncParameterClient, the client `ros2 param` uses, from a
second node.
"""
import math
import threading

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytestmark = pytest.mark.ros

from rcl_interfaces.msg import Parameter as ParameterMsg, ParameterType  # noqa: E402
from rclpy.parameter import get_parameter_value  # noqa: E402
from rclpy.parameter_client import AsyncParameterClient  # noqa: E402

from flashrt_ros.client import PolicyClient  # noqa: E402
from flashrt_ros.node import parameters as node_params  # noqa: E402
from support.common import obs  # noqa: E402
from support.nodes import RECURRENT  # noqa: E402

DOUBLES, INTEGERS, STRINGS = (ParameterType.PARAMETER_DOUBLE_ARRAY,
                              ParameterType.PARAMETER_INTEGER_ARRAY,
                              ParameterType.PARAMETER_STRING_ARRAY)
# what each list parameter holds (written out here, not derived from the code under test)
LIST_TYPES = {'joint_names': STRINGS, 'action_joint_names': STRINGS,
              'observation_terms': STRINGS, 'default_angles': DOUBLES, 'action_scale': DOUBLES,
              'joint_lower_limits': DOUBLES, 'joint_upper_limits': DOUBLES,
              'initial_command': DOUBLES, 'session_names': STRINGS,
              'command_outputs': STRINGS, 'actor_hidden_dims': INTEGERS}
# a single-session terms node: joint positions and velocities of three joints
TERMS = dict(RECURRENT, observation_type='terms', observation_terms=['joint_pos', 'joint_vel'],
             joint_names=['j0', 'j1', 'j2'], default_angles=[0.0, 0.0, 0.0],
             action_scale=[1.0])


class Params:
    """`ros2 param` for one node: rclpy's AsyncParameterClient on the harness's client node."""

    def __init__(self, h):
        self.node = h.node
        self.client = AsyncParameterClient(h.client_node, '/' + h.name)
        assert self.client.wait_for_services(timeout_sec=30.0)

    @staticmethod
    def _wait(future):
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        assert done.wait(30.0), 'no answer from the parameter service'
        return future.result()

    def set(self, name, text):
        """`ros2 param set <node> name text`: the SetParametersResult."""
        msg = ParameterMsg(name=name, value=get_parameter_value(string_value=text))
        return self._wait(self.client.set_parameters([msg])).results[0]

    def refused(self, name, text, *words):
        """Sets name to text; asserts it was refused, the value kept and the reason naming
        the parameter and each of `words`."""
        before = self.node.get_parameter(name).value
        result = self.set(name, text)
        assert not result.successful, f'{name} = {text} was accepted'
        for word in (name,) + words:
            assert word in result.reason, (word, result.reason)
        assert self.node.get_parameter(name).value == before
        return result.reason

    def describe(self, names):
        return self._wait(self.client.describe_parameters(names)).descriptors

    def get(self, names):
        return self._wait(self.client.get_parameters(names)).values

    def load(self, path):
        """`ros2 param load <node> path`: one SetParametersResult per parameter."""
        return self._wait(self.client.load_parameter_file(str(path), use_wildcard=True)).results


# -- item 1: types ----------------------------------------------------------------------------

def test_list_parameters_describe_and_get_their_true_type(make):
    h = make(start=False)
    p = Params(h)
    names = sorted(LIST_TYPES)
    described = {d.name: d.type for d in p.describe(names)}
    assert described == LIST_TYPES
    got = dict(zip(names, (v.type for v in p.get(names))))
    assert got == LIST_TYPES
    # and none of the node's parameters is a byte array ('Byte values are: []')
    every = [f.name for f in node_params.ALL_FIELDS]
    assert ParameterType.PARAMETER_BYTE_ARRAY not in {d.type for d in p.describe(every)}


def test_numeric_lists_set_as_ros2_param_sends_them_and_configure_reads_them(make):
    h = make(TERMS, start=False)
    p = Params(h)
    for name, text, value in [
            ('default_angles', '[0.1, 0.2, 0.3]', [0.1, 0.2, 0.3]),
            ('action_scale', '[0.25]', [0.25]),
            ('initial_command', '[0.5, 0.0, -0.5]', [0.5, 0.0, -0.5]),
            ('joint_upper_limits', '[1, 2, 3]', [1.0, 2.0, 3.0]),           # integers
            ('joint_lower_limits', '[-1, -2.5, -3]', [-1.0, -2.5, -3.0]),   # mixed: a string
            ('joint_lower_limits', '[]', []),                               # a bool array
            ('joint_lower_limits', '[-1.0, -2.0, -3.0]', [-1.0, -2.0, -3.0]),
            ('actor_hidden_dims', '[32, 16]', [32, 16])]:
        result = p.set(name, text)
        assert result.successful, (name, text, result.reason)
        assert list(h.node.get_parameter(name).value) == value
        assert p.describe([name])[0].type == LIST_TYPES[name]
    h.transition('configure')
    settings = h.node.settings
    assert settings.node.default_angles == [0.1, 0.2, 0.3]
    assert settings.node.initial_command == [0.5, 0.0, -0.5]
    assert settings.targets.default.tolist() == [0.1, 0.2, 0.3]
    assert settings.targets.scale.tolist() == [0.25] * 3
    assert settings.targets.lower.tolist() == [-1.0, -2.0, -3.0]
    assert settings.targets.upper.tolist() == [1.0, 2.0, 3.0]
    assert settings.policy.actor_hidden_dims == [32, 16]


def test_invalid_list_values_are_refused_naming_the_parameter(make):
    h = make(start=False)
    p = Params(h)
    p.refused('default_angles', '[0.1, .nan]', 'finite')
    p.refused('actor_hidden_dims', '[32, 0]', '>= 1')
    p.refused('joint_names', "['j0', '']", 'non-empty')
    p.refused('command_outputs', '[float64_array, bogus]', 'bogus')
    assert not p.set('default_angles', '[a, b]').successful        # strings: the wrong type
    assert p.describe(['actor_hidden_dims'])[0].additional_constraints.startswith('each >= 1')


def test_ros2_param_load_of_lists_and_terms(make, tmp_path):
    h = make(TERMS, start=False)
    h.transition('configure')           # declares the terms' parameters
    h.transition('cleanup')
    p = Params(h)
    path = tmp_path / 'params.yaml'
    path.write_text('/**:\n  ros__parameters:\n'
                    '    default_angles: [0, 0.5, 1]\n'         # mixed: sent as a string
                    '    joint_lower_limits: []\n'              # sent as a bool array
                    '    actor_hidden_dims: [8, 8]\n'
                    '    observation:\n      joint_vel:\n        scale: [2, 2, 2]\n'
                    '        clip: [-5, 5]\n')
    results = p.load(path)
    assert len(results) == 5 and all(r.successful for r in results), \
        [r.reason for r in results]
    h.transition('configure')
    settings = h.node.settings
    assert settings.node.default_angles == [0.0, 0.5, 1.0]
    assert settings.policy.actor_hidden_dims == [8, 8]
    vel = settings.layout.terms[1]
    assert vel.scale.tolist() == [2.0] * 3 and vel.clip == (-5.0, 5.0)


# -- item 2: one rule for what is live; everything checked when set ------------------------------

def test_term_settings_are_checked_when_set_and_refused_while_configured(make):
    h = make(TERMS, start=False)
    h.transition('configure')
    p = Params(h)
    scale = 'observation.joint_pos.scale'
    # configured: invalid values say what is wrong, valid ones that configure must apply
    p.refused('observation.joint_pos.type', 'bogus', 'bogus', 'not one of')
    p.refused('observation.joint_vel.clip', '[1.0, -1.0]', 'clip')
    p.refused(scale, '[1.0, 2.0]', '2 values', 'size 3')
    p.refused('observation.joint_vel.history_length', '0', 'history_length')
    reason = p.refused(scale, '[2.0]', 'configure')
    assert 'cleanup' in reason
    assert h.node.settings.layout.terms[0].scale.tolist() == [1.0] * 3
    # unconfigured: a value invalid on its own is refused; one that only the other settings
    # decide (a scale per joint) is checked at configure, which then names it
    h.transition('cleanup')
    p.refused('observation.joint_pos.type', 'bogus', 'not one of')
    p.refused('observation.joint_vel.clip', '[1.0, -1.0]', 'clip')
    p.refused('observation.joint_vel.decimation', '0', 'decimation')
    p.refused('observation.joint_vel.period', '-1.0', 'period')
    p.refused('observation.joint_vel.joints', '[j0, j0]', 'duplicate')
    assert p.set(scale, '[1.0, 2.0]').successful
    assert not h.client.change_state('configure')
    assert p.set(scale, '[2.0]').successful
    h.transition('configure')
    assert h.node.settings.layout.terms[0].scale.tolist() == [2.0] * 3


def test_every_parameter_is_checked_on_its_own_whatever_else_is_set(make):
    # rnn_type belongs to the recurrent kind: it is checked with an mlp policy too
    h = make(dict(policy_type='mlp', obs_dim=6, act_dim=3, device='tpu'), start=False)
    p = Params(h)
    p.refused('rnn_type', 'bogus', 'one of')
    # device 'tpu' (from the overrides) fails configure, naming it; it does not block a set
    # of another parameter, and it is refused when set
    assert p.set('obs_dim', '7').successful
    p.refused('policy_type', 'bogus', 'one of')
    assert p.set('control_rate', '50').successful          # an integer for a float
    assert h.node.get_parameter('control_rate').value == 50.0
    assert not h.client.change_state('configure')
    assert p.set('device', 'cpu').successful
    h.transition('configure')
    # configured: live settings are checked too, then applied; the others are refused
    p.refused('on_poison', 'bogus', 'one of')
    assert p.set('on_poison', 'hold').successful
    assert h.node.settings.node.on_poison == 'hold'
    p.refused('obs_dim', '8', 'configure')


def test_checkpoint_settings_set_on_an_active_fleet_act_on_every_session(make):
    # the README has them live; the baseline node refused checkpoints on a fleet at configure
    # and took a live set without acting on it
    names = ['s0', 's1']
    h = make(dict(RECURRENT, sessions=2), start=False)
    clients = [PolicyClient(h.client_node, '/' + h.name, timeout=30.0, session=s)
               for s in names]
    h.transition('configure')
    h.transition('activate')
    for c in clients:
        c.wait_ready()
    p = Params(h)
    assert p.set('checkpoint_every', '2').successful
    assert [g.recovery.every for g in h.node.parts.guards] == [2, 2]
    for t in range(4):
        for c in clients:
            assert not any(math.isnan(a) for a in c.step(obs(t)))

    def checkpoints():
        return sorted(c.name for c in h.call('list_capsules').capsules
                      if c.name.startswith('checkpoint-'))
    assert checkpoints() == [f'checkpoint-{s}-0000000{i}' for s in names for i in (1, 2)]
    assert p.set('checkpoint_keep', '1').successful
    assert p.set('checkpoint_to_disk', 'true').successful
    for t in range(4, 6):
        for c in clients:
            c.step(obs(t))
    assert checkpoints() == [f'checkpoint-{s}-00000003' for s in names]
    files = sorted(f.name for f in (h.tmp_path / 'capsules').glob('checkpoint-*'))
    assert files == [f'checkpoint-{s}-00000003.capsule' for s in names]


@pytest.mark.parametrize('kind, name, value, taker', [
    ('act', 'rtc_delay', 2, 'pi05'), ('recurrent', 'rtc_queue_threshold', 5, 'pi05'),
    ('smolvla', 'vision_dtype', 'bfloat16', 'pi05'),
    ('act', 'denoise_kernels', 'compiled', 'pi05'),
    ('diffusion', 'prefix_kernels', 'compiled', 'smolvla'),
    ('pi05', 'expert_dtype', 'bfloat16', 'smolvla')])
def test_a_checkpoint_option_for_a_kind_without_it_is_refused(kind, name, value, taker):
    """Real-time chunking, vision_dtype, denoise_kernels, prefix_kernels or expert_dtype set for
    a kind that has no such option would be ignored (other actions than asked for): refused
    naming the kinds that take it; the same value for a kind that takes it builds."""
    values = {f.name: node_params._default(f) for f in node_params.ALL_FIELDS}
    with pytest.raises(node_params.InvalidConfig, match=f"'{name}' is an option of"):
        node_params.build(dict(values, policy_type=kind, **{name: value}))
    _, policy = node_params.build(dict(values, policy_type=taker, **{name: value}))
    assert getattr(policy, name) == value
