"""Rotary position embeddings (neox style, as Llama and Qwen2 use), with scaling.

`rope_inv_freq` follows the published formulas: default, `linear` (positions divided
by the factor) and `llama3` (Llama 3.1's band-wise frequency scaling).
"""

from __future__ import annotations

import math

import torch

from kernels import wants_cpu_kernels, wants_triton_kernels


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, head_dim], float32."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, d]; cos, sin: [N, d] rows for each token's position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotated * sin


def select_apply_rope(backend: str, device: torch.device, dtype: torch.dtype):
    """`auto`: the C++ kernel (`kernels.cpu_norm_rope`) for float32 on CPU where it
    builds, the Triton kernel (`kernels.triton_elementwise`) on CUDA where Triton is
    installed (per call, for the layouts it takes); the reference otherwise.
    `torch`: always the reference."""
    if wants_cpu_kernels(backend, device, dtype):
        from kernels import cpu_norm_rope

        if cpu_norm_rope.load() is not None:
            return cpu_norm_rope.apply_rope
    if wants_triton_kernels(backend, device):
        from kernels import triton_elementwise

        return triton_elementwise.apply_rope
    return apply_rope
