"""The KV store: host memory, local disk and a shared path behind the device pools of
one node's workers (Mooncake Store / LMCache style), searched fastest first.

Contract (every method is safe from any thread; calls are serialised by a lock):
- `save(blocks)`: write-through of computed prompt blocks. They go to host memory
  (or, without one, to the first disk tier) and, when `write_through_shared`, to the
  shared path too, so a worker on another node finds them. Host entries evicted to
  make room are demoted to local disk (or the shared path).
- `load(keys)`: the longest run of leading `keys` found in any tier, as blocks.
  A disk or shared hit is promoted to host memory. Stops at the first miss, expired
  or corrupt entry. Callers verify the tokens before using the KV.
- `pin(keys)` / `unpin(keys)`: pinned keys are never evicted nor expired, in any
  tier (an operator's system prompt, say). Pins live in memory only.
- With `ttl_s`, `save` and `load` also sweep every tier of what is past it, at most
  every `ttl_s / 10` (`expire`): what bounds a shared path left unbounded.
Keys are hash-chain values seeded by the KV namespace; the disk tiers also keep
the namespace in each file and in their directory name, so KV of another model,
dtype, block size or layout is never read (see docs/kv-store.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from actors.event_log import CacheEvents, Cursor
from actors.kv_tiers import DiskTier, MemoryTier, StoredBlock, Tier, TierPolicy

GIB = 1 << 30


@dataclass(frozen=True)
class KVStoreSettings:
    """Which tiers a node's store has, and their policies. A tier with no capacity
    (host) or no path (disk, shared) is absent."""

    host_bytes: int = 1 * GIB
    disk_path: str | None = None
    disk_bytes: int = 16 * GIB
    shared_path: str | None = None
    shared_bytes: int | None = None  # None: unbounded, the TTL bounds it
    ttl_s: float | None = None
    high_watermark: float = 0.9
    low_watermark: float = 0.7
    write_through_shared: bool = True

    def policy(self, capacity_bytes: int | None) -> TierPolicy:
        return TierPolicy(capacity_bytes, self.high_watermark, self.low_watermark, self.ttl_s)


@dataclass
class TierCounters:
    hits: int = 0
    stored: int = 0
    demoted_in: int = 0


@dataclass
class StoreStats:
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    num_lookups: int = 0
    num_missed_blocks: int = 0
    num_corrupt: int = 0
    num_write_errors: int = 0  # blocks a disk tier could not write (full, read-only): not stored there
    num_read_errors: int = 0  # reads a disk tier's file system refused for now (EACCES, ESTALE): misses, kept


class KVStore:
    def __init__(self, namespace: bytes, settings: KVStoreSettings, clock: Callable[[], float] = time.time) -> None:
        self.namespace = namespace
        self.settings = settings
        self.pinned: set[bytes] = set()
        self._lock = threading.Lock()
        self.host = MemoryTier(settings.policy(settings.host_bytes), self.pinned, clock) if settings.host_bytes else None
        self.disk = self._disk("disk", settings.disk_path, settings.disk_bytes, clock)
        self.shared = self._disk("shared", settings.shared_path, settings.shared_bytes, clock)
        self.tiers: list[Tier] = [t for t in (self.host, self.disk, self.shared) if t is not None]
        if not self.tiers:
            raise ValueError("a KV store needs at least one tier: host_bytes, disk_path or shared_path")
        self.counters = {t.name: TierCounters() for t in self.tiers}
        self.num_lookups = 0
        self.num_missed_blocks = 0
        self._swept_s = clock()  # the latest expiry sweep (`_sweep_if_due`)
        self._clock = clock

    def _disk(self, name: str, path: str | None, capacity: int | None, clock) -> DiskTier | None:
        if path is None:
            return None
        return DiskTier(name, path, self.namespace, self.settings.policy(capacity), self.pinned, clock)

    # ---- writes -------------------------------------------------------------------
    def save(self, blocks: Sequence[StoredBlock]) -> None:
        with self._lock:
            self._sweep_if_due()
            first = self.tiers[0]
            for block in blocks:
                self._put(first, block)
                if self.settings.write_through_shared and self.shared is not None and first is not self.shared:
                    self._put(self.shared, block)

    def _put(self, tier: Tier, block: StoredBlock) -> None:
        if tier.keeps(block.key):
            return
        self.counters[tier.name].stored += 1
        below = self._below(tier)
        for evicted in tier.put(block, keep_evicted=below is not None):
            self._demote(below, evicted)

    def _below(self, tier: Tier) -> Tier | None:
        """Where `tier` demotes to: the next tier down, unless that is the shared
        path and it already got every block by write-through."""
        below = self.tiers[self.tiers.index(tier) + 1 :]
        if not below or (below[0] is self.shared and self.settings.write_through_shared):
            return None
        return below[0]

    def _demote(self, tier: Tier, block: StoredBlock) -> None:
        if tier.keeps(block.key):  # (its copy there touched: the block was just in use above)
            return
        self.counters[tier.name].demoted_in += 1
        below = self._below(tier)
        for evicted in tier.put(block, keep_evicted=below is not None):
            self._demote(below, evicted)

    # ---- reads --------------------------------------------------------------------
    def load(self, keys: Sequence[bytes]) -> list[StoredBlock]:
        with self._lock:
            self._sweep_if_due()
            self.num_lookups += 1
            found: list[StoredBlock] = []
            for key in keys:
                block = self._get(key)
                if block is None:
                    self.num_missed_blocks += len(keys) - len(found)
                    break
                found.append(block)
            # Promoted once all are read: one at a time, a hit's promotion pushed host
            # blocks down to disk, whose eviction deleted the prefix's blocks not read
            # yet. Last to first, so that the first blocks, which prefixes share, end
            # the most recent: a host hit is touched, or put again where a promotion
            # before it pushed it down (touched as read, the host hits were the
            # oldest, and the promotions pushed the prompt's own first blocks out).
            if self.host is not None:
                for block in reversed(found):
                    self._put(self.host, block)
            return found

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys some tier holds (reads no KV; a corrupt file is
        only found by `load`)."""
        with self._lock:
            count = 0
            for key in keys:
                if not any(t.contains(key) for t in self.tiers):
                    break
                count += 1
            return count

    def _get(self, key: bytes) -> StoredBlock | None:
        """The block of the first tier holding `key` (promoted by `load`)."""
        for tier in self.tiers:
            block = tier.get(key)
            if block is None:
                continue
            self.counters[tier.name].hits += 1
            return block
        return None

    # ---- policy -------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self.pinned.update(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self.pinned.difference_update(keys)

    def expire(self) -> int:
        """Remove every expired entry from every tier (a disk tier's files past
        the TTL that it does not index too); how many went."""
        with self._lock:
            return self._expire()

    def _expire(self) -> int:
        self._swept_s = self._clock()
        return sum(t.expire() for t in self.tiers)

    def _sweep_if_due(self) -> None:
        """Under the lock: `expire` once `ttl_s / 10` has passed since the last
        sweep. An expired entry also goes when its key is met, but one never met
        again, or a shared path's file of another node, only goes here."""
        ttl = self.settings.ttl_s
        if ttl is not None and self._clock() - self._swept_s >= ttl / 10:
            self._expire()

    def events_since(self, cursors: dict[str, Cursor] | None = None) -> dict[str, CacheEvents]:
        """Each tier's entry events after the reader's cursor for it (the cursors
        from its last call; none: a snapshot of each tier), oldest first."""
        cursors = cursors or {}
        with self._lock:
            return {t.name: t.events_since(cursors.get(t.name)) for t in self.tiers}

    def stats(self) -> StoreStats:
        with self._lock:
            tiers = {
                t.name: {"entries": t.num_entries, "bytes": t.num_bytes, **vars(self.counters[t.name])}
                for t in self.tiers
            }
            corrupt = sum(getattr(t, "num_corrupt", 0) for t in self.tiers)
            write_errors = sum(getattr(t, "num_write_errors", 0) for t in self.tiers)
            read_errors = sum(getattr(t, "num_read_errors", 0) for t in self.tiers)
            return StoreStats(tiers, self.num_lookups, self.num_missed_blocks, corrupt, write_errors, read_errors)
