"""Decode steps replayed from CUDA graphs.

A decode step of a small model is hundreds of small kernels (a dozen a layer), and
launching them from Python costs more than running them: on a GPU the step is
bound by the host, not by memory. A CUDA graph records the step's launches once and
replays them with one call. What a graph needs, and how this class gives it:

- **Fixed shapes and addresses.** Inputs live in static buffers sized for
  `max_batch` rows (at most `MAX_GRAPH_BATCH`); a graph is captured per batch
  bucket (1, 2, 4, then multiples of 8) and a step of `n` sequences replays the
  smallest bucket that holds it.
  Block tables are `ceil(max_model_len / block_size)` wide, so any sequence fits;
  only the columns a step uses are copied in, from a host mirror that keeps each
  row from step to step (`actors/block_table_rows.py`: a step adds only the
  blocks appended since the last).
- **Padding rows that harm nothing.** A bucket's unused rows decode token 0 at
  position 0 with a context of one token in the **scratch block**: a KV block the
  model runner allocates beyond those the block pool hands out. Their K/V writes
  land there, their attention reads only it, and their outputs are dropped.
- **No host synchronisation inside the step.** The Triton decode attention reads
  context lengths on the device; the torch reference (`.tolist()`) cannot be
  captured, so when capture fails for any reason (that, an old driver, a kernel
  that syncs) the runner logs it and runs decode steps eagerly, as before.
- **One memory pool** for all buckets, captured largest first
  (`actors/graph_capture.py`), so the graphs share their intermediate activations.

Prefill and mixed steps run eagerly (their shapes vary with every chunk), but for
those `actors/prefill_graphs.py` takes; sampling runs eagerly after the replay.
With `capture=False` the same padded, static-shape step runs without graphs, on
any device: that is how CPU tests check the padding
(the C++ CPU kernels are batch-invariant, so padded rows must not change a real
row's hidden state by a single bit).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from actors.attention_metadata import AttentionMetadata
from actors.block_table_rows import BlockTableRows
from actors.graph_capture import capture_buckets
from kernels import copy_into

# Larger decode batches run eagerly: launches are amortised there, and every bucket
# costs capture time at start-up (vLLM caps its capture sizes at 512 likewise).
MAX_GRAPH_BATCH = 256


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to (and including) max_batch."""
    buckets = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return buckets + [max_batch]


class DecodeGraphs:
    """Static-shape decode steps for up to `max_batch` sequences. Call `run` from the
    engine's thread only (it owns the static buffers and the graphs)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        scratch_block: int,
        max_batch: int,
        max_blocks_per_seq: int,
        capture: bool,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.scratch_block = scratch_block
        self.block_size = kv_cache.shape[3]
        self.buckets = batch_buckets(max_batch)
        device = kv_cache.device
        long = dict(dtype=torch.long, device=device)
        # Rows: token ids, positions, slots, context lengths (one host-to-device copy).
        self.step_inputs = torch.zeros(4, max_batch, **long)
        self.step_inputs[2] = scratch_block * self.block_size
        self.step_inputs[3] = 1
        self.token_ids, self.positions, self.slot_mapping, self.context_lens = self.step_inputs.unbind(0)
        self.block_tables = torch.full((max_batch, max_blocks_per_seq), scratch_block, **long)
        self.host_block_tables = BlockTableRows(max_batch, max_blocks_per_seq, pad=scratch_block)
        # A padding row's inputs: token 0 at position 0, the scratch slot, one token of context.
        self._padding_column = np.array([[0], [0], [scratch_block * self.block_size], [1]], dtype=np.int64)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture()

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def is_captured(self) -> bool:
        return bool(self._graphs)

    def fits(self, batch: int) -> bool:
        return 1 <= batch <= self.max_batch

    def _bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def _forward(self, batch: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            prefills=(),
            num_prefill_tokens=0,
            decode_block_tables=self.block_tables[:batch],
            decode_context_lens=self.context_lens[:batch],
        )
        return self.model(self.token_ids[:batch], self.positions[:batch], self.kv_cache, meta)

    def _capture(self) -> None:
        """Capture every bucket (the buffers hold padding only, so capture and
        warm-up write nothing but the scratch block)."""
        self._graphs = capture_buckets(self.buckets, self._forward, "decode steps")

    def run(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        positions: Sequence[int],
        block_tables: Sequence[list[int]],
    ) -> torch.Tensor:
        """The step's hidden states, [n, hidden] for n single-token decodes: sequence
        i's token at `positions[i]`, its KV written to and its context read from
        `block_tables[i]` (the list itself: a row whose list is the last step's
        copies only the new blocks; it covers the position). `token_ids` may be a
        tensor on the device (tokens the host has not read yet): copied in on the
        device. The slots and context lengths follow from the positions, computed
        for the whole batch at once. The result is a view of the graph's output:
        read it before the next `run`."""
        batch = len(block_tables)
        assert self.fits(batch), (batch, self.max_batch)
        bucket = self._bucket(batch)
        size = self.block_size
        position = np.asarray(positions, dtype=np.int64)
        block_index = position // size
        width = self.host_block_tables.update(block_tables, (block_index + 1).tolist(), bucket)
        on_device = isinstance(token_ids, torch.Tensor)
        inputs = np.empty((4, bucket), dtype=np.int64)  # token ids, positions, slots, context lengths
        inputs[:, batch:] = self._padding_column
        inputs[0, :batch] = 0 if on_device else token_ids
        inputs[1, :batch] = position
        inputs[2, :batch] = self.host_block_tables.array[np.arange(batch), block_index] * size + position % size
        inputs[3, :batch] = position + 1
        copy_into(self.step_inputs[:, :bucket], torch.from_numpy(inputs))
        if on_device:
            self.token_ids[:batch].copy_(token_ids)
        tables = torch.from_numpy(self.host_block_tables.array[:bucket, :width])
        copy_into(self.block_tables[:bucket, :width], tables)
        if bucket in self._graphs:
            graph, hidden = self._graphs[bucket]
            graph.replay()
        else:
            hidden = self._forward(bucket)
        return hidden[:batch]
