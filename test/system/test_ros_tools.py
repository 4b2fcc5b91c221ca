"""The package through the upstream ROS 2 tools, as a user drives it: ros2 launch, lifecycle,
param, service, topic and interface, all real processes (the tools come from
../shared/ros-tools, installed by tools/bootstrap.sh where that folder exists).

Each test gets its own ROS domain (101-231: conftest.py's session domains are 1-100) with its
own ros2 daemon, so CLI calls answer in well under a second; every process a test starts runs
in its own session and is stopped (SIGINT, then SIGKILL of its process group) when it ends.
"""
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import time

import pytest

from support.ros_tools import NEEDS_ROS2, ROS2

ROOT = pathlib.Path(__file__).resolve().parents[2]
DAEMON = ROS2 and shutil.which('_ros2_daemon', path=os.path.dirname(ROS2))
pytestmark = NEEDS_ROS2
rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
yaml = pytest.importorskip('yaml')

from flashrt_ros.node.parameters import ALL_FIELDS  # noqa: E402

_DOMAINS = iter(random.sample(range(101, 232), 131))
OBS = '{data: [0.1, -0.2, 0.3, 0.0, 0.5, -0.6, 0.7]}'      # obs_dim 7, as in PARAMS
PARAMS = {'device': 'cpu', 'obs_dim': 7, 'act_dim': 3, 'rnn_hidden_dim': 24,
          'status_period': 0.25}


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # a background shell may have ignored it


def _listening(port):
    with socket.socket() as s:
        return s.connect_ex(('127.0.0.1', port)) == 0


class Ros:
    """One test's ROS world: a domain, its ros2 daemon, and every process started in it."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        domain = next(_DOMAINS)
        self.env = dict(os.environ, ROS_DOMAIN_ID=str(domain), PYTHONUNBUFFERED='1',
                        ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST')
        self.procs, self.launches = [], []
        self.start('daemon', DAEMON, '--timeout', '900',
                   '--rmw-implementation', rclpy.get_rmw_implementation_identifier(),
                   '--ros-domain-id', str(domain))
        # Until it listens, a CLI call would spawn a daemon of its own that outlives the test.
        self.wait(lambda: _listening(11511 + domain), 'the ros2 daemon', timeout=15.0)

    def start(self, name, *args):
        with open(self.tmp_path / f'{name}.log', 'w') as log:
            proc = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_default_sigint)
        proc.log = pathlib.Path(log.name)
        self.procs.append(proc)
        return proc

    def launch(self, name, *args):
        proc = self.start(name.split('.')[0], ROS2, 'launch', 'flashrt_ros', name, *args)
        self.launches.append(proc)
        return proc

    def ros2(self, *args, ok=True, timeout=60):
        """Runs `ros2 args`; checks its exit status (unless ok is None); stdout + stderr."""
        r = subprocess.run([ROS2, *args], env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        out = r.stdout + r.stderr
        assert ok is None or (r.returncode == 0) == ok, f'ros2 {args}: {r.returncode}\n{out}'
        return out

    def node(self, verb, *args, ok=True):
        """ros2 param/lifecycle VERB ...: the daemon knows the graph, so no discovery wait."""
        return self.ros2(*verb.split(), '--spin-time', '0.1', *args, ok=ok)

    def wait(self, predicate, what, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = [p for p in self.launches if p.poll() is not None]
            assert not dead, f'{what}: the launch exited\n' + dead[0].log.read_text()
            assert time.monotonic() < deadline, f'timed out waiting for {what}'
            time.sleep(0.2)

    def wait_state(self, node, state):
        """Waits until `ros2 lifecycle get` finds `node` in `state`."""
        self.wait(lambda: self.node('lifecycle get', node, ok=None).startswith(state + ' ['),
                  f'{node} {state}')

    def close(self):
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)    # whatever it left in its group
            except ProcessLookupError:
                pass
            proc.wait()


@pytest.fixture
def ros(tmp_path):
    world = Ros(tmp_path)
    try:
        yield world
    finally:
        world.close()


def params_file(tmp_path, **values):
    """A params file in the `/**:` wildcard form (any node name, any namespace)."""
    path = tmp_path / 'params.yaml'
    values = dict(PARAMS, capsule_dir=str(tmp_path / 'capsules'), **values)
    path.write_text(yaml.safe_dump({'/**': {'ros__parameters': values}}))
    return path


def start_policy(ros, *args, **values):
    """policy.launch.py with PARAMS (and `values`); returns the node's name once active."""
    namespace = next((a.split(':=')[1] for a in args if a.startswith('namespace:=')), '')
    node = f'/{namespace}/flashrt_policy' if namespace else '/flashrt_policy'
    ros.launch('policy.launch.py', f'params_file:={params_file(ros.tmp_path, **values)}', *args)
    ros.wait_state(node, 'unconfigured' if values.get('autostart') is False else 'active')
    return node


