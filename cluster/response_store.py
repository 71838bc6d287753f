"""Stored responses: what OpenAI's Responses API keeps of a response (`store`,
its default) so that a later request continues it by `previous_response_id`, and
`GET /v1/responses/{id}` (and its `input_items`) or `DELETE` find it.

One store a deployment: an actor (`ResponseStore`) the pool manager starts with
the pools (a first request would wait about two seconds here for an actor to
start), so every scheduler replica finds the same one and it goes when the pools
go. It holds at most `response_store_mib` of responses, counted as their
JSON, least recently used out first; continuing a conversation touches every
response it goes back through, oldest first, so another conversation's last
response leaves before this one's first. A cache, not a database: a response the
bound evicted, one deleted, or one from before the pools restarted is answered as
OpenAI answers an id it does not know (`previous_response_not_found`, or a 404).
There are no tenants: whoever holds the API key reads every stored response, as
with one OpenAI project's key.

vLLM keeps its store in each API server's memory, unbounded and off unless
`VLLM_ENABLE_RESPONSES_API_STORE=1` (vllm-project/vllm#22137); a replica then
knows only its own responses. Here any replica continues any response.

Each response is kept with its own input items (a string input as one user
message item; every item given an id, as `input_items` lists them) and the id of
the response it continued. The conversation behind an id is its ancestors' input
and output items, oldest first, then its own; their `instructions` are not carried
over (OpenAI's rule: a request gives its own).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

import ray

from cluster.api_models import ApiError
from cluster.pool_metrics import ResponseStoreMetrics

MIB = 2**20
MAX_LISTED = 100  # input_items' `limit`, as OpenAI bounds it


@dataclass
class Stored:
    response: dict
    input_items: list[dict]
    size: int  # bytes of their JSON


@dataclass
class Conversation:
    """The items of a conversation up to a response, or the id of the first
    response on the way back that is not stored (`missing_id`, the items empty)."""

    items: list[dict]
    missing_id: str | None = None


class ResponseStore:
    """The responses, by id, in least-recently-used order (an actor: one a
    deployment, see `get_response_store`)."""

    def __init__(self, max_bytes: int, metrics: ResponseStoreMetrics | None = None) -> None:
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.num_bytes = 0
        self.num_evicted = 0

    def put(self, response: dict, input_items: list[dict]) -> bool:
        """Keep a finished response; False if it alone is over the bound."""
        size = len(json.dumps([response, input_items], separators=(",", ":")))
        if size > self.max_bytes:
            return False
        self.delete(response["id"])
        num_evicted = 0
        while self.num_bytes + size > self.max_bytes:
            _, oldest = self.entries.popitem(last=False)
            self.num_bytes -= oldest.size
            num_evicted += 1
        self.entries[response["id"]] = Stored(response, input_items, size)
        self.num_bytes += size
        self.num_evicted += num_evicted
        self._held(num_evicted)
        return True

    def get(self, response_id: str) -> Stored | None:
        stored = self.entries.get(response_id)
        if stored is not None:
            self.entries.move_to_end(response_id)
        return stored

    def conversation(self, response_id: str) -> Conversation:
        """The items of the conversation up to and with this response: its
        ancestors', then its input and output."""
        chain, at = [], response_id
        while at is not None:
            stored = self.entries.get(at)
            if stored is None:
                return Conversation([], missing_id=at)
            chain.append(stored)
            at = stored.response.get("previous_response_id")
        chain.reverse()
        for stored in chain:  # (oldest first: the one continued is the most recent)
            self.entries.move_to_end(stored.response["id"])
        return Conversation([item for stored in chain for item in (*stored.input_items, *stored.response["output"])])

    def delete(self, response_id: str) -> bool:
        stored = self.entries.pop(response_id, None)
        if stored is None:
            return False
        self.num_bytes -= stored.size
        self._held()
        return True

    def _held(self, num_evicted: int = 0) -> None:
        if self.metrics is not None:
            self.metrics.held(len(self.entries), self.num_bytes, num_evicted)

    def stats(self) -> dict:
        return {"responses": len(self.entries), "bytes": self.num_bytes, "max_bytes": self.max_bytes,
                "evicted": self.num_evicted}


class ResponseStoreActor(ResponseStore):
    """The store as the actor runs it: exporting its metrics (cluster/pool_metrics.py)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes, ResponseStoreMetrics())


def start_response_store(max_bytes: int):
    """A new store actor (the pool manager's: it owns it, so they go together).
    One that dies is restarted by Ray, empty, and the calls it was given are
    made again there."""
    return ray.remote(ResponseStoreActor).options(num_cpus=0, max_restarts=-1, max_task_retries=-1).remote(max_bytes)


class StoredResponses:
    """A scheduler replica's view of the store: the HTTP semantics (what an
    unknown id answers, input_items' pages) over the actor's calls. `pool()`
    gives the current pool manager, which hands out the store's handle."""

    def __init__(self, pool, max_mib: float) -> None:
        self.pool = pool
        self.enabled = max_mib > 0
        self._store = None

    async def _call(self, call):
        """`call(store)`, an actor call on the store's handle, awaited; a store gone
        with its pool manager is asked for again (the new one starts empty); 503
        while there is none."""
        for attempt in (0, 1):
            try:
                if self._store is None:
                    self._store = await self.pool().response_store.remote()
                if self._store is None:  # (a pool manager started by settings that store nothing)
                    raise ApiError(400, "this deployment's pool manager stores no responses (response_store_mib: 0)")
                return await call(self._store)
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
        found = await self._call(lambda store: store.conversation.remote(previous_id))
        if found.missing_id is not None:
            gone = "" if found.missing_id == previous_id else \
                f" (it continues {found.missing_id!r}, which is no longer stored)"
            raise ApiError(400, f"Previous response with id {previous_id!r} not found.{gone}",
                           param="previous_response_id", code="previous_response_not_found")
        return found.items

    async def keep(self, response: dict, input_items: list[dict]) -> dict:
        """Store a finished response if it asked to be; the response as answered
        (`store` false if it was not kept: too large for the store)."""
        if response["store"]:
            response["store"] = await self._call(lambda store: store.put.remote(response, input_items))
        return response

    async def get(self, response_id: str) -> Stored:
        stored = await self._call(lambda store: store.get.remote(response_id)) if self.enabled else None
        if stored is None:
            raise ApiError(404, f"Response with id {response_id!r} not found.", param="response_id")
        return stored

    async def delete(self, response_id: str) -> dict:
        if not (self.enabled and await self._call(lambda store: store.delete.remote(response_id))):
            raise ApiError(404, f"Response with id {response_id!r} not found.", param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(self, response_id: str, limit: int = 20, order: str = "desc",
                          after: str | None = None) -> dict:
        """A page of a response's input items, as OpenAI lists them (newest
        first unless `order` is "asc"; `after` an item id of the page before)."""
        if not 1 <= limit <= MAX_LISTED:
            raise ApiError(400, f"limit: between 1 and {MAX_LISTED}, not {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order: 'asc' or 'desc', not {order!r}", param="order")
        items = (await self.get(response_id)).input_items
        items = items if order == "asc" else items[::-1]
        start = 0
        if after is not None:
            start = next((k + 1 for k, item in enumerate(items) if item["id"] == after), None)
            if start is None:
                raise ApiError(400, f"after: no input item {after!r} in response {response_id!r}", param="after")
        page = items[start:start + limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}
