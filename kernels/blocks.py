"""Whole-block KV copies for transfers, torch reference, and their dispatcher.

A KV transfer moves whole blocks: the prefill side gathers the blocks a chunk
completed into one contiguous buffer, the decode side scatters such a buffer into
the blocks it reserved (layout in `kernels/attention.py`; one block is contiguous
across all layers, so a block is one span of the cache).

    gather_blocks(cache, block_ids) -> [n, *cache.shape[1:]], a new contiguous tensor
    scatter_blocks(cache, block_ids, blocks) -> None, in place

`block_ids` is a [n] int64 tensor on the cache's device, distinct ids for a scatter.
`select_block_copy` picks the Triton kernels (`kernels/triton_blocks.py`) on CUDA
where Triton is installed, per call for the tensors they take, and this reference
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import wants_triton_kernels


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    return cache[block_ids]


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    cache.index_copy_(0, block_ids, blocks)


@dataclass(frozen=True)
class BlockCopy:
    gather: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    scatter: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


TORCH_BLOCK_COPY = BlockCopy(gather_blocks, scatter_blocks)


def select_block_copy(backend: str, device: torch.device) -> BlockCopy:
    """`auto`: the Triton kernels on CUDA where Triton is installed (per call, for the
    tensors they take), the reference otherwise. `torch`: always the reference."""
    if not wants_triton_kernels(backend, device):
        return TORCH_BLOCK_COPY
    from kernels import triton_blocks

    def gather(cache, block_ids):
        if triton_blocks.supports_blocks(cache):
            return triton_blocks.gather_blocks(cache, block_ids)
        return gather_blocks(cache, block_ids)

    def scatter(cache, block_ids, blocks):
        if triton_blocks.supports_blocks(cache, blocks):
            return triton_blocks.scatter_blocks(cache, block_ids, blocks)
        return scatter_blocks(cache, block_ids, blocks)

    return BlockCopy(gather, scatter)
