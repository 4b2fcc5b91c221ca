"""The floor for section 7: a bare rclpy node in its own process serving std_srvs/Trigger on
~/trigger with an empty callback, spun exactly as the policy node is (executors.run).

    python3 -m benchmarks.trigger_server <node name>
"""
import sys

import rclpy
from std_srvs.srv import Trigger

from flashrt_ros.executors import run


def _answer(request, response):
    response.success = True
    return response


def main():
    rclpy.init()
    node = rclpy.create_node(sys.argv[1])
    node.create_service(Trigger, '~/trigger', _answer)
    run(node)


if __name__ == '__main__':
    main()
