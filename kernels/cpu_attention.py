"""C++ attention kernels for CPU (`kernels/csrc/paged_decode_attention.cpp`).

`paged_decode_attention` reads each sequence's K and V in place from the paged cache
(no gather copy), one pass over K for the scores and one over V for the output.
Against the torch reference (`kernels.attention.decode_attention`), which copies
every sequence's K/V out of its blocks and lines them up for two einsums, it moves
about a third of the bytes. Float32 only; built on first use by
`kernels.cpu_build` (None from `load()` means the reference is used).
"""

from __future__ import annotations

import torch

from kernels import cpu_build

_SOURCE = "paged_decode_attention"


def load():
    """The compiled module, or None when it cannot be built here."""
    return cpu_build.load(_SOURCE)


def build_error() -> str | None:
    return cpu_build.error(_SOURCE)


def paged_decode_attention(
    q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Same contract as `kernels.attention.decode_attention`, float32 on CPU."""
    batch, num_heads, head_dim = q.shape
    assert q.device.type == "cpu" and q.dtype == layer_cache.dtype == torch.float32, (q.device, q.dtype)
    assert layer_cache.dim() == 5 and layer_cache.shape[1] == 2 and layer_cache.shape[4] == head_dim
    assert layer_cache.stride(4) == 1, "the cache's last dimension must be contiguous"
    assert num_heads % layer_cache.shape[3] == 0, (num_heads, layer_cache.shape)
    assert block_tables.shape[0] == batch and context_lens.shape == (batch,)
    return load().paged_decode_attention(
        q.contiguous(), layer_cache, block_tables.contiguous(), context_lens, float(scale)
    )
