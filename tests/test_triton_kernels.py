"""The Triton kernels (kernels/triton_attention.py) against the torch reference, on
CPU under Triton's interpreter: `tests/triton_kernel_checks.py`, run in a process of
its own with TRITON_INTERPRET=1. Skipped where Triton is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_triton_kernels_match_the_reference_under_the_interpreter():
    checks = Path(__file__).with_name("triton_kernel_checks.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=checks.parent.parent)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def test_the_cuda_dispatch_falls_back_to_the_reference_for_shapes_triton_does_not_take():
    """Choosing the CUDA path needs no GPU; a head_dim of 80 (not a power of two)
    must go to the reference, here run on CPU tensors."""
    import torch

    from kernels.attention import decode_attention, select_decode_attention

    attend = select_decode_attention("auto", torch.device("cuda"), torch.float16)
    assert attend is not decode_attention  # the Triton path, with its fallback
    cache = torch.randn(8, 2, 16, 2, 80)
    q, tables, lens = torch.randn(2, 4, 80), torch.tensor([[0, 1], [2, 3]]), torch.tensor([20, 5])
    torch.testing.assert_close(attend(q, cache, tables, lens, 0.1), decode_attention(q, cache, tables, lens, 0.1))
