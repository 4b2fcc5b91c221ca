"""Benchmarks for the flashrt_ros runtime: run with `python -m benchmarks.run` (see README.md)."""
