'''flashrt_ros runtime: state arena, capsules, graphs, policies and engine (no rclpy).'''
