#!/usr/bin/env bash
# The main job: sets up (tools/bootstrap.sh, idempotent), starts the policy node with the
# built-in seeded demo policy, and runs the demo driver against it. Exits with the driver's
# status (0 only if every check held). Extra arguments go to the node as --ros-args.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/tools/bootstrap.sh"
set +u  # colcon's setup scripts read unset variables
# shellcheck disable=SC1091
source "$ROOT/tools/env.sh"
set -u
export ROS_AUTOMATIC_DISCOVERY_RANGE=${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}
capsules=$(mktemp -d)
prefix=$(python -c 'from ament_index_python.packages import get_package_prefix; print(get_package_prefix("flashrt_ros"))')
"$prefix/lib/flashrt_ros/policy_node" --ros-args \
  --params-file "$prefix/share/flashrt_ros/config/policy.yaml" \
  -p capsule_dir:="$capsules" "$@" &
node_pid=$!
trap 'kill $node_pid 2>/dev/null; wait $node_pid 2>/dev/null; rm -rf "$capsules"' EXIT
"$prefix/lib/flashrt_ros/demo_driver"
