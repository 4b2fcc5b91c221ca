"""flashrt_ros: execution-state capsules for robot policies on ROS 2."""
# The generated interfaces (flashrt_ros.msg, flashrt_ros.srv) and these hand-written modules
# may sit in two directories of sys.path (source tree and install tree); merge them.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
