#!/usr/bin/env bash
# LeRobot and what it imports, for a benchmark device that has Python 3.12, torch and
# torchvision but no network: cp312 wheels, unpacked, pruned and xz-packed so that they fit the
# device's 64 MiB carry.
#   bash tools/pack_device_lerobot.sh                      # requirements/vla.txt (LeRobot 0.4.4)
#       -> .dev_lerobot/lerobot312.tar.xz
#   bash tools/pack_device_lerobot.sh requirements/vla-lerobot06.txt lerobot06
#       -> .dev_lerobot/lerobot06.tar.xz (LeRobot 0.6.1; what the device has already is left out:
#          torch, torchvision, triton, CUDA libraries, numpy, scipy, sympy, networkx, Pillow)
# On the device:
#   mkdir -p /tmp/lr && tar -xJf .dev_lerobot/<name>.tar.xz -C /tmp/lr
#   export PYTHONPATH=/tmp/lr:$PWD:$PWD/test:$PYTHONPATH
#   python -m benchmarks.vla_pi0 ... ; python -m pytest -p no:cacheprovider test/unit/... -m cuda
# Pruned: pandas' and pyarrow's tests and headers, Arrow Flight and S3 (never loaded by
# `import pyarrow`: pyarrow.fs skips S3 when absent), and PyAV with its codecs (about 100 MB):
# lerobot.datasets.video_utils imports av and reads av.logging.WARNING, so a placeholder module
# stands in that raises on any other use (policy inference never decodes video). OpenCV alike
# (LeRobot 0.6 imports cv2 with GR00T's processor, which every policy import loads).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
req=${1:-requirements/vla.txt}
name=${2:-lerobot312}
grep -v '^#\|^nvidia\|^cuda-\|^docopt\|^av==\|^torch\|^triton\|^numpy\|^scipy\|^sympy\|^mpmath\|^networkx\|^pillow\|^opencv\|^cmake\|^setuptools' \
  "$here/$req" > "$work/req.txt"
printf '%s\n' python-dateutil filelock jinja2 markupsafe six protobuf >> "$work/req.txt"
# pytest, to run the CUDA tests there (runtime.txt's pin)
printf '%s\n' pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 >> "$work/req.txt"
while read -r req; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 "$req" -d "$work/wheels"
done < "$work/req.txt"
mkdir "$work/site"
for wheel in "$work"/wheels/*.whl; do
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
    "$wheel" "$work/site"
done
cd "$work/site"
rm -rf pandas/tests pyarrow/tests pyarrow/include pyarrow/libarrow_flight.so* pyarrow/_flight* \
  pyarrow/libarrow_python_flight.so* pyarrow/libarrow_s3.so* pyarrow/_s3fs* \
  pyarrow/libarrow_python.so pyarrow/libarrow_python.so.*.*.*
find . -name __pycache__ -prune -exec rm -rf {} +
find . -name '*.pyi' -delete
mkdir av
cat > av/__init__.py <<'PY'
'''Not PyAV: a placeholder on the benchmark device only (tools/pack_device_lerobot.sh).'''
import types

logging = types.SimpleNamespace(WARNING=30)


def __getattr__(name):
    raise ImportError(f'av.{name}: PyAV is not installed on this device (placeholder module)')
PY
mkdir cv2
cat > cv2/__init__.py <<'PY'
'''Not OpenCV: a placeholder on the benchmark device only (tools/pack_device_lerobot.sh).'''


def __getattr__(name):
    raise ImportError(f'cv2.{name}: OpenCV is not installed on this device (placeholder module)')
PY
mkdir -p "$here/.dev_lerobot"
tar -cf - . | xz -T0 -6 > "$here/.dev_lerobot/$name.tar.xz"
ls -la "$here/.dev_lerobot/$name.tar.xz"
