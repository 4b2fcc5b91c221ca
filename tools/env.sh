# Source this file (bash) to use the package built by tools/bootstrap.sh:
#   source tools/env.sh
_flashrt_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck disable=SC1091
source "$_flashrt_root/.venv/bin/activate"
if [ -n "${ROS_DISTRO:-}" ] && [ -f "/opt/ros/$ROS_DISTRO/setup.bash" ]; then
  source "/opt/ros/$ROS_DISTRO/setup.bash"
fi
source "$_flashrt_root/install/setup.bash"
# The ros-jazzy wheels keep their ament index (package.xml, interface files) in the venv prefix:
# ros2 interface/pkg and XML launch files look for packages there.
case ":${AMENT_PREFIX_PATH:-}:" in
  *":$VIRTUAL_ENV:"*) ;;
  *) export AMENT_PREFIX_PATH=${AMENT_PREFIX_PATH:+$AMENT_PREFIX_PATH:}$VIRTUAL_ENV ;;
esac
unset _flashrt_root
