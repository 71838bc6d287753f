"""RMSNorm, computed in float32 as the Llama/Qwen2 reference implementations do."""

from __future__ import annotations

import torch

from kernels import wants_cpu_kernels, wants_triton_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


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
