"""The MLP's activation: silu(gate) * up over the fused gate/up projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import wants_triton_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2I] (gate, then up) -> [N, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def select_silu_and_mul(backend: str, device: torch.device) -> Callable:
    """`auto`: the Triton kernel (`kernels.triton_elementwise`) on CUDA where Triton
    is installed (per call, for the layouts it takes); the reference otherwise.
    `torch`: always the reference."""
    if wants_triton_kernels(backend, device):
        from kernels import triton_elementwise

        return triton_elementwise.silu_and_mul
    return silu_and_mul
