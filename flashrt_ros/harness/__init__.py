"""What drives a policy node from outside: episodes of a simulated world, and the demo.

links.py           how a step reaches the node: observation_link (flat ~/observation and
                   ~/action), RobotLink (a robot world's readings and joint commands),
                   request_actions (several robot links in one step), BatchedLink (the
                   sessions of fleet nodes)
fleet.py           Fleet: the policy node sessions that run branches in parallel
episode_runner.py  EpisodeRunner: episodes, snapshots and what-if branches of a world and a
                   policy node, replayed bit for bit; the `episode_runner` executable
simulator_world.py SimulatorWorld: any simulator serving simulation_interfaces, driven in
                   paused lock-step (flashrt_sim, Gazebo, Isaac Sim)
demo_driver.py     the `demo_driver` executable: drives a policy node as a robot and a task
                   planner would

The worlds come from flashrt_ros.sim; the node is reached through flashrt_ros.client.
"""
