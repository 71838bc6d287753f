"""RoPE, then the KV cache write: what an attention layer does with its QKV
projection before it attends.

q's and k's heads are rotated (RoPE, over both in one call: they are adjacent in
the fused QKV output), then k's rotated heads and v go into the paged cache at the
tokens' slots. On a GPU that is two kernels, the second reading back the k the
first just wrote; `kernels.triton_elementwise.rope_and_write_kv` does both in one
program per token, so a decoder layer runs 9 kernels instead of 10 (SGLang's RoPE
kernel takes the cache write along the same way). `rope_and_write_kv` here is the
reference: the two kernels in turn.
"""

from __future__ import annotations

import functools

import torch

from kernels import wants_triton_kernels
from kernels.attention import select_write_kv_slots, write_kv_slots
from kernels.rope import apply_rope, select_apply_rope


def rope_and_write_kv(
    qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor, rope=apply_rope, write=write_kv_slots,
) -> torch.Tensor:
    """qk: [N, q_heads + kv_heads, d], q's heads then k's; v: [N, kv_heads, d];
    cos, sin: [N, d]; slot_mapping: [N]. Returns qk rotated (a new tensor), after
    writing its k heads and v to `layer_cache` at the slots. `rope` and `write`
    are the kernels to use (the references by default)."""
    rotated = rope(qk, cos, sin)
    write(layer_cache, rotated[:, qk.shape[1] - v.shape[1] :], v, slot_mapping)
    return rotated


def select_rope_and_write_kv(backend: str, device: torch.device, dtype: torch.dtype):
    """`auto` on CUDA with Triton: the fused Triton kernel (per call, for the layouts
    it takes). Elsewhere the reference over the RoPE and slot-write kernels that
    `select_apply_rope` and `select_write_kv_slots` pick."""
    if wants_triton_kernels(backend, device):
        from kernels import triton_elementwise

        return triton_elementwise.rope_and_write_kv
    return functools.partial(rope_and_write_kv, rope=select_apply_rope(backend, device, dtype),
                             write=select_write_kv_slots(backend, device))
