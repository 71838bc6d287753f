"""The global scheduler's view of the KV store tiers, for cache-aware routing.

Each node's store (a named actor, see actors/kv_store_client.py) reports entry
events per tier. Host memory and local disk belong to their node: a worker there can
load them. The shared path belongs to every node: its events, whichever node's store
saw them, go to one index. A stale entry only costs a worse prediction: the worker
loads and verifies blocks itself.
"""

from __future__ import annotations

import asyncio
import logging

import ray

from actors.event_log import CacheEvents, Cursor
from actors.kv_store import KVStoreSettings
from actors.kv_store_client import STORE_NAMESPACE, node_store_name
from cluster.router import PrefixIndex

log = logging.getLogger("tandem.scheduler")

INDEX_CAPACITY_BLOCKS = 1 << 20
STORE_ANSWER_S = 5.0  # a node store's answer to one refresh, at most (as a worker's: cluster/pool_view.py)


class StoreIndex:
    def __init__(self, namespace: bytes, settings: KVStoreSettings) -> None:
        self.namespace = namespace
        self.settings = settings
        self.node_tiers: dict[str, dict[str, PrefixIndex]] = {}  # node id -> tier name -> index
        self.shared = PrefixIndex(INDEX_CAPACITY_BLOCKS)
        self._stores: dict[str, object] = {}  # node id -> its store actor's handle, once found
        self._cursors: dict[str, dict[str, Cursor]] = {}  # node id -> tier -> where this replica read to
        self._asking: dict[str, asyncio.Future] = {}  # node id -> its store's answer on the way, at most one
        self._late: set[str] = set()  # nodes whose store's answer is late (said once)

    def indexes_for(self, node_id: str) -> list[PrefixIndex]:
        return [*self.node_tiers.get(node_id, {}).values(), self.shared]

    async def refresh(self, node_ids: set[str]) -> None:
        """Read every known node store's events from this replica's cursors (a store
        not created yet is skipped), waiting at most STORE_ANSWER_S. A store is a
        serial actor: behind a save on a hung NFS mount it answers nothing, and the
        view's refresh (membership, worker stats, readiness) must not wait with it.
        A store still answering an earlier refresh is not asked again (questions
        would pile up behind the first); its answer, when it comes, is read at the
        next refresh."""
        for gone in set(self.node_tiers) - node_ids:
            del self.node_tiers[gone]
            self._cursors.pop(gone, None)
        for gone in set(self._asking) - node_ids:
            self._asking.pop(gone).cancel()
            self._late.discard(gone)
        for node_id in node_ids:
            if node_id not in self._asking:
                self._asking[node_id] = asyncio.ensure_future(self._events_of(node_id))
        asking = {node_id: self._asking[node_id] for node_id in node_ids}
        if asking:
            await asyncio.wait(asking.values(), timeout=STORE_ANSWER_S)
        for node_id, ask in asking.items():
            if ask.done():
                del self._asking[node_id]
                self._late.discard(node_id)
                if ask.result() is not None:
                    self.apply(node_id, ask.result())
            elif node_id not in self._late:
                self._late.add(node_id)
                log.warning("the KV store of node %s has not answered in %.0f s; routing goes on with its "
                            "last events", node_id, STORE_ANSWER_S)

    async def _events_of(self, node_id: str) -> dict[str, CacheEvents] | None:
        """A node store's events since this replica's cursor (None: no store there yet, or gone)."""
        try:
            store = self._stores.get(node_id) or ray.get_actor(
                node_store_name(node_id, self.namespace, self.settings), namespace=STORE_NAMESPACE)
            batches = await store.events_since.remote(self._cursors.get(node_id))
        except (ValueError, ray.exceptions.RayError) as exc:
            self._stores.pop(node_id, None)  # not created yet, or gone: look it up again next time
            log.debug("no KV store events from node %s: %s", node_id, exc)
            return None
        self._stores[node_id] = store
        return batches

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
