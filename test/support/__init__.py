"""What the tests of every layer share that is not a fixture (fixtures: test/conftest.py).

test/conftest.py puts test/ on sys.path, so a test module of any layer imports these the same
way: `from support.common import wait_for`, `from support.nodes import Harness`. Modules:
common (observations, wait_for), filesystems (real mounts, dropped capabilities), rsl_models
(rsl_rl / Isaac Lab export layouts), nodes (a PolicyNode with its client: needs rclpy),
policy_exports and stacked_exports (real-format policy files).
"""
