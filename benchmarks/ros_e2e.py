"""Section 7: end to end through ROS, as deployed: the policy node in its own process
(the installed `policy_node` executable), this process as the planner (a PolicyClient).

Measures ~/restore call -> response round trips (with the node's device-timed restore
beside them) and observation -> action latency through the topics, lock-step.

Runs only with --ros and only where rclpy, the generated flashrt_ros interfaces and the
installed executable are found (source the colcon install first); otherwise the section says
why it was skipped.
"""

import os
import pathlib
import subprocess
import tempfile
import time

import torch

from .timing import stats

WARMUP = 50     # calls and messages before measuring: DDS discovery settles


def _executable():
    for prefix in os.environ.get('AMENT_PREFIX_PATH', '').split(os.pathsep):
        exe = pathlib.Path(prefix) / 'lib' / 'flashrt_ros' / 'policy_node'
        if prefix and exe.exists():
            return str(exe)
    return None


def ros_section(cfg, device, log):
    try:
        import rclpy

        from flashrt_ros.client import PolicyClient, spin_in_thread
    except Exception as exc:     # ImportError, or a module that does not load
        return {'skipped': f'ROS path not importable: {exc!r}'}
    exe = _executable()
    if exe is None:
        return {'skipped': 'policy_node executable not found on AMENT_PREFIX_PATH '
                           '(source install/setup.bash)'}
    name = f'flashrt_bench_{os.getpid()}'
    capsules = tempfile.mkdtemp(prefix='frt-bench-ros-')
    node_log = open(os.path.join(capsules, 'node.log'), 'w')
    proc = subprocess.Popen(
        [exe, '--ros-args', '-r', f'__node:={name}', '-p', f'device:={device}',
         '-p', f'policy_type:={cfg["policy_type"]}', '-p', f'capsule_dir:={capsules}'],
        stdout=node_log, stderr=subprocess.STDOUT)
    rclpy.init()
    node = rclpy.create_node('flashrt_bench_client')
    client = PolicyClient(node, '/' + name, timeout=30.0)
    executor = spin_in_thread(node)
    try:
        client.wait_ready(timeout=120.0)
        out = {'calls': cfg['calls'], 'policy_type': cfg['policy_type'],
               'process': 'policy_node in its own process'}
        out['restore'] = _restore_round_trips(client, cfg['calls'], log)
        out['observation_to_action'] = _topic_round_trips(client, cfg['calls'], log)
        status = _wait_status(client)
        out['graph'] = bool(status.cuda_graph) if status else None
        out['device'] = status.device if status else None
        return out
    except TimeoutError as exc:
        node_log.flush()
        return {'skipped': f'{exc}; node log: {open(node_log.name).read()[-2000:]}'}
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        node_log.close()


def _wait_status(client, timeout=5.0):
    deadline = time.monotonic() + timeout
    while client.last_status is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return client.last_status


def _restore_round_trips(client, n, log):
    walls, served, failures = [], [], 0
    for i in range(n + WARMUP):
        response, seconds = client.call('restore', name='episode_start')
        if not response.success:
            failures += 1
            continue
        if i >= WARMUP:
            walls.append(seconds * 1e6)
            served.append(float(response.latency_us))
    log(f'  restore service: {len(walls)} calls, p50 {stats(walls)["p50"]:.0f} us')
    return {'round_trip': stats(walls), 'node_reported_latency': stats(served),
            'failures': failures}


def _topic_round_trips(client, n, log):
    dim = None
    walls, lost = [], 0
    values = torch.randn(n + WARMUP, 4096, generator=torch.Generator().manual_seed(5))
    for i in range(n + WARMUP):
        if dim is None:
            dim = _obs_dim(client)
        t0 = time.perf_counter()
        try:
            client.step(values[i, :dim].tolist())
        except TimeoutError:
            lost += int(i >= WARMUP)
            continue
        if i >= WARMUP:
            walls.append((time.perf_counter() - t0) * 1e6)
    log(f'  observation -> action: {len(walls)} messages, p50 {stats(walls)["p50"]:.0f} us')
    return {'round_trip': stats(walls), 'lost': lost}


def _obs_dim(client):
    """The node's observation size, from its parameter service's default (config)."""
    from rcl_interfaces.srv import GetParameters
    cli = client.node.create_client(GetParameters, f'{client.policy}/get_parameters')
    if not cli.wait_for_service(timeout_sec=10.0):
        raise TimeoutError('get_parameters did not appear')
    request = GetParameters.Request(names=['obs_dim'])
    future = cli.call_async(request)
    deadline = time.monotonic() + 10.0
    while not future.done():
        if time.monotonic() > deadline:
            raise TimeoutError('get_parameters did not answer')
        time.sleep(0.01)
    return int(future.result().values[0].integer_value)
