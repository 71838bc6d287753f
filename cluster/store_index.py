"""The global scheduler's view of the KV store tiers, for cache-aware routing.

Each node's store (a named actor, see actors/kv_store_client.py) reports entry
events per tier. Host memory and local disk belong to their node: a worker there can
load them. The shared path belongs to every node: its events, whichever node's store
saw them, go to one index. A stale entry only costs a worse prediction: the worker
loads and verifies blocks itself.
"""

from __future__ import annotations

import logging

import ray

from actors.event_log import CacheEvents, Cursor
from actors.kv_store import KVStoreSettings
from actors.kv_store_client import STORE_NAMESPACE, node_store_name
from cluster.router import PrefixIndex

log = logging.getLogger("tandem.scheduler")

INDEX_CAPACITY_BLOCKS = 1 << 20


class StoreIndex:
    def __init__(self, namespace: bytes, settings: KVStoreSettings) -> None:
        self.namespace = namespace
        self.settings = settings
        self.node_tiers: dict[str, dict[str, PrefixIndex]] = {}  # node id -> tier name -> index
        self.shared = PrefixIndex(INDEX_CAPACITY_BLOCKS)
        self._stores: dict[str, object] = {}  # node id -> its store actor's handle, once found
        self._cursors: dict[str, dict[str, Cursor]] = {}  # node id -> tier -> where this replica read to

    def indexes_for(self, node_id: str) -> list[PrefixIndex]:
        return [*self.node_tiers.get(node_id, {}).values(), self.shared]

    async def refresh(self, node_ids: set[str]) -> None:
        """Read every known node store's events from this replica's cursors (a store
        not created yet is skipped)."""
        for gone in set(self.node_tiers) - node_ids:
            del self.node_tiers[gone]
            self._cursors.pop(gone, None)
        for node_id in node_ids:
            try:
                store = self._stores.get(node_id) or ray.get_actor(
                    node_store_name(node_id, self.namespace, self.settings), namespace=STORE_NAMESPACE)
                batches = await store.events_since.remote(self._cursors.get(node_id))
            except (ValueError, ray.exceptions.RayError) as exc:
                self._stores.pop(node_id, None)  # not created yet, or gone: look it up again next time
                log.debug("no KV store events from node %s: %s", node_id, exc)
                continue
            self._stores[node_id] = store
            self.apply(node_id, batches)

    def apply(self, node_id: str, batches: dict[str, CacheEvents]) -> None:
        """One node store's events per tier. A snapshot (`reset`) rebuilds that
        node's tier index; the shared path's index gathers every node's view of the
        same files, so a snapshot only adds to it (what it misses costs a worse
        prediction, never a wrong load)."""
        tiers = self.node_tiers.setdefault(node_id, {})
        for tier, batch in batches.items():
            if tier == "shared":
                self.shared.apply(batch.events)
            else:
                tiers.setdefault(tier, PrefixIndex(INDEX_CAPACITY_BLOCKS)).update(batch)
        self._cursors[node_id] = {tier: batch.cursor for tier, batch in batches.items()}
