"""Prefill steps replayed from CUDA graphs: one sequence's chunk with no cached
prefix (a prompt's first chunk, or all of it), padded to a bucket of token counts.

Why: on the H200 lent in the forty-fifth session (a sandboxed host), a
4096-token prefill of the 0.5B preset took 8.0 ms of device time but 13 to 26 ms
of wall time, because launching its ~400 kernels from Python cost 14 to 125 us
each (docs/benchmarks.md, GPU check); eagerly, a small model's prefill is bound by
the host as its decode steps were before their graphs (`actors/decode_graphs.py`).
Replayed, a prefill step costs one graph launch.

What a step must be to replay: a single chunk, of a prefill (not a decode or a
drafted step), that starts at position 0 (so its attention reads only its own K
and V: causal SDPA over the chunk, no block table, no prefix length), of at most
the largest bucket's tokens. Other steps (several prompts in one step, a chunk
over a cached prefix, mixed prefill and decode) run eagerly; so does everything on
a MoE model (experts' groups are sized on the host).

Padding that harms nothing: the chunk's `n` tokens take the bucket's first `n`
rows; the rest decode token 0 at position 0 and write their K and V to the
scratch block's first slot (a block the pool never hands out, as the decode
graphs' padding rows do). Attention is causal and the real tokens come first, so
no real token attends to a padding one; every other layer works row by row. The
real rows' values are those of the eager step but for rounding where a kernel's
choice depends on the row count (cuBLAS picks its GEMM by the rows).

Buckets: 16, 32, 64, 128, 256, then every multiple of 256, up to the largest
chunk a step can hold (`min(prefill_chunk_size, max_num_batched_tokens,
max_model_len)`) and that itself; a chunk pays for at most 255 padding rows above
256 tokens (12% at 2048). All captured at start-up into one memory pool
(`actors/graph_capture.py`). Off by default (`prefill_graphs`) until it has run on
a GPU: the GPU check's `roofline` step measures prefill with and without it.
With `capture=False` the same padded step runs without graphs, on any device: the
CPU tests check the padding that way.
"""

from __future__ import annotations

import numpy as np
import torch

from actors.attention_metadata import AttentionMetadata, PrefillSpan
from actors.graph_capture import capture_buckets
from actors.scheduler import ScheduledChunk
from kernels import copy_into

_SMALL_BUCKETS = (16, 32, 64, 128, 256)
_BUCKET_STEP = 256


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, 256, then every multiple of 256, up to and including max_tokens."""
    buckets = [b for b in _SMALL_BUCKETS if b < max_tokens]
    buckets += list(range(2 * _BUCKET_STEP, max_tokens, _BUCKET_STEP))
    return buckets + [max_tokens]


class PrefillGraphs:
    """Static-shape prefill steps of one chunk of up to `max_tokens` tokens. Call
    `run` from the engine's thread only (it owns the static buffers and graphs)."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, scratch_block: int, max_tokens: int,
                 capture: bool) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        self.buckets = token_buckets(max_tokens)
        self._scratch_slot = scratch_block * self.block_size
        # Rows: token ids, positions, slots (one host-to-device copy a step).
        self.step_inputs = torch.zeros(3, max_tokens, dtype=torch.long, device=kv_cache.device)
        self.step_inputs[2] = self._scratch_slot
        self.token_ids, self.positions, self.slot_mapping = self.step_inputs.unbind(0)
        self._unused_table = torch.tensor([scratch_block], dtype=torch.long, device=kv_cache.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._graphs = capture_buckets(self.buckets, self._forward, "prefill steps")

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @property
    def is_captured(self) -> bool:
        return bool(self._graphs)

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether a step of these chunks is one this class runs: a single prefill
        chunk from position 0, of at most `max_tokens` tokens."""
        if len(chunks) != 1:
            return False
        chunk = chunks[0]
        return chunk.start == 0 and not chunk.is_decode and not chunk.draft_token_ids \
            and chunk.num_new_tokens <= self.max_tokens

    def _bucket(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def _forward(self, num_tokens: int) -> torch.Tensor:
        span = PrefillSpan(q_start=0, q_len=num_tokens, ctx_len=num_tokens, block_table=self._unused_table)
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:num_tokens], prefills=(span,),
                                 num_prefill_tokens=num_tokens, decode_block_tables=None, decode_context_lens=None)
        return self.model(self.token_ids[:num_tokens], self.positions[:num_tokens], self.kv_cache, meta)

    def run(self, chunk: ScheduledChunk) -> torch.Tensor:
        """The chunk's hidden states, [n, hidden] (a view of the graph's output: read
        it before the next `run`). `fits([chunk])` must hold."""
        num_tokens = chunk.num_new_tokens
        bucket = self._bucket(num_tokens)
        size = self.block_size
        table = np.asarray(chunk.request.block_table[: -(-num_tokens // size)], dtype=np.int64)
        position = np.arange(num_tokens, dtype=np.int64)
        inputs = np.zeros((3, bucket), dtype=np.int64)  # padding: token 0, position 0, the scratch slot
        inputs[2, num_tokens:] = self._scratch_slot
        inputs[0, :num_tokens] = chunk.request.token_ids_between(0, num_tokens)
        inputs[1, :num_tokens] = position
        inputs[2, :num_tokens] = table[position // size] * size + position % size
        copy_into(self.step_inputs[:, :bucket], torch.from_numpy(inputs))
        if bucket in self._graphs:
            graph, hidden = self._graphs[bucket]
            graph.replay()
        else:
            hidden = self._forward(bucket)
        return hidden[:num_tokens]
