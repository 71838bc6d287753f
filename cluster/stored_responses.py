"""A scheduler replica's view of the stored responses (cluster/response_store.py):
what the HTTP endpoints answer over the store actor's calls: OpenAI's errors for
an id not stored (`previous_response_not_found`, 404s), `input_items`' pages,
the store asked for again when it went with its pool manager. Apart from the
store, whose actor process then imports only what keeping responses needs.
"""

from __future__ import annotations

import asyncio

import ray

from cluster.api_models import ApiError
from cluster.item_pages import Page, listed

MAX_LISTED = 100  # input_items' `limit`, as OpenAI bounds it
REPLAY_S = 0.1  # how often a replayed stream asks the store for its response's next events


class StoredResponses:
    """A scheduler replica's view of the store: the HTTP semantics (what an
    unknown id answers, input_items' pages) over the actor's calls. `pool()`
    gives the current pool manager, which hands out the store's handle."""

    def __init__(self, pool, max_mib: float) -> None:
        self.pool = pool
        self.enabled = max_mib > 0
        self._store = None

    async def call(self, remote):
        """`remote(store)`, an actor call on the store's handle, awaited; a store gone
        with its pool manager is asked for again (the new one starts empty); 503
        while there is none."""
        for _ in range(2):
            try:
                if self._store is None:
                    self._store = await self.pool().response_store.remote()
                if self._store is None:  # (a pool manager started by settings that store nothing)
                    raise ApiError(400, "this deployment's pool manager stores no responses (response_store_mib: 0)")
                return await remote(self._store)
            except ray.exceptions.RayActorError:
                self._store = None
        raise ApiError(503, "stored responses are unavailable while the pool manager restarts; retry shortly",
                       kind="service_unavailable", headers={"Retry-After": "5"})

    async def conversation(self, previous_id: str) -> list[dict]:
        """The items a request continuing `previous_id` goes on from; a 400 as
        OpenAI's (`previous_response_not_found`) where it is not stored."""
        if not self.enabled:
            raise ApiError(400, "previous_response_id: this server stores no responses (response_store_mib is 0); "
                                "send the whole conversation in `input`", param="previous_response_id")
        found = await self.call(lambda store: store.conversation.remote(previous_id))
        if found.running_id is not None:
            raise ApiError(400, f"Previous response with id {previous_id!r} is still in progress: continue it once "
                                "it has finished", param="previous_response_id")
        if found.missing_id is not None:
            gone = "" if found.missing_id == previous_id else \
                f" (it continues {found.missing_id!r}, which is no longer stored)"
            raise ApiError(400, f"Previous response with id {previous_id!r} not found.{gone}",
                           param="previous_response_id", code="previous_response_not_found")
        return found.items

    async def keep(self, response: dict, input_items: list[dict]) -> dict:
        """A response as it ended (`ResponseStore.keep`: stored if it asked to
        be, its turn on a conversation over), in one store call; the response as
        answered (`store` false if it was not kept: too large for the store)."""
        if response["store"] or response.get("conversation"):
            response["store"] = await self.call(lambda store: store.keep.remote(response, input_items))
        return response

    async def queue(self, response: dict, input_items: list[dict], streamed: bool = False) -> bool:
        """A background response put as queued (`ResponseStore.put`); False if too large to store."""
        return await self.call(lambda store: store.put.remote(response, input_items, streamed))

    async def finish(self, response: dict, input_items: list[dict], events: list[str] = (),
                     first: int | None = None) -> bool:
        """`keep` for a background response's last state, and a streamed one's
        last events, the first of them the stream's `first` (`ResponseStore.finish`);
        whether the store kept them (not if it was cancelled, given up, deleted
        or too large meanwhile)."""
        return await self.call(lambda store: store.finish.remote(response, input_items, list(events), first))

    async def add_events(self, response_id: str, events: list[str], first: int | None = None) -> None:
        """A streamed response's next events, the first of them the stream's `first` (`ResponseStore.add_events`)."""
        await self.call(lambda store: store.add_events.remote(response_id, events, False, first))

    async def replay(self, response_id: str, after: int = -1):
        """A streamed background response's events after sequence number
        `after`, as they are stored, until its last (polling every `REPLAY_S`
        while it runs); a 404 where it is not stored, a 400 where it was not
        streamed."""
        if after < -1:
            raise ApiError(400, f"starting_after: a sequence number (-1 or more), not {after}", param="starting_after")
        page = await self.call(lambda store: store.events.remote(response_id, after)) if self.enabled else None
        if page is None:
            await self.get(response_id)  # (the 404, where it is not stored)
            raise ApiError(400, f"Response with id {response_id!r} was not created with background and stream: "
                                "its events are not kept; GET it without stream", param="stream")
        return self._replayed(response_id, after, page)

    async def _replayed(self, response_id: str, after: int, page):
        while True:
            for event in page.events:
                yield event
            after += len(page.events)
            if page.is_over:
                return
            await asyncio.sleep(REPLAY_S)
            page = await self.call(lambda store: store.events.remote(response_id, after))
            if page is None:  # (deleted meanwhile)
                return

    async def beat(self, response_id: str) -> str | None:
        """A running background response's replica at work on it (`ResponseStore.beat`)."""
        return await self.call(lambda store: store.beat.remote(response_id))

    async def cancel(self, response_id: str) -> dict:
        """OpenAI's cancel: a background response's state once cancelled (one
        finished already: as it is; cancelling twice is the same)."""
        response = await self.call(lambda store: store.cancel.remote(response_id)) if self.enabled else None
        if response is None:
            raise _not_found(response_id)
        if not response.get("background"):  # (finished when stored: the store's cancel left it so)
            raise ApiError(400, f"Response with id {response_id!r} is not a background one: only background "
                                "responses can be cancelled", param="response_id")
        return response

    async def get(self, response_id: str) -> dict:
        """The response's object (GET's answer)."""
        response = await self.call(lambda store: store.response.remote(response_id)) if self.enabled else None
        if response is None:
            raise _not_found(response_id)
        return response

    async def delete(self, response_id: str) -> dict:
        if not (self.enabled and await self.call(lambda store: store.delete.remote(response_id))):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(self, response_id: str, limit: int = 20, order: str = "desc",
                          after: str | None = None) -> dict:
        """A page of a response's input items, as OpenAI lists them (newest
        first unless `order` is "asc"; `after` an item id of the page before)."""
        check_page(limit, order)
        page = await self.call(lambda store: store.input_items.remote(response_id, limit, order, after)) \
            if self.enabled else None
        if page is None:
            raise _not_found(response_id)
        return listed_page(page, after, f"response {response_id!r}")


def check_page(limit: int, order: str) -> None:
    if not 1 <= limit <= MAX_LISTED:
        raise ApiError(400, f"limit: between 1 and {MAX_LISTED}, not {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order: 'asc' or 'desc', not {order!r}", param="order")


def listed_page(page: Page, after: str | None, owner: str) -> dict:
    """A page (cluster/item_pages.py) as OpenAI lists it; a 400 where `after`
    names no item of `owner`."""
    if not page.after_found:
        raise ApiError(400, f"after: no item {after!r} in {owner}", param="after")
    return listed(page.items, page.has_more)


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id {response_id!r} not found.", param="response_id")
