"""The simulated worlds and the `flashrt_sim` node.

world.py         `World` (what the episode runner needs from a simulator), `MujocoSnapshots`
                 (bit-exact named snapshots of a MuJoCo world), `require_mujoco`
cartpole.py      `MujocoWorld`: the headless MuJoCo cart-pole (no ROS)
robot_world.py   `RobotWorld`: a floating-base robot from an MJCF file under joint PD control
                 (no ROS), and upstream's (unitree_rl_gym) config and policy loop
gazebo_world.py  `GazeboWorld`: a Gazebo world through the ROS 2 simulation interfaces
sim_node.py      the `flashrt_sim` node serving a cart-pole or MJCF world over ROS 2

Nothing here imports flashrt_ros.harness (what drives a policy node from outside).
"""
