"""The simulated worlds and the `flashrt_sim` node.

world.py         `World` (what the episode runner needs from a simulator), `MujocoSnapshots`
                 (bit-exact named snapshots of a MuJoCo world; its entities and their states),
                 `require_mujoco`
cartpole.py      `MujocoWorld`: the headless MuJoCo cart-pole (no ROS)
robot_world.py   `RobotWorld`: a floating-base robot from an MJCF file under joint PD control
                 (no ROS), and upstream's (unitree_rl_gym) config and policy loop
sim_node.py      the `flashrt_sim` node serving a cart-pole or MJCF world over ROS 2
stepping.py             how that node steps: simulation state, lock-step modes, following a
                        policy's rollbacks
simulation_services.py  the ROS standard simulator API (simulation_interfaces) on that node
world_capsules.py       named world states, their files (the policy capsules' rules) and services

Nothing here imports flashrt_ros.harness (what drives a policy node from outside).
"""
