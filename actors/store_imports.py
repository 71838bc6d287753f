"""A worker's side of its node's KV store (docs/kv-store.md): the store and the
write-through thread its engine saves computed prompt blocks through; before a
request starts here, its prompt's blocks past what the device pool holds loaded
from the store and copied in (`import_prefix`), and handed over to the request
with no cancel in between (`import_then`); the store's stats.

`StoreImports` is a mixin of `WorkerBase`, whose engine (`engine`), engine-thread
calls (`call`) and thread pool (`in_thread`) it uses.
"""

from __future__ import annotations

import logging

from actors.background import run_to_end
from actors.engine import Engine
from actors.kv_store import KVStoreSettings, StoreStats
from actors.kv_store_client import KVStoreClient, StoreWriter, open_kv_store
from actors.messages import GenerateRequest

log = logging.getLogger(__name__)


class StoreImports:
    engine: Engine

    def _open_kv_store(self, settings: KVStoreSettings | None) -> None:
        """The node's store and a write-through thread to it; none without `settings`."""
        self.kv_store: KVStoreClient | None = None
        self.store_writer: StoreWriter | None = None
        if settings is not None:
            self.kv_store = open_kv_store(self.engine.kv_namespace, settings)
            self.store_writer = StoreWriter(self.kv_store)
            self.engine.store_bridge.sink = self.store_writer.submit

    async def import_prefix(self, request: GenerateRequest, computes_prompt: bool = True,
                            reserving: bool = False) -> list[int]:
        """Warm the device prefix cache from the KV store before a request starts:
        find the prompt's blocks past what the pool holds, load them (off the engine
        thread, while it keeps stepping) and copy them in. Returns the prefix's block
        ids, held for `add_request(pinned_block_ids=...)` or `reserve`. Nothing for
        a request whose prompt this worker computes (`computes_prompt`) for its
        logprobs: they come from every position, as `Scheduler.cached_prefix`; nor
        for a reservation (`reserving`: the prompt and a token's blocks at once)
        the pool has no room for (`Engine.reservation_room`, `Engine.batch_full`): the loaded blocks
        would take the place of other prefixes' and be evicted again before the
        reservation's next try."""
        if self.kv_store is None or (computes_prompt and request.params.prompt_logprobs is not None):
            return []
        prompt_ids = request.prompt_token_ids

        def plan(engine: Engine):
            if reserving and engine.batch_full:  # (no reservation now: as without room)
                return [], 0, False
            room = engine.reservation_room(len(prompt_ids), request.params) if reserving else None
            return engine.store_bridge.prefix_plan(prompt_ids, room)

        hashes, first, has_room = await self.call(plan)
        if first >= len(hashes) or not has_room:
            return []
        try:
            blocks = await self.in_thread(self.kv_store.load, hashes[first:])
        except Exception as exc:  # the store is an optimisation: compute instead
            log.warning("KV store load failed: %s: %s", type(exc).__name__, exc)
            return []
        if not blocks:
            return []
        return await self.call(lambda e: e.store_bridge.import_prefix(prompt_ids, first, blocks))

    @property
    def num_store_loaded_blocks(self) -> int:
        """Prompt blocks loaded from the store and copied in, not computed (not
        those another request computed into the pool while the load ran)."""
        return self.engine.store_bridge.num_imported

    async def import_then(self, request: GenerateRequest, start, **import_options):
        """`import_prefix`, then `start(engine, held)` on the engine thread with the
        blocks it holds, both run to their end even if the caller is cancelled
        meanwhile (its client left): the held blocks are `start`'s to hand over (to
        the request it adds, the reservation it makes) or release, and a cancel
        between the two calls pinned them for good (a review found it). `start` is
        where a request ended or gone meanwhile is turned away."""
        async def both():
            held = await self.import_prefix(request, **import_options)
            return await self.call(lambda engine: start(engine, held))

        return await run_to_end(both())

    async def kv_store_stats(self) -> StoreStats | None:
        """The node store's tiers (entries, bytes, hits), after pending writes."""
        if self.kv_store is None:
            return None
        await self.in_thread(self.store_writer.flush)
        return await self.in_thread(self.kv_store.stats)
