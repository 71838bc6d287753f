"""Paged decode attention and KV slot writes in Triton: the GPU path.

Same layouts and contracts as the torch reference in `kernels/attention.py`:

    layer_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]  (K at 0, V at 1)
    slot = block_id * block_size + offset

`paged_decode_attention` runs one program per (sequence, KV head). The program
loads the query heads that share that KV head (grouped-query attention: K and V are
read once per group, never copied per query head), then walks the sequence's block
table one block at a time with an online softmax (running max and sum), so no
score matrix over the whole context is ever materialised. Scores and the output
accumulate in float32; with a float32 cache the dot products use IEEE precision
(no TF32), so float32 results track the reference closely.

`write_kv_slots` runs one program per (token, KV head) and stores that head's K and
V row at the token's slot.

Prefill attention is in `kernels/triton_prefill.py`, block copies for transfers in
`kernels/triton_blocks.py`. No speed is claimed for any of them: none has been
timed on a GPU yet (`benchmarks/gpu_check_kernels.py` does that).

This module imports Triton at import time: import it only where Triton is
installed (the `gpu` extra). `supports_decode` says which shapes the kernel takes
(power-of-two head_dim and block_size of at least 16); `kernels.attention`'s
dispatcher falls back to the reference for the rest. On CPU the kernels run under
Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is imported),
which is how the tests check them against the reference without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MIN_DOT = 16  # tl.dot's smallest dimension


def supports_decode(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return num_heads % num_kv_heads == 0 and pow2(head_dim) and head_dim >= _MIN_DOT and pow2(block_size) \
        and block_size >= _MIN_DOT


@triton.jit
def online_softmax_step(scores, v, running_max, running_sum, acc, PRECISION: tl.constexpr):
    """Fold one cache block into a running softmax-weighted sum: scores [M, BLOCK_SIZE]
    float32 (-inf where masked), v [BLOCK_SIZE, HEAD_DIM]; returns the new running
    max, sum and acc [M, HEAD_DIM] (acc and sum rescaled to the new max)."""
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    probs = tl.exp(scores - new_max[:, None])
    rescale = tl.exp(running_max - new_max)
    running_sum = running_sum * rescale + tl.sum(probs, 1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
    return new_max, running_sum, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, scale,
    stride_qb, stride_qh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    stride_tb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, PADDED_GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(lens_ptr + seq)
    group = tl.arange(0, PADDED_GROUP)
    in_group = group < GROUP
    heads = kv_head * GROUP + group
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=in_group[:, None],
                other=0.0)
    q = (q.to(tl.float32) * scale).to(q.dtype)
    running_max = tl.full([PADDED_GROUP], float("-inf"), tl.float32)
    running_sum = tl.zeros([PADDED_GROUP], tl.float32)
    acc = tl.zeros([PADDED_GROUP, HEAD_DIM], tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    for index in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * stride_tb + index)
        valid = index * BLOCK_SIZE + offsets < context_len
        rows = cache_ptr + block * stride_cb + offsets[:, None] * stride_cs + kv_head * stride_ch + dims[None, :]
        k = tl.load(rows, mask=valid[:, None], other=0.0)
        v = tl.load(rows + stride_ckv, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [G, BLOCK_SIZE], float32
        scores = tl.where(valid[None, :], scores, float("-inf"))
        running_max, running_sum, acc = online_softmax_step(scores, v, running_max, running_sum, acc, PRECISION)
    out = acc / running_sum[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])


def paged_decode_attention(
    q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [B, H, d]; block_tables: [B, max_blocks] int; context_lens: [B] int, each
    >= 1. Returns [B, H, d] in q's dtype. Shapes must pass `supports_decode`."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    assert supports_decode(num_heads, num_kv_heads, head_dim, block_size), (q.shape, layer_cache.shape)
    assert layer_cache.stride(4) == 1 and q.stride(2) == 1, "head_dim must be contiguous"
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    _paged_decode_kernel[(batch, num_kv_heads)](
        q, layer_cache, block_tables, context_lens, out, float(scale),
        q.stride(0), q.stride(1),
        layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2), layer_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, PADDED_GROUP=max(_MIN_DOT, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


@triton.jit
def _write_slots_kernel(
    cache_ptr, k_ptr, v_ptr, slots_ptr,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    stride_kn, stride_kh, stride_vn, stride_vh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    dims = tl.arange(0, HEAD_DIM)
    row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head * stride_ch + dims
    k = tl.load(k_ptr + token * stride_kn + head * stride_kh + dims)
    v = tl.load(v_ptr + token * stride_vn + head * stride_vh + dims)
    tl.store(row, k.to(cache_ptr.dtype.element_ty))
    tl.store(row + stride_ckv, v.to(cache_ptr.dtype.element_ty))


def supports_write(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Power-of-two head_dim, each head's row contiguous in the cache and in k and v."""
    head_dim = k.shape[-1]
    return head_dim & (head_dim - 1) == 0 and layer_cache.stride(4) == 1 and k.stride(2) == 1 and v.stride(2) == 1


def write_kv_slots(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """K and V of N tokens ([N, kvh, d] each) into their slots ([N] int). The layout
    must pass `supports_write`."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,), (k.shape, v.shape, slot_mapping.shape)
    assert supports_write(layer_cache, k, v), "power-of-two head_dim, contiguous rows"
    if num_tokens == 0:
        return
    _write_slots_kernel[(num_tokens, num_kv_heads)](
        layer_cache, k, v, slot_mapping,
        layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2), layer_cache.stride(3),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        BLOCK_SIZE=layer_cache.shape[2], HEAD_DIM=head_dim,
    )
