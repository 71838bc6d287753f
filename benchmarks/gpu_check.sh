#!/usr/bin/env bash
# The GPU check (issue: GPU path): one script, one GPU, within 8 minutes.
#
#   bash benchmarks/gpu_check.sh          # results in $OUT, or ./gpu-results
#
# Runs benchmarks/gpu_check.py on CUDA (kernels against torch, engine token-exactness
# against transformers, prefill MFU and decode MBU against measured peaks, P and D as
# two actors on the one GPU), then the diagnostics that say why the figures are what
# they are (benchmarks/gpu_profile.py: where a prefill's and a decode step's time
# goes; benchmarks/gpu_decode_sweep.py: the decode kernel's launch shapes), then the
# NCCL channel tests where two GPUs are present. On the first H200 run (forty-fifth
# session) the check's steps took 135 s with the installs and model builds, the
# diagnostics (run apart there) about a minute more.
# Uses $PYTHON, else .venv/bin/python if it sees a GPU, else python3; that Python
# needs a CUDA torch, Triton and transformers, and for the P/D step Ray (and cupy for
# NCCL): `pip install -e '.[gpu]'` on a machine with network; on one without, a
# stock CUDA PyTorch image plus the wheels `benchmarks/gpu_wheels.sh` gathers.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && \
   .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  PY=.venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
if ! "$PY" -c "import torch, triton, transformers, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "gpu_check: $PY needs a CUDA GPU and torch, triton, transformers (pip install -e '.[gpu]')" >&2
  exit 2
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
status=0
# Each part's limit, within the 8 minutes together (two GPUs: the NCCL tests' minute more);
# gpu_check.json keeps each step's results, and the goals, as the steps end.
timeout 300 "$PY" -m benchmarks.gpu_check --device cuda --out-dir "$OUT" 2>&1 | tee "$OUT/gpu_check.log" || status=1
timeout 90 "$PY" -m benchmarks.gpu_profile --device cuda --out-dir "$OUT" 2>&1 | tee "$OUT/diagnostics.log" || status=1
timeout 60 "$PY" -m benchmarks.gpu_decode_sweep --out-dir "$OUT" 2>&1 | tee -a "$OUT/diagnostics.log" || status=1
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then  # NCCL P2P needs two GPUs
  timeout 60 "$PY" -m pytest -q tests/test_kv_channels.py 2>&1 | tee "$OUT/nccl_channels.log" || status=1
else
  echo "one GPU: the NCCL P2P channel tests need two and were not run" | tee "$OUT/nccl_channels.log"
fi
exit $status
