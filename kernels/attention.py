"""Paged attention, torch reference (CPU and any device torch supports).

KV cache layout, block-major ("page-first"), one tensor per worker:

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

so one block is a contiguous span across all layers and a run of consecutive block
ids is one contiguous tensor (a KV transfer needs no gather). A layer's view,
`kv_cache[:, layer]`, is `[num_blocks, 2, block_size, num_kv_heads, head_dim]`;
index 0 of the second axis is K, 1 is V.

Token slots are addressed as `slot = block_id * block_size + offset`.

Two entry points:
- `prefill_attention`: one sequence's chunk of `q_len` new tokens over its cached
  prefix (positions `[ctx_len - q_len, ctx_len)`), causal.
- `decode_attention`: a batch of single-token queries over block tables of different
  lengths.
Both support grouped-query attention (num_heads a multiple of num_kv_heads).
`select_decode_attention` picks the C++ CPU kernel (`kernels/cpu_attention.py`) for
float32 on CPU when it builds, the Triton kernel (`kernels/triton_attention.py`) on
CUDA, this reference otherwise. `select_prefill_attention` picks the Triton kernel
(`kernels/triton_prefill.py`) on CUDA for chunks over a cached prefix and this
reference (SDPA: flash attention for a chunk with no prefix, in half precision on
CUDA; over the gathered prefix otherwise) everywhere else; `select_write_kv_slots` the Triton slot write on CUDA. On
CUDA each falls back to the reference, per call, for shapes the Triton kernels do
not take.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import wants_cpu_kernels, wants_triton_kernels


def write_kv_slots(
    layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write K and V of `N` tokens into their slots.

    layer_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim] (a view, may be
    non-contiguous); k, v: [N, num_kv_heads, head_dim]; slot_mapping: [N] int64.
    """
    assert k.shape == v.shape and k.dim() == 3, (k.shape, v.shape)
    assert slot_mapping.shape == (k.shape[0],), (slot_mapping.shape, k.shape)
    block_size = layer_cache.shape[2]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - block_ids * block_size
    layer_cache[block_ids, 0, offsets] = k.to(layer_cache.dtype)
    layer_cache[block_ids, 1, offsets] = v.to(layer_cache.dtype)


def gather_kv(layer_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int):
    """K and V of the first `num_tokens` tokens of one sequence: two [T, kvh, d]."""
    num_blocks = (num_tokens + layer_cache.shape[2] - 1) // layer_cache.shape[2]
    blocks = layer_cache[block_table[:num_blocks]]  # [nb, 2, bs, kvh, d]
    k = blocks[:, 0].flatten(0, 1)[:num_tokens]
    v = blocks[:, 1].flatten(0, 1)[:num_tokens]
    return k, v


def prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    layer_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one chunk over its cached prefix.

    q: [q_len, H, d]; k_new, v_new: [q_len, kvh, d], the chunk's own K/V (already
    written to the cache too); block_table: [>= ceil(ctx_len / block_size)] int64.
    Query i sits at position ctx_len - q_len + i. Returns [q_len, H, d].
    """
    q_len, num_heads, head_dim = q.shape
    num_cached = ctx_len - q_len
    assert num_cached >= 0, (ctx_len, q_len)
    if num_cached == 0:
        k, v = k_new, v_new
        mask = None
    else:
        k, v = gather_kv(layer_cache, block_table, ctx_len)
        query_pos = torch.arange(num_cached, ctx_len, device=q.device)
        key_pos = torch.arange(ctx_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, ctx_len]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.to(q.dtype).transpose(0, 1).unsqueeze(0),
        v.to(q.dtype).transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=num_heads != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


DECODE_GROUP = 16  # sequences per padded attention call (sorted by length)


def decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its whole context (its own K/V included).

    q: [B, H, d]; block_tables: [B, max_blocks] int64 (padding entries may be any
    valid block id); context_lens: [B] int64, each >= 1. Returns [B, H, d].

    Sequences are sorted by length and attended in groups of DECODE_GROUP, each
    padded only to its own longest context, so a batch of mixed lengths does not pay
    for the longest one everywhere. GQA is computed by grouping query heads over
    their shared KV head, never by copying K/V per query head.
    """
    batch, num_heads, head_dim = q.shape
    assert block_tables.shape[0] == batch and context_lens.shape == (batch,)
    lengths = context_lens.tolist()
    order = sorted(range(batch), key=lengths.__getitem__)
    out = torch.empty_like(q)
    for start in range(0, batch, DECODE_GROUP):
        rows = order[start : start + DECODE_GROUP]
        index = torch.tensor(rows, dtype=torch.long, device=q.device)
        max_len = lengths[rows[-1]]
        out[index] = _decode_group(q[index], layer_cache, block_tables[index], context_lens[index], max_len, scale)
    return out


