"""pip install . : the flashrt_ros runtime as a plain Python library (no ROS needed).

The ROS package itself (interfaces, node, launch files) is built with colcon from
CMakeLists.txt; see README.md.
"""
from setuptools import find_packages, setup

setup(
    name='flashrt_ros',
    version='0.1.0',
    description='Execution-state capsules for robot policies: snapshot, restore, fork and '
                'roll back a policy\'s complete state on captured CUDA graphs.',
    license='Apache-2.0',
    # every package under flashrt_ros/, found rather than listed: a list forgot
    # flashrt_ros.runtime.policies (test/system/test_pip_install.py installs and imports each)
    packages=find_packages(include=['flashrt_ros', 'flashrt_ros.*']),
    python_requires='>=3.10',
    install_requires=['torch>=2.4', 'numpy', 'pyyaml', 'safetensors'],
)
