"""Stored responses and conversations: what OpenAI's Responses API keeps of a
response (`store`, its default) so that a later request continues it by
`previous_response_id`, and `GET /v1/responses/{id}` (and its `input_items`) or
`DELETE` find it; and the Conversations API's conversations (`/v1/conversations`),
which a response given `conversation` goes on from and adds its items to.

One store a deployment: an actor (`ResponseStore`) the pool manager starts with
the pools (a first request would wait about two seconds here for an actor to
start), so every scheduler replica finds the same one and it goes when the pools
go. It holds at most `response_store_mib` of responses and conversations, counted
as their JSON, least recently used out first; continuing a conversation touches every
response it goes back through, oldest first, so another conversation's last
response leaves before this one's first. A cache, not a database: a response or
conversation the bound evicted, one deleted, or one from before the pools
restarted is answered as OpenAI answers an id it does not know
(`previous_response_not_found`, or a 404). OpenAI keeps a conversation until it is
deleted; here a long idle one can be evicted like a response (raise the bound, or
watch `ray_tandem_response_store_evictions_total`).
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

A conversation object keeps its items itself. A response on it takes a turn
(`begin_turn`): the conversation is held by that response until it ends
(`end_turn`, its input and output items added if it completed or was cut), and
another response on it meanwhile is refused, as OpenAI refuses it
(`conversation_locked`); a turn nobody ends (its replica died) lapses after the
lease it was taken for.

A background response created with `stream` keeps its events too (`add_events`,
as its replica streams them; the last ones with its final state, in `finish`),
so that `GET /v1/responses/{id}?stream=true` replays them from any replica, and
a client whose stream broke resumes after the last sequence number it saw
(`events`). They count against the bound with the response; where they would be
over it, those kept stay a whole prefix and no more are added.

What the HTTP endpoints make of all this:
cluster/stored_responses.py and cluster/stored_conversations.py (this module
stays light: the actor's process imports it, and so only json and Ray). Each
answer is what its endpoint shows (a page of items, a response's object), cut
here: a GET that polls a background response, or pages a long conversation, is
not sent every item and event each time.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

import ray

from cluster.item_pages import Page, items_page
from cluster.pool_metrics import ResponseStoreMetrics

MIB = 2**20
RUNNING = ("queued", "in_progress")  # a background response's states before its last
LOST_AFTER_S = 15.0  # a running response whose replica has said nothing this long failed with it


@dataclass
class Stored:
    response: dict
    input_items: list[dict]
    size: int  # bytes of their JSON, as put, and of its events
    beat_s: float = 0.0  # a running response's: when its replica last said it works on it
    events: list[str] | None = None  # a streamed background response's SSE events, from the first (None: not streamed)
    events_done: bool = False  # its last event is among them
    events_cut: bool = False  # one did not fit the bound: those kept are the first, and no more are


@dataclass
class Events:
    """A streamed background response's events after a sequence number, and
    whether they are all there will be (`is_over`: its last kept, or it
    stopped: cancelled, or its replica lost)."""

    events: list[str]
    is_over: bool


@dataclass
class KeptConversation:
    conversation: dict  # the Conversations API's object: id, object, created_at, metadata
    items: list[dict]
    size: int  # bytes of their JSON: the object's as put, each item's as added
    turn_id: str | None = None  # the response whose turn it is (None: free)
    turn_until_s: float = 0.0  # when that turn lapses unless ended


@dataclass
class Conversation:
    """The items of a conversation up to a response (or of a conversation
    object); or the id of the first response on the way back that is not stored
    (`missing_id`: for an object, its own), or of the one named if it is still
    running (`running_id`: for an object, the response whose turn it is), the
    items then empty."""

    items: list[dict]
    missing_id: str | None = None
    running_id: str | None = None


def _size(value) -> int:
    return len(json.dumps(value, separators=(",", ":")))


class ResponseStore:
    """The responses and conversations, by id (distinct prefixes: `resp_`,
    `conv_`), in least-recently-used order (an actor: one a deployment, see
    `start_response_store`). A background response
    (cluster/background_responses.py) is put first as queued; its replica then
    beats (`beat`) while it runs, which also tells it whether it was cancelled,
    and `finish` puts its last state unless it was cancelled meanwhile; one
    whose replica stopped beating is answered as failed. Either way its turn on a
    conversation ends with it."""

    def __init__(self, max_bytes: int, metrics: ResponseStoreMetrics | None = None, clock=time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.clock = clock
        self.entries: OrderedDict[str, Stored | KeptConversation] = OrderedDict()
        self.num_bytes = 0
        self.num_conversations = 0
        self.num_evicted = 0

    def put(self, response: dict, input_items: list[dict], streamed: bool = False) -> bool:
        """Keep a response (finished, or a background one queued, `streamed`
        if its events are to be kept too); False if it alone is over the bound."""
        size = _size([response, input_items])
        if size > self.max_bytes:
            return False
        if isinstance(self.entries.get(response["id"]), Stored):  # (replaced: a background one's last state)
            self._drop(response["id"])
        return self._add(response["id"], Stored(response, input_items, size, self.clock(), [] if streamed else None))

    def get(self, response_id: str) -> Stored | None:
        stored = self.entries.get(response_id)
        if not isinstance(stored, Stored):
            return None
        self.entries.move_to_end(response_id)
        if self._is_lost(stored):
            self._restate(stored, status="failed", error={
                "code": "server_error", "message": "the scheduler replica running this response stopped"})
            self._turn_ends(stored.response, None)
        return stored

    def keep(self, response: dict, input_items: list[dict]) -> bool:
        """A response as it ended: its turn on a conversation over (its input
        and output added if it completed or was cut), then put if it asks to be
        stored; whether it was put."""
        self._turn_ends(response, input_items)
        return bool(response["store"]) and self.put(response, input_items)

    def finish(self, response: dict, input_items: list[dict], events: list[str] = (), first: int | None = None) -> bool:
        """`keep` a background response's last state, and a streamed one's last
        `events` with it (so a reader that sees it finished has them all;
        `first`: as `add_events`), unless it was cancelled or given up meanwhile
        (then False, and the store keeps that), or deleted (then False, and it
        stays deleted: it came back with its answer when it finished before its
        replica's next beat). One too large to store alone fails so (it stayed
        in progress, and read as its replica's death when the beats stopped),
        before its turn adds anything to its conversation: added first, the
        conversation grown could evict the response itself, which then went
        (a 404, not failed), its failure's bytes counted for an entry gone."""
        stored = self.get(response["id"])
        if stored is None or stored.response["status"] not in RUNNING:
            return False
        if response["store"] and _size([response, input_items]) > self.max_bytes:
            self._restate(stored, status="failed", error={
                "code": "server_error", "message": "the response is larger than this server stores "
                                                   "(response_store_mib): it was not kept"})
            self._turn_ends(stored.response, None)
            return False
        if not self.keep(response, input_items):
            return False
        if stored.events is not None:  # (carried over to the entry put, then the last unless some were cut)
            kept = self.entries[response["id"]]
            kept.events = []
            for event in stored.events:  # (one at a time: the longest prefix that fits with the final state)
                if not self.add_events(response["id"], [event]):
                    break
            kept.events_cut = kept.events_cut or stored.events_cut
            self.add_events(response["id"], events, done=True, first=first)
        return True

    def add_events(self, response_id: str, events: list[str], done: bool = False, first: int | None = None) -> bool:
        """A streamed background response's next events (`done`: its last);
        False if they are not kept (not streamed, gone, or over the bound: then
        none of them nor any after, the first ones staying a whole prefix).
        `first`: the index of the first of them in the stream; those already
        held are not added again (a call its sender stopped may have come
        through, and sent again, events were stored twice: a replay repeated
        sequence numbers), and after a gap none are."""
        stored = self.get(response_id)
        if stored is None or stored.events is None:
            return False
        stored.events_done = stored.events_done or done
        if stored.events_cut:
            return False
        if first is not None:
            if first > len(stored.events):  # (a batch never came: the kept ones stay a whole prefix)
                stored.events_cut = True
                return False
            events = events[len(stored.events) - first :]
        if not self._grow(stored, sum(map(len, events))):
            stored.events_cut = True
            return False
        stored.events += events
        return True

    def events(self, response_id: str, after: int) -> Events | None:
        """A streamed response's events with sequence numbers after `after`
        (None: not stored, or not streamed)."""
        stored = self.get(response_id)
        if stored is None or stored.events is None:
            return None
        is_over = stored.events_done or stored.response["status"] not in RUNNING
        return Events(stored.events[after + 1:], is_over)

    def beat(self, response_id: str) -> str | None:
        """A running response's replica saying it works on it: its status now
        (None: no longer stored; anything but in_progress: stop)."""
        stored = self.get(response_id)
        if stored is None:
            return None
        if stored.response["status"] in RUNNING:
            if stored.response["status"] != "in_progress":
                self._restate(stored, status="in_progress")
            stored.beat_s = self.clock()
        return stored.response["status"]

    def cancel(self, response_id: str) -> dict | None:
        """A running response cancelled (its replica stops at its next beat,
        its turn on a conversation ends now, adding nothing); a finished one as
        it is."""
        stored = self.get(response_id)
        if stored is None:
            return None
        if stored.response["status"] in RUNNING:
            self._restate(stored, status="cancelled")
            self._turn_ends(stored.response, None)
        return stored.response

    # ---- views: what an endpoint answers alone, not a whole entry (its items, its events) ----
    def response(self, response_id: str) -> dict | None:
        stored = self.get(response_id)
        return None if stored is None else stored.response

    def input_items(self, response_id: str, limit: int, order: str, after: str | None) -> Page | None:
        stored = self.get(response_id)
        return None if stored is None else items_page(stored.input_items, limit, order, after)

    def conversation_object(self, conversation_id: str) -> dict | None:
        kept = self.get_conversation(conversation_id)
        return None if kept is None else kept.conversation

    def conversation_items(self, conversation_id: str, limit: int, order: str, after: str | None) -> Page | None:
        kept = self.get_conversation(conversation_id)
        return None if kept is None else items_page(kept.items, limit, order, after)

    def conversation_item(self, conversation_id: str, item_id: str) -> dict | bool | None:
        """The item (None: no such conversation; False: no such item in it)."""
        kept = self.get_conversation(conversation_id)
        return None if kept is None else next((item for item in kept.items if item["id"] == item_id), False)

    def conversation(self, response_id: str) -> Conversation:
        """The items of the conversation up to and with this response: its
        ancestors', then its input and output."""
        named = self.get(response_id)
        if named is not None and named.response["status"] in RUNNING:
            return Conversation([], running_id=response_id)
        chain, at = [], response_id
        while at is not None:
            stored = self.entries.get(at)
            if not isinstance(stored, Stored):
                return Conversation([], missing_id=at)
            chain.append(stored)
            at = stored.response.get("previous_response_id")
        chain.reverse()
        for stored in chain:  # (oldest first: the one continued is the most recent)
            self.entries.move_to_end(stored.response["id"])
        return Conversation([item for stored in chain for item in (*stored.input_items, *stored.response["output"])])

    def delete(self, response_id: str) -> bool:
        """A response forgotten (a running one's turn on a conversation ends,
        adding nothing; its replica stops at its next beat)."""
        stored = self.get(response_id)
        if stored is None:
            return False
        if stored.response["status"] in RUNNING:
            self._turn_ends(stored.response, None)
        return self._drop(response_id)

    # ---- conversation objects ---------------------------------------------------------
    def create_conversation(self, conversation: dict, items: list[dict]) -> bool:
        """Keep a new conversation with its first items; False if it alone is over the bound."""
        size = _size(conversation) + sum(map(_size, items))
        return self._add(conversation["id"], KeptConversation(conversation, list(items), size))

    def get_conversation(self, conversation_id: str) -> KeptConversation | None:
        kept = self.entries.get(conversation_id)
        if not isinstance(kept, KeptConversation):
            return None
        self.entries.move_to_end(conversation_id)
        if kept.turn_id is not None:
            holder = self.entries.get(kept.turn_id)  # (a background response's, stored while it runs)
            if self.clock() > kept.turn_until_s or (isinstance(holder, Stored) and self._is_lost(holder)):
                kept.turn_id = None  # (whoever took it is gone)
        return kept

    def update_conversation(self, conversation_id: str, metadata: dict) -> dict | bool | None:
        """The conversation with its metadata replaced (None: not stored; False:
        it would be over the bound, and is as it was)."""
        kept = self.get_conversation(conversation_id)
        if kept is None or not self._grow(kept, _size(metadata) - _size(kept.conversation["metadata"])):
            return None if kept is None else False
        kept.conversation["metadata"] = metadata
        return kept.conversation

    def delete_conversation(self, conversation_id: str) -> bool:
        return self.get_conversation(conversation_id) is not None and self._drop(conversation_id)

    def add_items(self, conversation_id: str, items: list[dict]) -> str | bool | None:
        """Items added at the conversation's end: True (None: not stored; False:
        it would be over the bound; a string: the id of one the conversation has
        already; nothing added then)."""
        kept = self.get_conversation(conversation_id)
        if kept is None:
            return None
        held = {item["id"] for item in kept.items}
        clash = next((item["id"] for item in items if item["id"] in held), None)
        if clash is not None:
            return clash
        if not self._grow(kept, sum(map(_size, items))):
            return False
        kept.items += items
        return True

    def delete_item(self, conversation_id: str, item_id: str) -> dict | bool | None:
        """An item taken out: the conversation's object (None: not stored; False: it has no such item)."""
        kept = self.get_conversation(conversation_id)
        if kept is None:
            return None
        index = next((k for k, item in enumerate(kept.items) if item.get("id") == item_id), None)
        if index is None:
            return False
        self._grow(kept, -_size(kept.items.pop(index)))
        return kept.conversation

    def begin_turn(self, conversation_id: str, response_id: str, lease_s: float) -> Conversation:
        """A response's turn on the conversation, held for it at most `lease_s`
        (a request's timeout): the items it goes on from; or the conversation
        missing, or the response whose turn it is (nothing taken then)."""
        kept = self.get_conversation(conversation_id)
        if kept is None:
            return Conversation([], missing_id=conversation_id)
        if kept.turn_id is not None:
            return Conversation([], running_id=kept.turn_id)
        kept.turn_id, kept.turn_until_s = response_id, self.clock() + lease_s
        return Conversation(list(kept.items))

    def end_turn(self, conversation_id: str, response_id: str, items: list[dict] | None) -> bool:
        """The response's turn over, its `items` added (None: it adds none,
        having failed, been cancelled or left); False if the conversation is no
        longer stored, they would be over the bound, or one's id is one it has
        (added by id while the response ran): then added are none."""
        kept = self.get_conversation(conversation_id)
        if kept is not None and kept.turn_id == response_id:
            kept.turn_id = None
        return kept is not None and (items is None or self.add_items(conversation_id, items) is True)

    def _is_lost(self, stored: Stored) -> bool:
        return stored.response["status"] in RUNNING and self.clock() - stored.beat_s > LOST_AFTER_S

    def _turn_ends(self, response: dict, input_items: list[dict] | None) -> None:
        """A response's turn on its conversation (if it is on one) ends as the
        response did: its items added if it completed or was cut (`input_items`
        given), none otherwise."""
        on = response.get("conversation")
        if on is not None:
            added = input_items is not None and response["status"] in ("completed", "incomplete")
            self.end_turn(on["id"], response["id"], [*input_items, *response["output"]] if added else None)

    # ---- the bound ---------------------------------------------------------------------
    def _add(self, entry_id: str, entry: Stored | KeptConversation) -> bool:
        """A new entry, the most recent; False if it alone is over the bound."""
        if entry.size > self.max_bytes:
            return False
        self._make_room(entry.size)
        self.entries[entry_id] = entry
        self.num_bytes += entry.size
        self.num_conversations += isinstance(entry, KeptConversation)
        self._held()
        return True

    def _make_room(self, size: int) -> None:
        """Evict the least recently used until `size` more bytes fit (an entry
        growing is the most recent and fits alone, so it stays). A running
        response evicted ends its turn on its conversation, as a delete does (it
        held the conversation until the turn's lease ran out, about 6 minutes)."""
        num_evicted = 0
        while self.num_bytes + size > self.max_bytes and self.entries:
            oldest_id = next(iter(self.entries))
            oldest = self.entries[oldest_id]
            if isinstance(oldest, Stored) and oldest.response["status"] in RUNNING:
                self._release_turn(oldest_id, oldest.response)
            self._drop(oldest_id)
            num_evicted += 1
        self.num_evicted += num_evicted
        self._held(num_evicted)

    def _release_turn(self, response_id: str, response: dict) -> None:
        """An evicted running response's turn on its conversation ended, the
        conversation left where it is in the LRU order (`end_turn` uses it: it
        became the most recent, and the entry growing, evicted in its place,
        went on counting its bytes)."""
        on = response.get("conversation")
        kept = self.entries.get(on["id"]) if on is not None else None
        if isinstance(kept, KeptConversation) and kept.turn_id == response_id:
            kept.turn_id = None

    def _grow(self, kept: Stored | KeptConversation, size: int) -> bool:
        """`size` more bytes (fewer, if negative) for an entry just used (the
        most recent); False if it would be over the bound alone (nothing
        evicted then)."""
        if kept.size + size > self.max_bytes:
            return False
        self._make_room(size)
        kept.size += size
        self.num_bytes += size
        self._held()
        return True

    def _restate(self, stored: Stored, **fields) -> None:
        """`fields` (a status, an error) set on a stored response just used (the
        most recent), its size and the store's with them (left out, the bytes
        drifted from the JSON's: a failure's error is a hundred bytes or more)."""
        before = _size(stored.response)
        stored.response.update(fields)
        grown = _size(stored.response) - before
        if not self._grow(stored, grown):  # (over the bound alone by a status's bytes: kept, counted)
            stored.size += grown
            self.num_bytes += grown

    def _drop(self, entry_id: str) -> bool:
        entry = self.entries.pop(entry_id)
        self.num_bytes -= entry.size
        self.num_conversations -= isinstance(entry, KeptConversation)
        self._held()
        return True

    def _held(self, num_evicted: int = 0) -> None:
        if self.metrics is not None:
            self.metrics.held(len(self.entries) - self.num_conversations, self.num_conversations, self.num_bytes,
                              num_evicted)

    def stats(self) -> dict:
        return {"responses": len(self.entries) - self.num_conversations, "conversations": self.num_conversations,
                "bytes": self.num_bytes, "max_bytes": self.max_bytes, "evicted": self.num_evicted}


class ResponseStoreActor(ResponseStore):
    """The store as the actor runs it: exporting its metrics (cluster/pool_metrics.py)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes, ResponseStoreMetrics())


def start_response_store(max_bytes: int):
    """A new store actor (the pool manager's: it owns it, so they go together).
    One that dies is restarted by Ray, empty, and the calls it was given are
    made again there."""
    return ray.remote(ResponseStoreActor).options(num_cpus=0, max_restarts=-1, max_task_retries=-1).remote(max_bytes)
