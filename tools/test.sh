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
# Tests kill nodes with SIGKILL on purpose, and a killed Fast DDS participant leaves its
# shared-memory files in /dev/shm; across many runs ~1,000 piled up on a developer machine and
# a run hung. Fast DDS's own tool removes only zombies (files no live process holds).
clean_shm() {
    if command -v fastdds >/dev/null; then timeout 60 fastdds shm clean >/dev/null 2>&1 || true; fi
}
clean_shm
# `python -m pytest` would put the source tree first on sys.path; the installed package and
# the source package are merged by flashrt_ros/__init__.py either way.
status=0
python -m pytest -ra "$@" || status=$?
clean_shm
exit "$status"
