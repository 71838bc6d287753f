"""RMSNorm, computed in float32 as the Llama/Qwen2 reference implementations do, and
RMSNorm fused with the residual add before it (`add_rms_norm`): a decoder layer
adds each sublayer's output to the residual stream and normalises the sum, two
kernels on a GPU that one does (`kernels.triton_elementwise`)."""

from __future__ import annotations

import functools

import torch

from kernels import wants_cpu_kernels, wants_triton_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, norm=rms_norm
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): the sum in x's dtype, as `x + residual`;
    `norm` an RMSNorm kernel (the reference by default)."""
    summed = x + residual
    return norm(summed, weight, eps), summed


def select_rms_norm(backend: str, device: torch.device, dtype: torch.dtype):
    """`auto`: the C++ kernel (`kernels.cpu_norm_rope`) for float32 on CPU where it
    builds, the Triton kernel (`kernels.triton_elementwise`) on CUDA where Triton is
    installed (per call, for the layouts it takes); the reference otherwise.
    `torch`: always the reference."""
    if wants_cpu_kernels(backend, device, dtype):
        from kernels import cpu_norm_rope

        if cpu_norm_rope.load() is not None:
            return cpu_norm_rope.rms_norm
    if wants_triton_kernels(backend, device):
        from kernels import triton_elementwise

        return triton_elementwise.rms_norm
    return rms_norm


def select_add_rms_norm(backend: str, device: torch.device, dtype: torch.dtype):
    """`auto` on CUDA with Triton: one fused kernel (`kernels.triton_elementwise`);
    elsewhere the add, then the RMSNorm `select_rms_norm` picks (on CPU the add is
    one op whatever it is fused with)."""
    if wants_triton_kernels(backend, device):
        from kernels import triton_elementwise

        return triton_elementwise.add_rms_norm
    norm = select_rms_norm(backend, device, dtype)
    return add_rms_norm if norm is rms_norm else functools.partial(add_rms_norm, norm=norm)
