"""Section 7: end to end through ROS, as deployed: the policy node in its own process
(the installed `policy_node` executable), this process as the planner (a PolicyClient).

Measures a bare std_srvs/Trigger round trip to a node in its own process (the floor: rclpy
and Fast DDS and nothing of ours), ~/restore call -> response round trips (with the node's
own restore latency beside them) and observation -> action latency through the topics,
lock-step.

Runs only with --ros and only where rclpy, the generated flashrt_ros interfaces and the
installed executable are found (source the colcon install first); otherwise the section says
why it was skipped.
"""

import os
import pathlib
import subprocess
import sys
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


def _start(cmd, log_path):
    log = open(log_path, 'w')
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log


def _stop(proc, log):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def ros_section(cfg, device, log):
    """A bare Trigger round trip (the floor), ~/restore round trips and observation -> action,
    each server in its own process, spun the same way (flashrt_ros.executors)."""
    try:
        import rclpy

        from flashrt_ros.client import PolicyClient, call_service, spin_in_thread
        from std_srvs.srv import Trigger
    except Exception as exc:     # ImportError, or a module that does not load
        return {'skipped': f'ROS path not importable: {exc!r}'}
    exe = _executable()
    if exe is None:
        return {'skipped': 'policy_node executable not found on AMENT_PREFIX_PATH '
                           '(source install/setup.bash)'}
    out = {'calls': cfg['calls'], 'policy_type': cfg['policy_type'],
           'process': 'every server in its own process; this process is the client',
           'executor': 'SingleThreadedExecutor (flashrt_ros/executors.py says why)'}
    tmp = tempfile.mkdtemp(prefix='frt-bench-ros-')
    rclpy.init()
    node = rclpy.create_node('flashrt_bench_client')
    spinner = spin_in_thread(node)
    try:
        name = f'flashrt_floor_{os.getpid()}'
        proc, plog = _start([sys.executable, '-m', 'benchmarks.trigger_server', name],
                            os.path.join(tmp, 'floor.log'))
        try:
            cli = node.create_client(Trigger, f'/{name}/trigger')
            if not cli.wait_for_service(timeout_sec=60.0):
                raise TimeoutError(f'/{name}/trigger did not appear')
            out['trigger'] = _round_trips(lambda: call_service(cli, Trigger.Request(), 30.0),
                                          cfg['calls'], log, 'bare Trigger (floor)')
            echo = PolicyClient(node, '/' + name, timeout=30.0)    # its topics, no services
            deadline = time.monotonic() + 60.0
            while echo._obs_pub.get_subscription_count() == 0 or \
                    node.count_publishers(f'/{name}/action') == 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f'/{name} echo topics did not connect')
                time.sleep(0.01)
            time.sleep(0.5)     # the echo's publisher matches our subscription too
            out['echo'] = _topic_round_trips(echo, cfg['calls'], log, dim=48,
                                             what='bare topic echo (floor)')
            # the policy's calls start from the same client node as the floor's did: the
            # floor's entities go (every entity costs the client's executor on each wake)
            echo.close()
            node.destroy_client(cli)
        finally:
            _stop(proc, plog)
        name = f'flashrt_bench_{os.getpid()}'
        proc, plog = _start(
            [exe, '--ros-args', '-r', f'__node:={name}', '-p', f'device:={device}',
             '-p', f'policy_type:={cfg["policy_type"]}', '-p', f'capsule_dir:={tmp}'],
            os.path.join(tmp, 'node.log'))
        try:
            client = PolicyClient(node, '/' + name, timeout=30.0)
            client.wait_ready(timeout=120.0)
            out['restore'] = _round_trips(lambda: client.call('restore', name='episode_start'),
                                          cfg['calls'], log, '~/restore')
            out['observation_to_action'] = _topic_round_trips(client, cfg['calls'], log)
            status = _wait_status(client)
            out['graph'] = bool(status.cuda_graph) if status else None
            out['device'] = status.device if status else None
        finally:
            _stop(proc, plog)
        return out
    except TimeoutError as exc:
        return {'skipped': f'{exc}; logs in {tmp}'}
    finally:
        spinner.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()


def _wait_status(client, timeout=5.0):
    deadline = time.monotonic() + timeout
    while client.last_status is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return client.last_status


def _round_trips(call, n, log, what):
    """n timed calls after WARMUP: call() -> (response, seconds). A response with a false
    `success` counts as a failure, not a time; the node's own latency_us is kept beside."""
    walls, served, failures = [], [], 0
    for i in range(n + WARMUP):
        response, seconds = call()
        if not response.success:
            failures += 1
            continue
        if i >= WARMUP:
            walls.append(seconds * 1e6)
            if hasattr(response, 'latency_us'):
                served.append(float(response.latency_us))
    log(f'  {what}: {len(walls)} calls, p50 {stats(walls)["p50"]:.0f} us')
    out = {'round_trip': stats(walls), 'failures': failures}
    if served:
        out['node_reported_latency'] = stats(served)
    return out


def _topic_round_trips(client, n, log, dim=None, what='observation -> action'):
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
    log(f'  {what}: {len(walls)} messages, p50 {stats(walls)["p50"]:.0f} us')
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
