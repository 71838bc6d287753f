"""Paged prefill attention in Triton: one chunk over its cached prefix, the GPU path.

Same contract as `kernels.attention.prefill_attention`: the chunk's `q_len` queries
sit at positions `[ctx_len - q_len, ctx_len)`, their own K/V are already in the
paged cache, attention is causal, and query heads share KV heads in groups (GQA).

Layout of the work: the chunk's (query token, query head) pairs that share one KV
head are laid out as rows, token-major (`row = token * GROUP + head_in_group`), and
one program takes a tile of BLOCK_M consecutive rows for one KV head. So each K/V
block is read once per tile for all the query heads of its group, and a group size
that is not a power of two (Qwen2.5-0.5B's 7) wastes no rows except at the chunk's
end. The program walks the sequence's keys a tile at a time (`tile_keys`, 64 keys
at head_dim 64: several cache blocks, each key's block looked up in the table), up
to the last position any of its rows may see, reading K and V in place from the
cache (no gather copy), with an online softmax (running max and sum per row), so no
score matrix over the whole context is materialised. Every row sees key 0, so the
running max is finite after the first block and no row divides by zero.
Scores and the output accumulate in float32; with a float32 cache the dot products
use IEEE precision (no TF32), so float32 results track the reference closely.

Not tuned: fixed tile sizes. The dispatcher
(`kernels.attention.select_prefill_attention`) gives it only chunks over a cached
prefix; a chunk with no prefix goes to SDPA (flash attention). How it
compares with torch SDPA on a GPU is for `benchmarks/gpu_check.py` to measure; it
has not been measured yet.

Imports Triton at import time, like `kernels/triton_attention.py`; `supports_prefill`
says which shapes the kernel takes and `kernels.attention`'s dispatcher falls back to
the reference for the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_attention import online_softmax_step, supports_decode, tile_keys

_MAX_BLOCK_M = 64  # rows (query token x head in group) per program


def supports_prefill(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Same shape limits as the decode kernel: KV heads dividing the query heads,
    power-of-two head_dim and block_size, each at least tl.dot's minimum of 16."""
    return supports_decode(num_heads, num_kv_heads, head_dim, block_size)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, cache_ptr, table_ptr, out_ptr, scale, q_len, ctx_len,
    stride_qt, stride_qh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    stride_table,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    is_row = tokens < q_len
    num_cached = ctx_len - q_len
    # Rows past the chunk's end take the last token's position, so they stay finite.
    positions = num_cached + tl.minimum(tokens, q_len - 1)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=is_row[:, None], other=0.0)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last_position = tl.max(positions, 0)
    for tile_start in range(0, last_position + 1, TILE):
        key_positions = tile_start + tl.arange(0, TILE)
        in_context = key_positions < ctx_len
        blocks = tl.load(table_ptr + (key_positions // BLOCK_SIZE) * stride_table, mask=in_context, other=0)
        slots = (cache_ptr + blocks[:, None] * stride_cb + (key_positions % BLOCK_SIZE)[:, None] * stride_cs
                 + kv_head * stride_ch + dims[None, :])
        k = tl.load(slots, mask=in_context[:, None], other=0.0)
        v = tl.load(slots + stride_ckv, mask=in_context[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale  # [BLOCK_M, TILE]
        visible = key_positions[None, :] <= positions[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        running_max, running_sum, acc = online_softmax_step(scores, v.to(q.dtype), running_max, running_sum, acc,
                                                            PRECISION)
    out = acc / running_sum[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=is_row[:, None])


def paged_prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    layer_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_len: int,
    scale: float,
) -> torch.Tensor:
    """q: [q_len, H, d]; layer_cache: [num_blocks, 2, block_size, kvh, d] holding the
    chunk's K/V as well as the prefix's; block_table: [>= ceil(ctx_len / block_size)]
    int, on q's device. `k_new` and `v_new` are unused (the kernel reads the cache);
    they keep the reference's signature. Returns [q_len, H, d] in q's dtype. Shapes
    must pass `supports_prefill`."""
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    assert supports_prefill(num_heads, num_kv_heads, head_dim, block_size), (q.shape, layer_cache.shape)
    assert layer_cache.shape[1] == 2 and layer_cache.shape[4] == head_dim, (q.shape, layer_cache.shape)
    assert layer_cache.stride(4) == 1 and q.stride(2) == 1, "head_dim must be contiguous"
    assert 0 < q_len <= ctx_len and block_table.dim() == 1, (q_len, ctx_len, block_table.shape)
    assert block_table.shape[0] * block_size >= ctx_len, (block_table.shape, ctx_len, block_size)
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    block_m = min(_MAX_BLOCK_M, max(16, triton.next_power_of_2(q_len * group)))
    _paged_prefill_kernel[(triton.cdiv(q_len * group, block_m), num_kv_heads)](
        q, layer_cache, block_table, out, float(scale), q_len, ctx_len,
        q.stride(0), q.stride(1),
        layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2), layer_cache.stride(3),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, TILE=tile_keys(head_dim),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
