#!/usr/bin/env bash
# The LeRobot chunk policies' tests again on LeRobot 0.6.1, the release Python 3.12 users (ROS 2
# Jazzy on Ubuntu 24.04) install; CI's Python 3.11 runs them on LeRobot 0.4.4 (tools/test.sh).
#   bash tools/test_lerobot06.sh [pytest arguments]      (PYTHON312: the interpreter to use)
# Makes .venv-lerobot06 (or uses LEROBOT06_VENV; requirements/vla-lerobot06.txt, about 5 GB: PyPI's torch 2.11 is its
# CUDA build, which also runs on the CPU) and runs test/unit/test_lerobot_{chunk,pi0}.py there,
# without ROS: the node's own tests need the ROS build of tools/bootstrap.sh (Python 3.11).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON312=${PYTHON312:-$(command -v python3.12 || echo "$HOME/.pyenv/versions/3.12.1/bin/python")}
VENV=${LEROBOT06_VENV:-$ROOT/.venv-lerobot06}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON312" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q -r "$ROOT/requirements/vla-lerobot06.txt" pytest==9.2.0
cd "$ROOT/test"     # not the repository root: the installed flashrt_ros is not wanted here
PYTHONPATH=$ROOT:$ROOT/test exec "$VENV/bin/python" -m pytest -ra -p no:cacheprovider \
    "$ROOT/test/unit/test_lerobot_chunk.py" "$ROOT/test/unit/test_lerobot_pi0.py" "$@"
