"""Service responses reach a caller that the server discovers late (executors.ResponseDelivery):
rmw_fastrtps drops a response whose caller's reader has not matched within 100 ms, and rclpy
only warns; the caller would wait forever (the G1 test's 60 s ~/reset_episode timeout)."""
import os
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytestmark = pytest.mark.ros

from rclpy.qos import DurabilityPolicy, qos_profile_services_default, QoSProfile  # noqa: E402
from std_srvs.srv import Trigger  # noqa: E402
from flashrt_ros.client import call_service, spin_in_thread  # noqa: E402
from flashrt_ros.executors import ResponseDelivery  # noqa: E402
from support.common import wait_for  # noqa: E402


class _Server:
    """A node with one Trigger service that counts its requests, a caller node, and one
    executor thread spinning both (as a Harness does)."""

    def __init__(self, tag, before_delivery=None, deadline_s=10.0):
        self.node = rclpy.create_node(f'delivery_{tag}_{os.getpid()}')
        self.requests = 0
        self.service_name = f'/delivery_{tag}_{os.getpid()}/trigger'
        self.service = self.node.create_service(Trigger, self.service_name, self._answer)
        if before_delivery:
            before_delivery(self.service)
        self.delivery = ResponseDelivery(self.node, deadline_s=deadline_s)
        self.caller = rclpy.create_node(f'delivery_{tag}_caller_{os.getpid()}')
        self.spinner = spin_in_thread(self.node, self.caller)

    def _answer(self, request, response):
        self.requests += 1
        response.success, response.message = True, f'request {self.requests}'
        return response

    def client(self, qos=qos_profile_services_default):
        return self.caller.create_client(Trigger, self.service_name, qos_profile=qos)

    def close(self):
        self.spinner.shutdown()
        self.node.destroy_node()
        self.caller.destroy_node()


def test_a_dropped_response_is_sent_again_until_the_caller_has_it(ros):
    drops = []

    def drop_twice(service):
        # what rclpy's binding raises under ResponseDelivery's filter when rmw_fastrtps
        # dropped the response (the next test gets it from rmw itself), after rmw's 100 ms
        send = service.send_response

        def flaky(response, header):
            if len(drops) < 2:
                drops.append(time.monotonic())
                time.sleep(0.1)
                raise SystemError('returned a result with an exception set') from \
                    RuntimeWarning('failed to send response (timeout): client will not '
                                   'receive response')
            send(response, header)
        service.send_response = flaky

    server = _Server('late', before_delivery=drop_twice)
    try:
        client = server.client()
        assert client.wait_for_service(timeout_sec=30)
        response, _ = call_service(client, Trigger.Request(), timeout=30)
        assert (response.success, response.message) == (True, 'request 1')
        assert len(drops) == 2 and server.requests == 1     # sent again, not run again
        assert (server.delivery.late, server.delivery.lost) == (1, 0)
    finally:
        server.close()


def test_a_response_rmw_cannot_deliver_is_given_up_on_without_holding_the_executor(ros):
    # a caller whose response reader never matches (it asks for transient-local durability,
    # the service offers volatile): rmw_fastrtps drops every response to it, for real
    server = _Server('never', deadline_s=2.0)
    try:
        plain = server.client()
        assert plain.wait_for_service(timeout_sec=30)
        deaf = server.client(QoSProfile(depth=10, durability=DurabilityPolicy.TRANSIENT_LOCAL))
        future = deaf.call_async(Trigger.Request())
        wait_for(lambda: server.requests == 1, what='the deaf caller\'s request served')
        # while that response is being sent again, the node answers others at once
        started = time.monotonic()
        response, seconds = call_service(plain, Trigger.Request(), timeout=30)
        assert response.message == 'request 2' and server.delivery.lost == 0
        assert time.monotonic() - started < 1.5, 'the executor waited on a lost response'
        wait_for(lambda: server.delivery.lost == 1, timeout=30, what='the response given up')
        assert server.delivery.late == 0 and not future.done()
    finally:
        server.close()
