"""KV block pool with a hash-chain prefix cache. Plain Python, no torch.

Ownership: a block is *used* while its ref count is above zero (one reference per
request whose block table holds it). At zero it goes to the tail of the LRU free
queue; if it still carries a block hash it is *cached*: findable by that hash until
`allocate` reuses it, which drops the hash. Invariant, checked by `check()`:

    num_free + num_cached + num_used == num_blocks

Block hashes form a chain, `h_i = H(h_{i-1}, tokens_i)`, over full blocks only, so a
hash names the whole prefix up to and including its block. A lookup verifies the
block's tokens too, so a hash collision can never serve the wrong KV.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actors.event_log import CacheEvents, Cursor, EventLog
from actors.weights_fingerprint import weights_fingerprint

KV_LAYOUT_VERSION = "page-first-v1"  # [blocks, layers, 2, block_size, kv_heads, head_dim]


def block_hashes(
    token_ids: Sequence[int], block_size: int, seed: bytes = b"", known: Sequence[bytes] = ()
) -> list[bytes]:
    """Hash chain over the full blocks of `token_ids`. `seed` separates namespaces
    (model, dtype, layout) so incompatible KV never shares a hash; `known` are the
    chain's first hashes, already computed for these tokens, to extend from."""
    hashes = list(known)
    previous = hashes[-1] if hashes else hashlib.sha256(seed).digest()
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        chunk = np.asarray(token_ids[start : start + block_size], dtype=np.int64).tobytes()
        previous = hashlib.sha256(previous + chunk).digest()
        hashes.append(previous)
    return hashes


def blocks_to_reserve(num_prompt_tokens: int, block_size: int) -> int:
    """Blocks a decode worker holds for a prompt before its KV arrives: the
    prompt's tokens and the first output token's slot (`Engine.reserve`), prefix
    hits included."""
    return -(-(num_prompt_tokens + 1) // block_size)


def num_usable_blocks(num_tokens: int, block_size: int) -> int:
    """The leading full blocks of a sequence a prefix cache may serve: all but the
    one holding its last token, whose logits must be computed (the one rule for
    every worker's cache, D's lending and the scheduler's routing)."""
    return (num_tokens - 1) // block_size


def kv_namespace(model_dir: str | Path, dtype: str, block_size: int) -> bytes:
    """The seed of every hash chain: what makes KV compatible. Same checkpoint config
    and weights (actors/weights_fingerprint.py), dtype, block size and layout
    version -> same namespace, on any node."""
    config = (Path(model_dir) / "config.json").read_bytes()
    weights = weights_fingerprint(model_dir)
    return hashlib.sha256(config + weights + f"|{dtype}|{block_size}|{KV_LAYOUT_VERSION}".encode()).digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # the block's tokens, kept with its hash


class NoFreeBlocks(RuntimeError):
    """allocate() asked for more blocks than are free or evictable."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self._num_cached = 0  # free blocks that still hold a findable hash
        # Cache events for the global scheduler's prefix indexes: (True, hash) when a
        # block becomes findable, (False, hash) when it is evicted; each scheduler
        # replica reads them from its own cursor (`events_since`).
        self._events = EventLog(capacity=8 * num_blocks)

    # ---- queries -------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks allocate() can hand out now: free plus evictable cached ones."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Free blocks still findable by hash (evictable prefix cache)."""
        return self._num_cached

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_hold(self, num_tokens: int, hits: Sequence[int], num_kept_blocks: int = 0) -> bool:
        """Whether a table of `num_tokens` tokens fits now, its first blocks the
        cached `hits` (to be taken, not allocated): the rest free or evictable,
        the hits aside, and `num_kept_blocks` of those left over (kept for others)."""
        idle_hits = sum(1 for block_id in hits if self.blocks[block_id].ref_count == 0)
        return -(-num_tokens // self.block_size) - len(hits) <= len(self._free) - idle_hits - num_kept_blocks

    def in_use(self, block_hash: bytes) -> bool:
        """Whether the cached block of this hash is held by a request (by hash alone)."""
        block_id = self._by_hash.get(block_hash)
        return block_id is not None and self.blocks[block_id].ref_count > 0

    def finds(self, block_hash: bytes) -> bool:
        """Whether a block of this hash is cached (by hash alone: `lookup` verifies)."""
        return block_hash in self._by_hash

    def lookup(self, hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix (tokens verified). Takes no refs."""
        found: list[int] = []
        for index, block_hash in enumerate(hashes):
            block_id = self._by_hash.get(block_hash)
            if block_id is None:
                break
            start = index * self.block_size
            if self.blocks[block_id].token_ids != tuple(token_ids[start : start + self.block_size]):
                break
            found.append(block_id)
        return found

    # ---- mutations -----------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """`count` blocks with one reference each, least recently freed first."""
        if count > len(self._free):
            raise NoFreeBlocks(f"asked for {count} blocks, {len(self._free)} available")
        block_ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._num_cached -= 1
                del self._by_hash[block.block_hash]
                self._events.append(False, block.block_hash)
                block.block_hash = block.token_ids = None
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def take(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each block (a prefix-cache hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
                self._num_cached -= block.block_hash is not None
            block.ref_count += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block of a table. Blocks reaching zero are
        queued tail-first, so a table's tail is evicted before the head it extends."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise AssertionError(f"block {block_id} released with ref count {block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self._num_cached += block.block_hash is not None

    def register(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Make a full, computed block findable by its hash. A hash already known
        (the same prefix computed twice concurrently) keeps its first block."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._by_hash:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._by_hash[block_hash] = block_id
        self._num_cached += block.ref_count == 0
        self._events.append(True, block_hash)

    def events_since(self, cursor: Cursor | None) -> CacheEvents:
        """Cache events after `cursor`, oldest first, or a snapshot of the findable
        hashes (see actors/event_log.py). Safe to call from another thread than the
        engine's."""
        return self._events.since(cursor, lambda: self._by_hash)

    def reset_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        for block in self.blocks:
            block.block_hash = block.token_ids = None
        for block_hash in list(self._by_hash):
            self._events.append(False, block_hash)
        self._by_hash.clear()
        self._num_cached = 0

    def check(self) -> None:
        """Assert the accounting invariants."""
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert all(b.ref_count >= 0 for b in self.blocks)
        assert used + len(self._free) == self.num_blocks, (used, len(self._free))
        assert all(self.blocks[i].ref_count == 0 for i in self._free)
        assert all(self.blocks[i].block_hash == h for h, i in self._by_hash.items())
        assert self._num_cached == sum(1 for i in self._free if self.blocks[i].block_hash is not None)
