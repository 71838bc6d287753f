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
over (OpenAI's rule: a request gives its own). What the HTTP endpoints make of
it: cluster/stored_responses.py (this module stays light: the actor's process
imports it, and so only json and Ray).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

import ray

from cluster.pool_metrics import ResponseStoreMetrics

MIB = 2**20
RUNNING = ("queued", "in_progress")  # a background response's states before its last
LOST_AFTER_S = 15.0  # a running response whose replica has said nothing this long failed with it


@dataclass
class Stored:
    response: dict
    input_items: list[dict]
    size: int  # bytes of their JSON, as put
    beat_s: float = 0.0  # a running response's: when its replica last said it works on it


@dataclass
class Conversation:
    """The items of a conversation up to a response; or the id of the first
    response on the way back that is not stored (`missing_id`), or of the one
    named if it is still running (`running_id`), the items then empty."""

    items: list[dict]
    missing_id: str | None = None
    running_id: str | None = None


class ResponseStore:
    """The responses, by id, in least-recently-used order (an actor: one a
    deployment, see `start_response_store`). A background response
    (cluster/background_responses.py) is put first as queued; its replica then
    beats (`beat`) while it runs, which also tells it whether it was cancelled,
    and `finish` puts its last state unless it was cancelled meanwhile; one
    whose replica stopped beating is answered as failed."""

    def __init__(self, max_bytes: int, metrics: ResponseStoreMetrics | None = None, clock=time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.clock = clock
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.num_bytes = 0
        self.num_evicted = 0

    def put(self, response: dict, input_items: list[dict]) -> bool:
        """Keep a response (finished, or a background one queued); False if it
        alone is over the bound."""
        size = len(json.dumps([response, input_items], separators=(",", ":")))
        if size > self.max_bytes:
            return False
        self.delete(response["id"])
        num_evicted = 0
        while self.num_bytes + size > self.max_bytes:
            _, oldest = self.entries.popitem(last=False)
            self.num_bytes -= oldest.size
            num_evicted += 1
        self.entries[response["id"]] = Stored(response, input_items, size, self.clock())
        self.num_bytes += size
        self.num_evicted += num_evicted
        self._held(num_evicted)
        return True

    def get(self, response_id: str) -> Stored | None:
        stored = self.entries.get(response_id)
        if stored is not None:
            self.entries.move_to_end(response_id)
            if stored.response["status"] in RUNNING and self.clock() - stored.beat_s > LOST_AFTER_S:
                stored.response.update(status="failed", error={
                    "code": "server_error", "message": "the scheduler replica running this response stopped"})
        return stored

    def finish(self, response: dict, input_items: list[dict]) -> bool:
        """Put a background response's last state, unless it was cancelled or
        given up meanwhile (then False, and the store keeps that)."""
        stored = self.get(response["id"])
        if stored is not None and stored.response["status"] not in RUNNING:
            return False
        return self.put(response, input_items)

    def beat(self, response_id: str) -> str | None:
        """A running response's replica saying it works on it: its status now
        (None: no longer stored; anything but in_progress: stop)."""
        stored = self.get(response_id)
        if stored is None:
            return None
        if stored.response["status"] in RUNNING:
            stored.response["status"], stored.beat_s = "in_progress", self.clock()
        return stored.response["status"]

    def cancel(self, response_id: str) -> Stored | None:
        """A running response cancelled (its replica stops at its next beat);
        a finished one as it is."""
        stored = self.get(response_id)
        if stored is not None and stored.response["status"] in RUNNING:
            stored.response["status"] = "cancelled"
        return stored

    def conversation(self, response_id: str) -> Conversation:
        """The items of the conversation up to and with this response: its
        ancestors', then its input and output."""
        named = self.get(response_id)
        if named is not None and named.response["status"] in RUNNING:
            return Conversation([], running_id=response_id)
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
