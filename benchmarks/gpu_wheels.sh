#!/usr/bin/env bash
# Wheels for running the GPU check on a machine with no network whose Python already
# has a CUDA PyTorch, Triton and transformers (a stock CUDA image): Ray, without the
# Java worker's jar (32 of its 79 MB; Tandem runs no Java), and every package Ray
# needs (those such images have are installed again, beside them: the same or newer).
#
#   bash benchmarks/gpu_wheels.sh [DIR]       # default DIR: .whl; about 48 MB
#
# Then, on the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   PYTHONPATH=/tmp/site bash benchmarks/gpu_check.sh
# PY_VERSION (default 3.12) and PLATFORM (default manylinux2014_x86_64) name the
# target machine's Python and platform; RAY_VERSION defaults to this project's Ray.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PY_VERSION="${PY_VERSION:-3.12}"
PLATFORM="${PLATFORM:-manylinux2014_x86_64}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY="${PYTHON:-.venv/bin/python}"
RAY_VERSION="${RAY_VERSION:-$("$PY" -c 'import ray; print(ray.__version__)')}"
mkdir -p "$DIR"
download() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform "$PLATFORM" --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$DIR" "$@"
}
# Ray's own requirements, and theirs (a stock image lacked some, and the P/D step could not import
# Ray), at the versions this project's Python runs Ray with
REQUIRED="jsonschema jsonschema-specifications referencing rpds-py attrs click msgpack protobuf requests urllib3 idna
  certifi charset-normalizer pyyaml filelock packaging"
# shellcheck disable=SC2046  # (one argument a package)
download "ray==$RAY_VERSION" $("$PY" -c 'import sys, importlib.metadata as m
print(" ".join(f"{name}=={m.version(name)}" for name in sys.argv[1:]))' $REQUIRED)
"$PY" - "$DIR" <<'EOF'
"""Rewrite Ray's wheel without ray/jars/ (its RECORD too, so the wheel stays valid)."""
import sys
import zipfile
from pathlib import Path

for wheel in Path(sys.argv[1]).glob("ray-*.whl"):
    stripped = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(stripped, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if item.filename.startswith("ray/jars/"):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith("ray/jars/")).encode()
            dst.writestr(item, data)
    stripped.replace(wheel)
    print(f"{wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB without ray/jars/")
EOF
du -sh "$DIR"
