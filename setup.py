"""pip install . : the flashrt_ros runtime as a plain Python library (no ROS needed).

The ROS package itself (interfaces, node, launch files) is built with colcon from
CMakeLists.txt; see README.md.
"""
from setuptools import setup

setup(
    name='flashrt_ros',
    version='0.1.0',
    description='Execution-state capsules for robot policies: snapshot, restore, fork and '
                'roll back a policy\'s complete state on captured CUDA graphs.',
    license='Apache-2.0',
    packages=['flashrt_ros', 'flashrt_ros.runtime'],
    python_requires='>=3.10',
    install_requires=['torch>=2.4', 'numpy', 'pyyaml', 'safetensors'],
)
