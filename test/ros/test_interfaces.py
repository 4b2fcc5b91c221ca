"""The generated interfaces import and travel through real rclpy services over Fast DDS."""
import threading

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytestmark = pytest.mark.ros

from rclpy.executors import MultiThreadedExecutor  # noqa: E402

from flashrt_ros import msg as fmsg  # noqa: E402
from flashrt_ros import srv as fsrv  # noqa: E402

SERVICES = ['Snapshot', 'Restore', 'Fork', 'Rollback', 'ListCapsules', 'DeleteCapsule',
            'SaveCapsule', 'LoadCapsule']


def _info(name):
    info = fmsg.CapsuleInfo()
    info.name = name
    info.parent = 'episode_start'
    info.tier = 'host'
    info.pinned = True
    info.step = 2 ** 40 + 3         # uint64 survives
    info.episode = 7
    info.position = 2048
    info.nbytes = 123456789
    info.schema_digest = 'ab' * 32
    info.model_digest = 'cd' * 32
    info.stamp.sec = 12
    info.stamp.nanosec = 34
    return info


def _answer(kind, request, response):
    """Fills a response from the request, so the client can check both directions."""
    if kind == 'ListCapsules':
        response.capsules = [_info('a'), _info('b')]
        response.device_bytes_used = 10
        response.device_bytes_budget = 20
        response.host_bytes_used = 30
        response.host_bytes_budget = 40
        return response
    response.success = True
    response.message = '%s ok' % kind
    if kind == 'Rollback':
        response.step = request.steps + 100
    if hasattr(response, 'capsule'):
        name = getattr(request, 'name', '') or getattr(request, 'target', '')
        response.capsule = _info(name)
    if hasattr(response, 'latency_us'):
        response.latency_us = 12.5
    if kind == 'SaveCapsule':
        response.path = request.path
        response.nbytes = 99
    return response


def _request(kind):
    request = getattr(fsrv, kind).Request()
    for field, value in (('name', 'cap-1'), ('target', 'cap-1'), ('source', 'src'),
                         ('steps', 5), ('path', 'x/cap.capsule'), ('overwrite', True),
                         ('pin', True)):
        if hasattr(request, field):
            setattr(request, field, value)
    return request


@pytest.fixture
def ros_pair():
    rclpy.init()
    server = rclpy.create_node('interface_server')
    client = rclpy.create_node('interface_client')
    executor = MultiThreadedExecutor()
    executor.add_node(server)
    executor.add_node(client)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    yield server, client
    executor.shutdown()
    server.destroy_node()
    client.destroy_node()
    rclpy.shutdown()
    spinner.join(timeout=5)


def test_every_interface_imports():
    for kind in SERVICES:
        srv_type = getattr(fsrv, kind)
        assert srv_type.Request and srv_type.Response
    status = fmsg.PolicyStatus()
    status.rejected_observations = 2 ** 63
    assert status.rejected_observations == 2 ** 63
    assert fmsg.CapsuleInfo().stamp.sec == 0


@pytest.mark.parametrize('kind', SERVICES)
def test_service_round_trip(ros_pair, kind):
    server, client = ros_pair
    srv_type = getattr(fsrv, kind)
    seen = []

    def callback(request, response):
        seen.append(request)
        return _answer(kind, request, response)

    server.create_service(srv_type, 'roundtrip_' + kind.lower(), callback)
    cli = client.create_client(srv_type, 'roundtrip_' + kind.lower())
    assert cli.wait_for_service(timeout_sec=10.0), 'service never appeared'
    request = _request(kind)
    future = cli.call_async(request)
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    assert done.wait(10.0), 'no response within 10 s'
    response = future.result()
    assert len(seen) == 1
    assert seen[0] == request
    assert response == _answer(kind, request, srv_type.Response())
    if kind == 'ListCapsules':
        assert [c.name for c in response.capsules] == ['a', 'b']
        assert response.capsules[0].step == 2 ** 40 + 3
    else:
        assert response.success and response.message == '%s ok' % kind
