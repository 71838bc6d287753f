"""Whole-block KV copies in Triton, for transfers: the GPU path.

Same contracts as the torch reference in `kernels/blocks.py`:

    gather_blocks(cache, block_ids)          == cache[block_ids]           (a new contiguous tensor)
    scatter_blocks(cache, block_ids, blocks) == cache.index_copy_(0, block_ids, blocks)

`cache` is anything block-major whose every block is one contiguous span: the
worker's whole cache `[num_blocks, num_layers, 2, block_size, kvh, d]`, or one
layer's view of it `[num_blocks, 2, block_size, kvh, d]` (blocks a stride apart).
So a block is copied as a flat row of `block_numel` elements: one program per
(listed block, span of _SPAN elements of it), each a masked load and a store, no
index arithmetic per element. Block ids must be distinct for a scatter (as for
`index_copy_`, whose result is otherwise undefined).

`supports_blocks` says which tensors the kernels take; `kernels.blocks`' dispatcher
falls back to the torch reference for the rest. Imports Triton at import time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SPAN = 4096  # elements per program


def supports_blocks(cache: torch.Tensor, blocks: torch.Tensor | None = None) -> bool:
    """True when every block of `cache` is contiguous and, for a scatter, `blocks` is
    a contiguous stack of blocks of the same shape and dtype on the same device."""
    if cache.dim() < 2 or not cache[0].is_contiguous():
        return False
    if blocks is None:
        return True
    return (blocks.is_contiguous() and blocks.shape[1:] == cache.shape[1:] and blocks.dtype == cache.dtype
            and blocks.device == cache.device)


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, ids_ptr, block_numel, stride_block, IS_GATHER: tl.constexpr,
                        SPAN: tl.constexpr):
    listed = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * SPAN + tl.arange(0, SPAN)
    in_block = offsets < block_numel
    block = tl.load(ids_ptr + listed)  # int64
    if IS_GATHER:  # cache block -> row `listed` of the contiguous buffer
        src = src_ptr + block * stride_block
        dst = dst_ptr + listed * block_numel
    else:  # row `listed` of the buffer -> cache block
        src = src_ptr + listed * block_numel
        dst = dst_ptr + block * stride_block
    tl.store(dst + offsets, tl.load(src + offsets, mask=in_block), mask=in_block)


def _launch(cache: torch.Tensor, buffer: torch.Tensor, block_ids: torch.Tensor, is_gather: bool) -> None:
    num_listed = block_ids.shape[0]
    if num_listed == 0:
        return
    block_numel = cache[0].numel()
    src, dst = (cache, buffer) if is_gather else (buffer, cache)
    grid = (num_listed, triton.cdiv(block_numel, _SPAN))
    _copy_blocks_kernel[grid](src, dst, block_ids, block_numel, cache.stride(0), IS_GATHER=is_gather, SPAN=_SPAN)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache: [num_blocks, ...]; block_ids: [n] int64 on cache's device. Returns a
    contiguous [n, ...] copy of those blocks, in that order."""
    assert supports_blocks(cache), (cache.shape, cache.stride())
    assert block_ids.dim() == 1 and block_ids.dtype == torch.int64 and block_ids.is_contiguous(), block_ids
    out = torch.empty((block_ids.shape[0],) + tuple(cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    _launch(cache, out, block_ids, is_gather=True)
    return out


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Write `blocks` ([n, ...], contiguous, cache's dtype and device) into the cache
    blocks `block_ids` ([n] int64, distinct) in place."""
    assert supports_blocks(cache, blocks), (cache.shape, cache.stride(), blocks.shape, blocks.dtype)
    assert block_ids.dim() == 1 and block_ids.dtype == torch.int64 and block_ids.is_contiguous(), block_ids
    assert block_ids.shape[0] == blocks.shape[0], (block_ids.shape, blocks.shape)
    _launch(cache, blocks, block_ids, is_gather=False)