def test_interface_show(ros):
    out = ros.ros2('interface', 'show', 'flashrt_ros/srv/Snapshot')
    request, response = out.split('---')
    assert 'string name' in request and 'bool overwrite' in request and 'bool pin' in request
    assert 'bool success' in response and 'CapsuleInfo capsule' in response
    assert 'builtin_interfaces/Time stamp' in response      # resolved from the venv's index


@pytest.mark.slow
@pytest.mark.parametrize('namespace', ['', 'robot1'])
def test_policy_launch_takes_the_params_file(ros, namespace):
    node = start_policy(ros, *[f'namespace:={namespace}'] * bool(namespace))
    assert ros.node('param get', node, 'rnn_hidden_dim') == 'Integer value is: 24\n'
    assert ros.node('param get', node, 'status_period') == 'Double value is: 0.25\n'
    names = ros.ros2('node', 'list').split()
    assert [n for n in names if n.endswith('flashrt_policy')] == [node], names
    topics = ros.ros2('topic', 'list')
    assert f'{node}/action' in topics.split() and f'{node}/observation' in topics.split()


def demo_params(tmp_path):
    """config/policy.yaml as installed, with the capsules in tmp_path."""
    config = yaml.safe_load((ROOT / 'config' / 'policy.yaml').read_text())
    (key, body), = config.items()
    body['ros__parameters']['capsule_dir'] = str(tmp_path / 'capsules')
    path = tmp_path / 'demo.yaml'
    path.write_text(yaml.safe_dump({key: body}))
    return f'params_file:={path}'


def run_demo(ros, *args):
    proc = ros.launch('demo.launch.py', demo_params(ros.tmp_path), *args)
    proc.wait(timeout=150)
    return proc.returncode, proc.log.read_text()


def test_demo_launch_exits_zero_when_the_demo_passes(ros):
    code, out = run_demo(ros)
    assert code == 0, out
    assert ' passed, 0 failed' in out and '[FAIL]' not in out, out


def test_demo_launch_exits_non_zero_when_the_driver_fails(ros):
    # The driver rejects a non-integer obs_dim at start and exits 1; the launch must say so.
    code, out = run_demo(ros, 'obs_dim:=not_a_number')
    assert code == 1, out
    assert 'demo driver exited with code 1: the demo failed' in out, out


def test_demo_launch_exits_non_zero_when_the_policy_node_fails(ros):
    path = params_file(ros.tmp_path, device='nowhere')
    proc = ros.launch('demo.launch.py', f'params_file:={path}')
    assert proc.wait(timeout=60) == 1
    out = proc.log.read_text()
    assert "parameter 'device' = 'nowhere'" in out, out
    assert 'policy node exited with code 1 before the demo driver was done' in out, out


def call(ros, node, service, srv_type, request):
    return ros.ros2('service', 'call', f'{node}/{service}', f'flashrt_ros/srv/{srv_type}',
                    request)


@pytest.mark.slow
def test_lifecycle_set_through_every_transition(ros):
    node = start_policy(ros, 'namespace:=lc', autostart=False)
    assert ros.node('lifecycle get', node) == 'unconfigured [1]\n'
    out = ros.node('lifecycle set', node, 'activate', ok=False)     # not from unconfigured
    assert 'Unknown transition requested' in out and 'configure [1]' in out, out
    for transition, state in [('configure', 'inactive [2]'), ('activate', 'active [3]')]:
        assert ros.node('lifecycle set', node, transition) == 'Transitioning successful\n'
        assert ros.node('lifecycle get', node) == state + '\n'
    out = ros.node('lifecycle set', node, 'configure', ok=False)    # not from active
    assert 'Unknown transition requested' in out and 'deactivate [4]' in out, out
    assert ros.node('lifecycle get', node) == 'active [3]\n'
    for transition, state in [('deactivate', 'inactive [2]'), ('cleanup', 'unconfigured [1]'),
                              ('configure', 'inactive [2]'), ('shutdown', 'finalized [4]')]:
        assert ros.node('lifecycle set', node, transition) == 'Transitioning successful\n'
        assert ros.node('lifecycle get', node) == state + '\n'
    assert ros.launches[0].poll() is None, 'the launch ended'


@pytest.mark.slow
def test_change_state_by_invalid_id_is_answered_and_refused(ros):
    """What launch_ros's configure-then-activate event pattern sends when autostart is on;
    `ros2 lifecycle set` checks the transition itself, so the service is called directly."""
    node = start_policy(ros)
    out = ros.ros2('service', 'call', f'{node}/change_state', 'lifecycle_msgs/srv/ChangeState',
                   '{transition: {id: 1}}', timeout=10)
    assert 'success=False' in out, out
    assert ros.node('lifecycle get', node) == 'active [3]\n'
    assert 'success=True' in call(ros, node, 'snapshot', 'Snapshot', '{name: still_serving}')


