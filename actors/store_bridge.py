"""The engine's side of the KV store (docs/kv-store.md): between its device pool
and the store's tiers.

- `prefix_plan`: for a store lookup, the hashes of the prompt's blocks a prefix hit
  may cover, how many leading ones the device pool holds now, and whether the pool
  has room for the request (a decode worker's reservation: without room, loading
  its prefix would only take pool blocks from other prefixes);
- `import_prefix`: blocks loaded from the store copied into the pool and made
  findable (their keys and tokens checked against the prompt's first);
- `save_computed`: the prompt blocks a step completed, copied off the device and
  handed to `sink` (a worker's write-through thread; None: nothing is saved).

All of it runs on the engine thread, between steps; the store's own I/O does not
(a worker loads off the thread and saves through a queue, actors/kv_store_client.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from typing import NamedTuple

import torch

from actors.block_pool import BlockPool, block_hashes
from actors.kv_tiers import StoredBlock

log = logging.getLogger("tandem.kv_store")


class PrefixPlan(NamedTuple):
    hashes: list[bytes]  # of the prompt's blocks a prefix hit may cover (never the last token's)
    num_in_pool: int  # leading blocks the device pool holds now
    has_room: bool  # for the whole table asked about (True when none was)


class StoreBridge:
    def __init__(self, pool: BlockPool, runner, kv_namespace: bytes, enabled: bool) -> None:
        """`runner`: the engine's ModelRunner (its KV cache, `write_blocks`);
        `enabled`: the engine's prefix cache is on (off: nothing is found or saved)."""
        self.pool = pool
        self.runner = runner
        self.kv_namespace = kv_namespace
        self.enabled = enabled
        self.sink: Callable[[list[StoredBlock]], None] | None = None
        self.num_imported = 0  # blocks `import_prefix` copied in (not those it found in the pool meanwhile)

    def prefix_plan(self, prompt_ids: list[int], room: tuple[int, int] | None = None) -> PrefixPlan:
        """Where the prompt's prefix is; with `room` (`Engine.reservation_room`:
        tokens, and blocks kept for others), also whether a table of that many
        tokens (the prompt's, its pool prefix reused) fits now."""
        if not self.enabled:
            return PrefixPlan([], 0, True)
        max_hit_blocks = (len(prompt_ids) - 1) // self.pool.block_size
        hashes = block_hashes(prompt_ids[: max_hit_blocks * self.pool.block_size], self.pool.block_size,
                              self.kv_namespace)
        hits = self.pool.lookup(hashes, prompt_ids)
        has_room = room is None or self.pool.can_hold(room[0], hits, room[1])
        return PrefixPlan(hashes, len(hits), has_room)

    def import_prefix(self, prompt_ids: list[int], first_block: int, blocks: list[StoredBlock]) -> list[int]:
        """Copy blocks loaded from the store (the prompt's blocks `first_block`,
        `first_block + 1`, ...) into the pool and make them findable. Returns the
        whole prefix's block ids, each held by one reference for the caller to pass
        to `Engine.add_request` or `Engine.reserve`; [] when the device prefix
        before `first_block` went meanwhile, no block is free, or the copy failed
        (a device out of memory for the staging tensor, say: the prompt is
        computed instead, and no block stays taken). Blocks whose tokens are not
        this prompt's, or whose KV is not a block of this cache, are refused."""
        size = self.pool.block_size
        block_shape = tuple(self.runner.kv_cache.shape[1:])
        hashes = self.prefix_plan(prompt_ids).hashes
        blocks = blocks[: max(0, len(hashes) - first_block)]
        for offset, block in enumerate(blocks):
            index = first_block + offset
            if (block.key != hashes[index] or block.token_ids != tuple(prompt_ids[index * size : (index + 1) * size])
                    or tuple(block.kv.shape) != block_shape):
                blocks = blocks[:offset]
                break
        held = self.pool.lookup(hashes[: first_block + len(blocks)], prompt_ids)
        if len(held) < first_block:
            return []
        self.pool.take(held)
        new = blocks[len(held) - first_block :][: self.pool.num_available]
        if new:
            block_ids = self.pool.allocate(len(new))
            try:
                kv = torch.stack([b.kv for b in new]).to(self.runner.kv_cache.device, self.runner.kv_cache.dtype)
                self.runner.write_blocks(block_ids, kv)
            except (RuntimeError, ValueError) as exc:  # (torch's errors, its out-of-memory one among them)
                self.pool.release(held + block_ids)
                log.warning("KV store import of %d blocks failed, computing them instead: %s", len(new), exc)
                return []
            for block_id, block in zip(block_ids, new):
                self.pool.register(block_id, block.key, block.token_ids)
            held += block_ids
            self.num_imported += len(block_ids)
        return held

    @contextmanager
    def not_saving(self):
        """Save nothing meanwhile (the start-up profile's random prompts)."""
        sink, self.sink = self.sink, None
        try:
            yield
        finally:
            self.sink = sink

    def save_computed(self, chunks) -> None:
        """Hand the prompt blocks these chunks (a step's, computed) completed to
        `sink`, as copies."""
        if self.sink is None or not self.enabled:
            return
        size = self.pool.block_size
        picked: list[tuple[bytes, tuple[int, ...], int]] = []
        for chunk in chunks:
            request = chunk.request
            last_full = min(chunk.end, request.num_prompt_tokens) // size
            for index in range(chunk.start // size, min(last_full, len(request.block_hashes))):
                tokens = tuple(request.prompt_token_ids[index * size : (index + 1) * size])
                picked.append((request.block_hashes[index], tokens, request.block_table[index]))
        if picked:
            cache = self.runner.kv_cache
            self.sink([StoredBlock(key, tokens, cache[block_id].to("cpu", copy=True))
                       for key, tokens, block_id in picked])
