"""Section 7: end to end through ROS. PolicyNode in-process on a MultiThreadedExecutor, a client
node on the same executor: ~/restore round trips and observation -> action latency.

Runs only with --ros and only where rclpy and the generated flashrt_ros interfaces import
(source the colcon install first); otherwise the section says why it was skipped.
"""

import array
import tempfile
import threading
import time

import torch

from .timing import stats

NODE = 'flashrt_policy'


def ros_section(cfg, device, log):
    try:
        import rclpy
        from rclpy.executors import MultiThreadedExecutor
        from rclpy.lifecycle import TransitionCallbackReturn
        from rclpy.parameter import Parameter
        from std_msgs.msg import Float32MultiArray

        from flashrt_ros import srv as fsrv
        from flashrt_ros.policy_node import PolicyNode
    except Exception as exc:     # ImportError, or a node module that does not load yet
        return {'skipped': f'ROS path not importable: {exc!r}'}

    context = rclpy.Context()
    rclpy.init(context=context)
    overrides = [Parameter('device', value=str(device)),
                 Parameter('capsule_dir', value=tempfile.mkdtemp(prefix='frt-bench-ros-')),
                 Parameter('policy_type', value=cfg['policy_type'])]
    node = PolicyNode(context=context, parameter_overrides=overrides)
    client = rclpy.create_node('flashrt_bench_client', context=context)
    executor = MultiThreadedExecutor(context=context)
    spinner = None
    try:
        # what main() does with autostart: configure, then activate
        if node.trigger_configure() != TransitionCallbackReturn.SUCCESS or \
                node.trigger_activate() != TransitionCallbackReturn.SUCCESS:
            return {'skipped': 'PolicyNode failed to configure/activate (see its log)'}
        executor.add_node(node)
        executor.add_node(client)
        spinner = threading.Thread(target=executor.spin, daemon=True)
        spinner.start()
        out = {'calls': cfg['calls'], 'policy_type': cfg['policy_type'],
               'graph': bool(node.engine.graph_captured)}
        out['restore'] = _restore_round_trips(client, fsrv, cfg['calls'], log)
        out['observation_to_action'] = _topic_round_trips(
            client, Float32MultiArray, node.engine.obs_dim, cfg['calls'], log)
        return out
    finally:
        executor.shutdown()
        if spinner is not None:
            spinner.join(timeout=5)
        try:
            node.trigger_deactivate()
            node.trigger_cleanup()
        except Exception:        # teardown of a half-started node must not hide the result
            pass
        node.destroy_node()
        client.destroy_node()
        context.try_shutdown()


def _restore_round_trips(client, fsrv, n, log):
    cli = client.create_client(fsrv.Restore, f'/{NODE}/restore')
    if not cli.wait_for_service(timeout_sec=10.0):
        return {'skipped': f'/{NODE}/restore did not appear within 10 s'}
    walls, served, failures = [], [], 0
    for i in range(n + 20):
        request = fsrv.Restore.Request()
        request.name = 'episode_start'          # the pinned capsule activate() takes
        done = threading.Event()
        t0 = time.perf_counter()
        future = cli.call_async(request)
        future.add_done_callback(lambda _f: done.set())
        if not done.wait(5.0):
            failures += 1
            continue
        us = (time.perf_counter() - t0) * 1e6
        response = future.result()
        if not response.success:
            failures += 1
            continue
        if i >= 20:                              # the first calls set up DDS paths
            walls.append(us)
            served.append(float(response.latency_us))
    log(f'  restore service: {len(walls)} calls, p50 {stats(walls)["p50"]:.0f} us')
    return {'round_trip': stats(walls), 'node_reported_latency': stats(served),
            'failures': failures}


def _topic_round_trips(client, msg_type, obs_dim, n, log):
    got = threading.Event()
    client.create_subscription(msg_type, f'/{NODE}/action', lambda _m: got.set(), 10)
    pub = client.create_publisher(msg_type, f'/{NODE}/observation', 10)
    deadline = time.time() + 10.0
    while time.time() < deadline and (pub.get_subscription_count() < 1 or
                                      client.count_publishers(f'/{NODE}/action') < 1):
        time.sleep(0.05)
    values = torch.randn(n + 20, obs_dim, generator=torch.Generator().manual_seed(5))
    walls, lost = [], 0
    for i in range(n + 20):
        msg = msg_type()
        msg.data = array.array('f', values[i].numpy().tobytes())
        got.clear()
        t0 = time.perf_counter()
        pub.publish(msg)
        if not got.wait(2.0):
            lost += 1
            continue
        if i >= 20:
            walls.append((time.perf_counter() - t0) * 1e6)
    log(f'  observation -> action: {len(walls)} messages, p50 {stats(walls)["p50"]:.0f} us')
    return {'round_trip': stats(walls), 'lost': lost}
