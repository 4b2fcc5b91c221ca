#!/usr/bin/env bash
# Sets up (tools/bootstrap.sh, idempotent) and runs the whole test suite on this machine.
# CUDA-marked tests are skipped, with the reason, where no GPU is present.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/tools/bootstrap.sh"
# shellcheck disable=SC1091
set +u  # colcon's setup scripts read unset variables
source "$ROOT/tools/env.sh"
set -u
cd "$ROOT"
# `python -m pytest` would put the source tree first on sys.path; the installed package and
# the source package are merged by flashrt_ros/__init__.py either way.
exec python -m pytest -ra "$@"
