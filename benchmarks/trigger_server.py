"""The floors for section 7: a bare rclpy node in its own process, spun exactly as the policy
node is (executors.run), serving std_srvs/Trigger on ~/trigger with an empty callback and
echoing every Float32MultiArray from ~/observation to ~/action (the policy node's topics, same
QoS), so the same PolicyClient measures both floors.

    python3 -m benchmarks.trigger_server <node name>
"""
import sys

import rclpy
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from std_msgs.msg import Float32MultiArray
from std_srvs.srv import Trigger

from flashrt_ros.executors import run


def _answer(request, response):
    response.success = True
    return response


def main():
    rclpy.init()
    node = rclpy.create_node(sys.argv[1])
    node.create_service(Trigger, '~/trigger', _answer)
    qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100,
                     reliability=ReliabilityPolicy.RELIABLE)
    echo = node.create_publisher(Float32MultiArray, '~/action', qos)
    node.create_subscription(Float32MultiArray, '~/observation', echo.publish, qos)
    run(node)


if __name__ == '__main__':
    main()
