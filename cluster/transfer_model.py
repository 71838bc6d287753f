"""How long a prefill worker's KV chunks take to land on a decode worker, learned
per P-D pair from P's own timings.

P sends a request's KV in chunks, one chunk at a time per pair
(actors/prefill_worker.py): each is a Ray call to D (`receive_chunk`) and the
chunk's bytes over the pair's channel, and the last one also puts the request in
D's running batch. A chunk's time, from the start of its send to P hearing that it
landed (`ChunkTiming.send_start_s` to `acknowledged_s`, both on P's clock), is
modelled per pair as

    chunk_s = a + b * num_blocks

by least squares over the pair's latest chunks (cluster/cost_model.py): `a` what a
chunk costs whatever its size (the calls, D's activation; on a GPU a stream
sync), `b` the channel's time per block. Until a pair has sent a chunk, another
pair of the same P (same sender, same node) stands in, then one to the same D,
then the prior: `block_bytes` at `PRIOR_BYTES_PER_S`, no fixed cost (what admission
assumed for every pair before it learned them). The feature is in thousands of
blocks, so that while every chunk seen had one size (a benchmark's fixed prompts)
the minimum-norm fit puts their time in `a` rather than in a slope it cannot see.

A request's TTFT holds its last chunk only (`last_chunk_s`): the earlier ones
travel while P computes the next. Its size: the blocks of the prompt's last
compute chunk (`prefill_chunk_size` tokens at most) plus the one a chunk boundary
may split, at most the blocks D lacks.

Why it matters: P's chunks to one D go one at a time, so in a burst each
request's chunk waits for those ahead of it, and admission's queue on P
(`WorkerModels.queued_prefill_s`) chains every prediction after the one before it:
a chunk's time is what each request adds to the next one's first token. On an
idle tiny-model pair (two cores, gloo), a burst of 16 short prompts was computed in
one or two engine steps, and their chunks then landed one every 5-12 ms, the last
about 150 ms after the first (a one-off probe); the prior put a chunk of two
16 KiB blocks at 33 us.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from actors.messages import ChunkTiming
from cluster.cost_model import LinearCostModel

PRIOR_BYTES_PER_S = 1e9  # a pair's bandwidth before it sent anything: about a 10 Gb/s link
WINDOW = 128  # the latest chunks a pair's model is fitted on


def chunk_features(num_blocks: int) -> tuple[float]:
    return (num_blocks / 1e3,)


class TransferModels:
    def __init__(self, block_size: int, prefill_chunk_size: int) -> None:
        self.block_size = block_size
        self.prefill_chunk_size = prefill_chunk_size
        self.block_bytes = 0  # a KV block's size (a worker's start-up profile says)
        self._pairs: dict[tuple[str, str], LinearCostModel] = {}

    def observe(self, prefill_id: str, decode_id: str, chunks: Iterable[ChunkTiming]) -> None:
        """A request's chunks, as P's `PrefillResult` timed them."""
        model = self._pairs.setdefault((prefill_id, decode_id), LinearCostModel(1, window=WINDOW))
        for chunk in chunks:
            model.observe(chunk_features(chunk.num_blocks), max(chunk.acknowledged_s - chunk.send_start_s, 0.0))

    def forget(self, worker_id: str) -> None:
        for pair in [pair for pair in self._pairs if worker_id in pair]:
            del self._pairs[pair]

    def chunk_s(self, prefill_id: str, decode_id: str, num_blocks: int) -> float:
        """One chunk of `num_blocks` from P to D."""
        model = self._model_for(prefill_id, decode_id)
        if model is None:
            return num_blocks * self.block_bytes / PRIOR_BYTES_PER_S
        return model.predict(chunk_features(num_blocks))

    def last_chunk_s(self, prefill_id: str, decode_id: str, num_uncached_tokens: int, num_blocks_to_send: int) -> float:
        """What a request's transfer adds to its first token: its last chunk."""
        if num_blocks_to_send <= 0:
            return self.chunk_s(prefill_id, decode_id, 0)  # the last chunk still goes: it holds the first token
        num_chunks = max(math.ceil(num_uncached_tokens / self.prefill_chunk_size), 1)
        last_tokens = max(num_uncached_tokens - (num_chunks - 1) * self.prefill_chunk_size, 1)
        num_blocks = min(math.ceil(last_tokens / self.block_size) + 1, num_blocks_to_send)
        return self.chunk_s(prefill_id, decode_id, num_blocks)

    def _model_for(self, prefill_id: str, decode_id: str) -> LinearCostModel | None:
        """The pair's model, else a stand-in (see the module's docstring), else None."""
        model = self._pairs.get((prefill_id, decode_id))
        if model is not None:
            return model
        same_p = [m for (p, _), m in self._pairs.items() if p == prefill_id]
        same_d = [m for (_, d), m in self._pairs.items() if d == decode_id]
        return (same_p or same_d or [None])[0]
