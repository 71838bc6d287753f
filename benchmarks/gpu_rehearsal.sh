#!/usr/bin/env bash
# A rehearsal of the GPU check on a CPU machine, in an environment like the lent
# H200's image, so that a device run (15 minutes, all tries together) does not first
# fail on a missing package or a version it had not met:
#
#   bash benchmarks/gpu_rehearsal.sh        # about 2 min the first time (1 min 52 s here), 1 min after
#
# The image (device tool's KINDS.md, read 2026-11; so it was on the H200 lent in the
# forty-fifth session) has Python 3.12, CUDA torch 2.11,
# Triton 3.6, transformers 5.17, tokenizers 0.23.2, huggingface_hub 1.33, aiohttp,
# grpcio and prometheus_client, and no Ray, pydantic, fastapi, uvicorn, aiohttp_cors
# or opencensus (so Ray runs as its minimal install there). This builds a venv with
# those versions (torch and Python depart from it: the CPU 2.13.0 wheel on this
# machine's disk, for Python 3.11), takes Ray from the wheels `benchmarks/gpu_wheels.sh`
# gathers, installed as on the device (`--target`, then PYTHONPATH), and runs the GPU
# check's steps and its profile on CPU with the tiny model. The `kernels` step (and
# the decode sweep) is left out: Triton 3.6's interpreter cannot run the
# attention kernels (docs/benchmarks.md, GPU check);
# `tests/triton_compile_checks.py` checks them against 3.6's compiler instead.
# ENV_DIR (default /tmp/tandem-device-like) holds the venv, wheels and site; OUT the
# results (default ./gpu-rehearsal).
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR="${ENV_DIR:-/tmp/tandem-device-like}"
OUT="${OUT:-gpu-rehearsal}"
PY="${PYTHON:-python3.11}"
IMAGE_PACKAGES=(
  "transformers==5.17.0" "tokenizers==0.23.2" "huggingface_hub==1.33.0" safetensors numpy tqdm jinja2 httpx
  aiohttp grpcio prometheus_client protobuf msgpack click filelock pyyaml requests psutil packaging
)
NOT_ON_IMAGE=(pydantic pydantic-core fastapi starlette uvicorn aiohttp-cors opencensus ray)
if [ ! -x "$ENV_DIR/bin/python" ]; then
  "$PY" -m venv "$ENV_DIR"
  "$ENV_DIR/bin/python" -m pip install -q "torch==2.13.0"
  "$ENV_DIR/bin/python" -m pip install -q "${IMAGE_PACKAGES[@]}"
fi
# Dependencies pulled in here that the image lacks (a newer typer needs pydantic) go.
"$ENV_DIR/bin/python" -m pip uninstall -q -y "${NOT_ON_IMAGE[@]}" 2>/dev/null || true
version=$("$ENV_DIR/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
PY_VERSION="$version" bash benchmarks/gpu_wheels.sh "$ENV_DIR/wheels"
"$ENV_DIR/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$ENV_DIR/site" "$ENV_DIR"/wheels/*.whl
export PYTHONPATH="$ENV_DIR/site" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" PYTHONUNBUFFERED=1
"$ENV_DIR/bin/python" -m benchmarks.gpu_check --device cpu --steps exactness,roofline,graphs,pd \
  --prefill-tokens 128 --decode-batch 4 --out-dir "$OUT"
"$ENV_DIR/bin/python" -m benchmarks.gpu_profile --device cpu --prefill-tokens 64 --decode-batch 4 --out-dir "$OUT"
