"""A cache's stored/evicted events, read by any number of consumers at their own pace.

A worker's prefix cache and a node's KV store tiers announce what they hold as
events, (True, hash) stored and (False, hash) evicted, and the global scheduler
keeps a `PrefixIndex` of each from them for cache-aware routing. There may be
several scheduler replicas (Serve `num_replicas`), each with its own indexes. A
queue drained by its reader hands every event to whichever replica polls first, so
each replica would see a random part of each cache. Instead the log numbers its
events and keeps the latest `capacity` of them; a reader passes the cursor it got
last time and receives what came after it. A reader that is new (no cursor), fell
further behind than the log keeps, or holds a cursor from another log (a cursor
names its log: a restarted worker or store has a new one) gets a snapshot instead:
every key the cache holds now, with `reset` set, so it rebuilds its index rather
than patching a stale one. A replica that starts late therefore sees what the
caches already hold too. (Dynamo's KV router and SGLang's cache-aware router keep
the same per-worker view; there the events reach one router process.)

Thread safety: one writer thread (the engine's, or the store behind its lock) and
readers on other threads. `list(deque)` and `list(dict)` copy in one C call, which
no other Python thread interleaves with. The snapshot is taken after the events are
copied, so a change that lands between the two copies is in the snapshot and is
also delivered again on the next read: the events are idempotent for an index
(storing a held key, evicting a missing one).
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple


Cursor = tuple[str, int]  # (the log's id, the number of the next event)


class CacheEvents(NamedTuple):
    cursor: Cursor  # pass back to read what comes after these
    reset: bool  # `events` are a snapshot of the whole cache: rebuild the index from them
    events: list[tuple[bool, bytes]]


class EventLog:
    def __init__(self, capacity: int) -> None:
        self._entries: deque[tuple[int, bool, bytes]] = deque(maxlen=max(1, capacity))
        self._next = 0
        self.log_id = uuid.uuid4().hex[:12]  # a cursor from another log (a restarted cache) is no cursor here

    def append(self, stored: bool, key: bytes) -> None:
        self._entries.append((self._next, stored, key))
        self._next += 1

    def since(self, cursor: Cursor | None, holds: Callable[[], Iterable[bytes]]) -> CacheEvents:
        """The events after `cursor` (from an earlier call; None: none yet), or a
        snapshot of `holds()` (the keys held now) when they are not all kept."""
        entries = list(self._entries)
        end = entries[-1][0] + 1 if entries else 0
        first = entries[0][0] if entries else 0
        if cursor is not None and cursor[0] == self.log_id and first <= cursor[1] <= end:
            events = [(stored, key) for _, stored, key in entries[cursor[1] - first:]]
            return CacheEvents((self.log_id, end), False, events)
        return CacheEvents((self.log_id, end), True, [(True, key) for key in list(holds())])