def _decode_group(q, layer_cache, block_tables, context_lens, max_len: int, scale: float) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    group = num_heads // num_kv_heads
    num_blocks = (max_len + block_size - 1) // block_size
    blocks = layer_cache[block_tables[:, :num_blocks]]  # [B, nb, 2, bs, kvh, d]
    k = blocks[:, :, 0].flatten(1, 2)[:, :max_len].to(q.dtype)  # [B, T, kvh, d]
    v = blocks[:, :, 1].flatten(1, 2)[:, :max_len].to(q.dtype)
    q_grouped = (q * scale).view(batch, num_kv_heads, group, head_dim)  # heads h = kv * group + g
    scores = torch.einsum("bkgd,btkd->bkgt", q_grouped, k)
    valid = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = scores.float().softmax(dim=-1).to(v.dtype)
    return torch.einsum("bkgt,btkd->bkgd", probs, v).reshape(batch, num_heads, head_dim)


def select_decode_attention(backend: str, device: torch.device, dtype: torch.dtype) -> Callable:
    """`auto`: the C++ kernel for float32 on CPU where it builds, the Triton kernel
    on CUDA where Triton is installed (per call, for the shapes it supports); the
    reference otherwise. `torch`: always the reference."""
    if wants_cpu_kernels(backend, device, dtype):
        from kernels import cpu_attention

        if cpu_attention.load() is not None:
            return cpu_attention.paged_decode_attention
    if wants_triton_kernels(backend, device):
        from kernels import triton_attention

        return _triton_decode_where_supported(triton_attention)
    return decode_attention


def select_prefill_attention(backend: str, device: torch.device) -> Callable:
    """`auto`: the Triton kernel on CUDA where Triton is installed, per call, for
    chunks over a cached prefix of the shapes it supports; the reference otherwise.
    `torch`: always the reference."""
    if wants_triton_kernels(backend, device):
        from kernels import triton_prefill

        return _triton_prefill_where_supported(triton_prefill)
    return prefill_attention


def select_write_kv_slots(backend: str, device: torch.device) -> Callable:
    """`auto`: the Triton slot write on CUDA where Triton is installed (per call, for
    the layouts it takes); the reference otherwise. `torch`: always the reference."""
    if wants_triton_kernels(backend, device):
        from kernels import triton_attention

        return _triton_write_where_supported(triton_attention)
    return write_kv_slots


def _triton_write_where_supported(triton_attention) -> Callable:
    def write(layer_cache, k, v, slot_mapping):
        if triton_attention.supports_write(layer_cache, k, v):
            return triton_attention.write_kv_slots(layer_cache, k, v, slot_mapping)
        return write_kv_slots(layer_cache, k, v, slot_mapping)

    return write


def _triton_decode_where_supported(triton_attention) -> Callable:
    def attend(q, layer_cache, block_tables, context_lens, scale):
        shape = (q.shape[1], layer_cache.shape[3], q.shape[2], layer_cache.shape[2])
        if triton_attention.supports_decode(*shape):
            return triton_attention.paged_decode_attention(q, layer_cache, block_tables, context_lens, scale)
        return decode_attention(q, layer_cache, block_tables, context_lens, scale)

    return attend


def _triton_prefill_where_supported(triton_prefill) -> Callable:
    """A chunk over a cached prefix goes to Triton (it reads the prefix in place; the
    reference gathers it and passes SDPA a mask, which rules out its flash backend). A
    chunk with no prefix goes to the reference: SDPA, causal with no mask, on the
    chunk's own K/V, which in half precision is torch's flash-attention kernel
    (grouped-query heads included), the kernel this untuned Triton one would have to
    beat. The GPU check's `kernels` step times both on a prompt with no prefix."""

    def attend(q, k_new, v_new, layer_cache, block_table, ctx_len, scale):
        shape = (q.shape[1], layer_cache.shape[3], q.shape[2], layer_cache.shape[2])
        has_prefix = ctx_len > q.shape[0]
        if has_prefix and triton_prefill.supports_prefill(*shape):
            return triton_prefill.paged_prefill_attention(q, k_new, v_new, layer_cache, block_table, ctx_len, scale)
        return prefill_attention(q, k_new, v_new, layer_cache, block_table, ctx_len, scale)

    return attend


def reference_attention(q, k, v, scale: float) -> torch.Tensor:
    """Dense causal attention for tests: q [T, H, d], k/v [T, kvh, d] -> [T, H, d]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * scale
    causal = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril(k.shape[0] - q.shape[0])
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v.float()).to(q.dtype)