def test_param_dump_get_set_describe(ros):
    node = start_policy(ros)
    dump = yaml.safe_load(ros.node('param dump', node))
    values = dump[node]['ros__parameters']
    assert {f.name for f in ALL_FIELDS} <= set(values), dump
    assert values['rnn_hidden_dim'] == 24 and values['joint_names'] == []
    out = ros.node('param describe', node, 'status_period')
    assert 'Description: seconds between ~/status' in out and 'Min value: 0.01' in out, out
    out = ros.node('param describe', node, 'rnn_hidden_dim')
    assert 'Description: ' in out and 'next configure' in out, out
    # live: applied at once
    assert ros.node('param set', node, 'status_period', '0.5') == 'Set parameter successful\n'
    assert ros.node('param get', node, 'status_period') == 'Double value is: 0.5\n'
    # invalid: refused, unchanged (ros2 param set exits 0 on a refusal too: upstream 0.32.2)
    out = ros.node('param set', node, 'qos_reliability', 'bogus')
    assert out.startswith('Setting parameter failed') and 'best_effort' in out, out
    assert ros.node('param get', node, 'qos_reliability') == 'String value is: reliable\n'
    # shapes what configure builds: refused while configured, taken while unconfigured
    out = ros.node('param set', node, 'rnn_hidden_dim', '32')
    assert out.startswith('Setting parameter failed') and 'cleanup' in out, out
    assert ros.node('param get', node, 'rnn_hidden_dim') == 'Integer value is: 24\n'
    for transition in ('deactivate', 'cleanup'):
        ros.node('lifecycle set', node, transition)
    assert ros.node('param set', node, 'rnn_hidden_dim', '32') == 'Set parameter successful\n'
    ros.node('lifecycle set', node, 'configure')
    assert ros.node('param get', node, 'rnn_hidden_dim') == 'Integer value is: 32\n'


@pytest.mark.slow
def test_service_call_snapshot_and_restore(ros):
    node = start_policy(ros, 'namespace:=srv')
    out = call(ros, node, 'snapshot', 'Snapshot', '{name: cli_mid}')
    assert 'success=True' in out and "snapshot 'cli_mid'" in out, out
    out = call(ros, node, 'restore', 'Restore', '{name: cli_mid}')
    assert 'success=True' in out and "name='cli_mid'" in out, out
    out = call(ros, node, 'restore', 'Restore', '{name: no_such_capsule}')
    assert 'success=False' in out and 'no_such_capsule' in out, out
    assert "name='cli_mid'" in ros.ros2('service', 'call', f'{node}/list_capsules',
                                        'flashrt_ros/srv/ListCapsules')


@pytest.mark.slow
def test_fleet_node_from_the_command_line(ros):
    """A fleet node launched with sessions in its params file; the session field from
    `ros2 service call`, a per-session topic seen by `ros2 topic list`."""
    node = start_policy(ros, 'namespace:=fleet', sessions=2, session_names=['left', 'right'])
    assert 'string session' in ros.ros2('interface', 'show', 'flashrt_ros/srv/ResetSession')
    out = call(ros, node, 'snapshot', 'Snapshot', '{name: cli_left, session: left}')
    assert 'success=True' in out and "of session 'left'" in out, out
    out = call(ros, node, 'restore', 'Restore', '{name: cli_left, session: right}')
    assert 'success=True' in out and "of session 'right'" in out, out
    out = call(ros, node, 'snapshot', 'Snapshot', '{name: unnamed}')
    assert 'success=False' in out and 'name one' in out, out
    out = call(ros, node, 'reset_session', 'ResetSession', '{session: "1"}')
    assert 'success=True' in out and 'episode 1' in out, out
    topics = ros.ros2('topic', 'list')
    assert f'{node}/left/observation' in topics and f'{node}/observations' in topics, topics


@pytest.mark.slow
def test_topic_echo_of_the_action_and_a_live_parameter(ros):
    node = start_policy(ros)
    # checkpoint_every is live: set now, it must take effect on the next steps
    assert ros.node('param set', node, 'checkpoint_every', '1') == 'Set parameter successful\n'
    echo = ros.start('echo', ROS2, 'topic', 'echo', '--once', f'{node}/action',
                     'std_msgs/msg/Float32MultiArray')
    ros.start('pub', ROS2, 'topic', 'pub', '-r', '20', f'{node}/observation',
              'std_msgs/msg/Float32MultiArray', OBS)
    echo.wait(timeout=60)
    out = echo.log.read_text()
    assert echo.returncode == 0, out
    action = yaml.safe_load(out.split('---')[0])['data']
    assert len(action) == 3 and all(isinstance(a, float) for a in action), out
    out = ros.ros2('service', 'call', f'{node}/list_capsules', 'flashrt_ros/srv/ListCapsules')
    assert "name='checkpoint-" in out, out
