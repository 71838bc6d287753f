"""RMSNorm and RoPE in C++ for CPU (`kernels/csrc/norm_rope.cpp`).

Same contracts as `kernels.norm.rms_norm` and `kernels.rope.apply_rope`, float32 on
CPU: one call each instead of 6 to 10 small torch ops, which is what a decode step
at small batch pays for (each torch op costs microseconds of dispatch whatever its
size). Built on first use by `kernels.cpu_build`; None from `load()` means the
references are used.
"""

from __future__ import annotations

import torch

from kernels import cpu_build
from kernels import norm as reference_norm
from kernels import rope as reference_rope

_SOURCE = "norm_rope"


def load():
    """The compiled module, or None when it cannot be built here."""
    return cpu_build.load(_SOURCE)


def build_error() -> str | None:
    return cpu_build.error(_SOURCE)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., C] float32 -> [..., C]."""
    assert x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu", (x.dtype, x.device)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1 or not weight.is_contiguous():  # layouts the kernel does not take
        return reference_norm.rms_norm(x, weight, eps)
    return load().rms_norm(rows, weight, float(eps)).view(x.shape)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d] float32; cos, sin [N, d] float32 -> [N, heads, d]."""
    assert x.dtype == torch.float32 and x.device.type == "cpu", (x.dtype, x.device)
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:  # each token's heads must be one run
        return reference_rope.apply_rope(x, cos, sin)
    return load().rope(x, cos.contiguous(), sin.contiguous())
