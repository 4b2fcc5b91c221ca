"""The flashrt_policy node: lifecycle and composition (policy_node.py), typed parameters
(parameters.py, settings.py), robot topics (robot_io.py), the one control path
(control_loop.py), per-session safety (guard.py), capsule services (capsule_services.py) and
status and diagnostics (diagnostics.py)."""
