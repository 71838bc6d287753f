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
    return load().rms_norm(rows, weight, float(eps)).view(x.shape)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d] float32; cos, sin [N, d] -> [N, heads, d]."""
    assert x.dtype == torch.float32 and x.device.type == "cpu", (x.dtype, x.device)
    return load().rope(x, cos.contiguous(), sin.contiguous())
