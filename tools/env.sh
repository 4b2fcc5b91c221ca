# Source this file (bash) to use the package built by tools/bootstrap.sh:
#   source tools/env.sh
_flashrt_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck disable=SC1091
source "$_flashrt_root/.venv/bin/activate"
if [ -n "${ROS_DISTRO:-}" ] && [ -f "/opt/ros/$ROS_DISTRO/setup.bash" ]; then
  source "/opt/ros/$ROS_DISTRO/setup.bash"
fi
source "$_flashrt_root/install/setup.bash"
unset _flashrt_root
