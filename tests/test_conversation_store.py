"""Conversation objects in the store (cluster/response_store.py), the actor's class
run in this process: items added and deleted with their bytes counted against the
bound (another entry evicted, never the one growing), a response's turn held
against a second one until it ends (its items added only if it finished), or
until its lease lapses or its background response is lost, cancelled or deleted;
and ids of one kind never answered as the other. Over HTTP:
tests/test_serve_conversations.py."""

from __future__ import annotations

import asyncio
import json
import zlib

import pytest

from cluster.api_models import ApiError
from cluster.response_store import LOST_AFTER_S, KeptConversation, ResponseStore
from cluster.stored_conversations import StoredConversations
from cluster.stored_responses import StoredResponses


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _conversation(conversation_id: str) -> dict:
    return {"id": conversation_id, "object": "conversation", "created_at": 0, "metadata": {}}


def _item_id(text: str) -> str:
    return f"msg_{zlib.crc32(text.encode()):08x}"  # (one a text: unique, as the store's are)


def _item(text: str, role: str = "user") -> dict:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "id": _item_id(text), "role": role, "status": "completed",
            "content": [{"type": kind, "text": text}]}


def _texts(items: list[dict]) -> list[str]:
    return [item["content"][0]["text"] for item in items]


def _size(value) -> int:
    return len(json.dumps(value, separators=(",", ":")))


def _response(response_id: str, status: str, text: str, on: str | None) -> dict:
    return {"id": response_id, "object": "response", "status": status, "previous_response_id": None,
            "output": [_item(text, "assistant")] if text else [], "store": True, "background": True,
            "conversation": None if on is None else {"id": on}}


def _counted(store: ResponseStore) -> bool:
    """Every conversation's bytes its JSON's, and their sum the store's, within its bound."""
    return store.num_bytes == sum(entry.size for entry in store.entries.values()) <= store.max_bytes and all(
        kept.size == _size(kept.conversation) + sum(map(_size, kept.items)) for kept in store.entries.values()
        if isinstance(kept, KeptConversation))


def test_items_are_added_listed_and_deleted_and_their_bytes_counted():
    store = ResponseStore(max_bytes=1 << 20)
    assert store.create_conversation(_conversation("conv_a"), [_item("one")])
    assert store.num_bytes == _size(_conversation("conv_a")) + _size(_item("one"))
    assert store.add_items("conv_a", [_item("two"), _item("three", "assistant")]) is True
    assert _texts(store.get_conversation("conv_a").items) == ["one", "two", "three"] and _counted(store)
    assert store.update_conversation("conv_a", {"topic": "numbers"})["metadata"] == {"topic": "numbers"}
    assert _counted(store) and store.get_conversation("conv_a").conversation["metadata"] == {"topic": "numbers"}
    assert store.delete_item("conv_a", _item_id("two"))["id"] == "conv_a"
    assert _texts(store.get_conversation("conv_a").items) == ["one", "three"] and _counted(store)
    assert store.delete_item("conv_a", _item_id("two")) is False
    assert store.delete_item("conv_x", _item_id("one")) is None
    assert store.add_items("conv_x", [_item("x")]) is None and store.update_conversation("conv_x", {}) is None
    assert store.stats()["conversations"] == 1 and store.stats()["responses"] == 0
    assert store.delete_conversation("conv_a") and not store.delete_conversation("conv_a")
    assert store.num_bytes == 0 and store.stats()["conversations"] == 0


def test_an_endpoint_is_answered_its_page_or_object_alone():
    """What crosses from the actor is what GET shows: a page of items, one
    item, the object; not the whole conversation each call."""
    store = ResponseStore(max_bytes=1 << 20)
    store.create_conversation(_conversation("conv_a"), [_item(f"line {k}") for k in range(5)])
    newest = store.conversation_items("conv_a", 2, "desc", None)
    assert _texts(newest.items) == ["line 4", "line 3"] and newest.has_more
    rest = store.conversation_items("conv_a", 10, "desc", newest.items[-1]["id"])
    assert _texts(rest.items) == ["line 2", "line 1", "line 0"] and not rest.has_more
    assert _texts(store.conversation_items("conv_a", 2, "asc", _item_id("line 2")).items) == ["line 3", "line 4"]
    assert not store.conversation_items("conv_a", 2, "asc", "msg_none").after_found
    assert store.conversation_items("conv_x", 2, "asc", None) is None
    assert store.conversation_item("conv_a", _item_id("line 1")) == _item("line 1")
    assert store.conversation_item("conv_a", "msg_none") is False and store.conversation_item("conv_x", "m") is None
    assert store.conversation_object("conv_a") == _conversation("conv_a") and store.conversation_object("x") is None
    store.put(_response("resp_a", "completed", "hi", None), [_item("ask")])
    assert store.response("resp_a")["output"] == [_item("hi", "assistant")] and store.response("resp_x") is None
    assert _texts(store.input_items("resp_a", 20, "desc", None).items) == ["ask"]
    assert store.input_items("resp_x", 20, "desc", None) is None


def test_items_with_an_id_the_conversation_has_are_not_added():
    store = ResponseStore(max_bytes=1 << 20)
    store.create_conversation(_conversation("conv_a"), [_item("one")])
    assert store.add_items("conv_a", [_item("two"), _item("one")]) == _item_id("one")
    assert _texts(store.get_conversation("conv_a").items) == ["one"] and _counted(store)
    assert store.begin_turn("conv_a", "resp_a", 60.0).items
    assert store.end_turn("conv_a", "resp_a", [_item("one", "assistant")]) is False  # (its turn ends all the same)
    kept = store.get_conversation("conv_a")
    assert kept.turn_id is None and _texts(kept.items) == ["one"]


def test_a_growing_conversation_evicts_the_least_recently_used_but_never_itself():
    first = _conversation("conv_a"), [_item("a" * 100)]
    size = _size(first[0]) + _size(first[1][0])
    store = ResponseStore(max_bytes=3 * size)
    for name in ("conv_a", "conv_b", "conv_c"):
        assert store.create_conversation(_conversation(name), [_item(name[-1] * 100)])
    assert store.get_conversation("conv_a") is not None  # (used: conv_b is now the oldest)
    assert store.add_items("conv_c", [_item("c" * 20)]) is not False
    assert store.get_conversation("conv_b") is None and store.num_evicted == 1 and _counted(store)
    assert store.add_items("conv_c", [_item("c" * (3 * size))]) is False, "alone over the bound: nothing added"
    assert len(store.get_conversation("conv_c").items) == 2 and store.get_conversation("conv_a") is not None
    assert store.add_items("conv_c", [_item("d" * 300)]) is not False
    assert store.get_conversation("conv_a") is None, "the other goes, the one growing stays"
    assert list(store.entries) == ["conv_c"] and _counted(store)
    assert store.update_conversation("conv_c", {"k": "v" * store.max_bytes}) is False and _counted(store)


def test_ids_of_one_kind_are_not_found_as_the_other():
    store = ResponseStore(max_bytes=1 << 20)
    store.create_conversation(_conversation("conv_a"), [])
    store.put(_response("resp_a", "completed", "hi", None), [])
    assert store.get("conv_a") is None and not store.delete("conv_a") and store.cancel("conv_a") is None
    assert store.conversation("conv_a").missing_id == "conv_a"
    assert store.get_conversation("resp_a") is None and not store.delete_conversation("resp_a")
    assert store.begin_turn("resp_a", "resp_b", 60).missing_id == "resp_a"
    assert store.get_conversation("conv_a") is not None and store.get("resp_a") is not None


def test_a_turn_holds_off_a_second_response_until_it_ends_adding_only_what_finished():
    store = ResponseStore(max_bytes=1 << 20)
    store.create_conversation(_conversation("conv_a"), [_item("first")])
    assert _texts(store.begin_turn("conv_a", "resp_1", 60).items) == ["first"]
    assert store.begin_turn("conv_a", "resp_2", 60).running_id == "resp_1"
    assert store.end_turn("conv_a", "resp_2", [_item("not hers")]) and store.begin_turn(
        "conv_a", "resp_2", 60).running_id == "resp_1", "only its own response ends a turn"
    assert store.end_turn("conv_a", "resp_1", [_item("asked"), _item("answer", "assistant")])
    assert _texts(store.begin_turn("conv_a", "resp_3", 60).items) == ["first", "not hers", "asked", "answer"]
    assert store.end_turn("conv_a", "resp_3", None), "a response that did not finish adds nothing"
    assert len(store.begin_turn("conv_a", "resp_4", 60).items) == 4
    assert not store.end_turn("conv_gone", "resp_4", None)


def test_a_running_response_evicted_by_the_bound_ends_its_turn():
    """Other traffic pushed a running background response out: its replica's
    next beat found nothing and stopped, and its turn held the conversation until
    the lease ran out (360 s by default), as a delete does not."""
    store = ResponseStore(max_bytes=4000)
    store.create_conversation(_conversation("conv_a"), [])
    store.begin_turn("conv_a", "resp_bg", 360)
    store.put({"id": "resp_bg", "status": "queued", "store": True, "output": [], "conversation": {"id": "conv_a"},
               "background": True}, [_item("asked")])
    for k in range(20):  # other clients' responses; the conversation itself used meanwhile
        store.put({"id": f"resp_{k}", "status": "completed", "store": True, "output": [], "pad": "x" * 300}, [])
        store.get_conversation("conv_a")
    assert store.get("resp_bg") is None and store.beat("resp_bg") is None
    assert store.begin_turn("conv_a", "resp_next", 360).running_id is None


def test_keeping_a_response_ends_its_turn_whether_or_not_it_is_stored():
    """One call as a response ends: its items added (completed or cut), or none
    (failed); the response put only where it asked to be."""
    store = ResponseStore(max_bytes=1 << 20)
    store.create_conversation(_conversation("conv_a"), [])
    for name, status, stores in (("resp_1", "completed", False), ("resp_2", "failed", True),
                                 ("resp_3", "incomplete", True)):
        assert store.begin_turn("conv_a", name, 60).running_id is None
        response = {**_response(name, status, f"said {name}", "conv_a"), "store": stores}
        assert store.keep(response, [_item(f"asked {name}")]) is stores
        assert (store.get(name) is not None) is stores
    assert _texts(store.get_conversation("conv_a").items) == ["asked resp_1", "said resp_1", "asked resp_3",
                                                              "said resp_3"]
    assert store.get_conversation("conv_a").turn_id is None


def test_a_turn_nobody_ends_lapses_after_its_lease():
    clock = _Clock()
    store = ResponseStore(max_bytes=1 << 20, clock=clock)
    store.create_conversation(_conversation("conv_a"), [])
    store.begin_turn("conv_a", "resp_1", 30.0)
    clock.now_s = 29.0
    assert store.begin_turn("conv_a", "resp_2", 30.0).running_id == "resp_1"
    clock.now_s = 30.5
    assert store.begin_turn("conv_a", "resp_2", 30.0).running_id is None
    assert store.begin_turn("conv_a", "resp_3", 30.0).running_id == "resp_2"


def test_a_background_responses_turn_ends_as_it_does():
    """Finished: its input and output added; cancelled, deleted or lost (its
    replica stopped beating): nothing added, the conversation free at once."""
    clock = _Clock()
    store = ResponseStore(max_bytes=1 << 20, clock=clock)
    for name in ("done", "cancelled", "deleted", "lost"):
        store.create_conversation(_conversation(f"conv_{name}"), [])
        assert store.begin_turn(f"conv_{name}", f"resp_{name}", 600.0).items == []
        store.put(_response(f"resp_{name}", "queued", "", f"conv_{name}"), [_item(f"ask {name}")])
    assert store.finish(_response("resp_done", "completed", "answer", "conv_done"), [_item("ask done")])
    assert _texts(store.get_conversation("conv_done").items) == ["ask done", "answer"]
    assert store.cancel("resp_cancelled")["status"] == "cancelled"
    assert store.delete("resp_deleted")
    clock.now_s = LOST_AFTER_S - 1
    assert store.begin_turn("conv_lost", "resp_next", 600.0).running_id == "resp_lost"
    for name in ("cancelled", "deleted"):
        assert store.begin_turn(f"conv_{name}", "resp_next", 600.0).running_id is None, name
    assert not store.finish(_response("resp_cancelled", "completed", "late", "conv_cancelled"), [_item("x")])
    clock.now_s = LOST_AFTER_S + 1
    assert store.begin_turn("conv_lost", "resp_next", 600.0).running_id is None, "lost: free before its lease"
    assert store.get_conversation("conv_cancelled").items == [] and store.get_conversation("conv_lost").items == []


def test_with_the_store_off_conversations_are_refused_with_the_reason():
    conversations = StoredConversations(StoredResponses(pool=None, max_mib=0), request_timeout_s=300)  # (never asked)
    for call in (lambda: conversations.create(_conversation("conv_a"), []), lambda: conversations.get("conv_a"),
                 lambda: conversations.items("conv_a"), lambda: conversations.turn("conv_a", "resp_a")):
        with pytest.raises(ApiError) as raised:
            asyncio.run(call())
        assert raised.value.status == 400 and "stores no conversations" in str(raised.value)


def test_a_streamed_turn_dropped_unread_is_abandoned():
    """A client gone before its stream's body started: the response's events were
    an async generator never started, whose `finally` never ran, and the turn
    held the conversation until its lease (request_timeout_s, 300 s here)."""
    from cluster.stored_conversations import ConversationTurn

    class View:
        abandoned: list[str] = []

        def abandon_turn(self, conversation_id, response_id):
            self.abandoned.append(response_id)

    async def events():
        yield "event"

    async def scenario():
        view = View()
        unread = ConversationTurn(view, "conv_a", "resp_unread", []).over_with(events())
        del unread  # (dropped by the server, never iterated)
        await asyncio.sleep(0)  # (abandoned through the loop: a finalizer may run on any thread)
        read = ConversationTurn(view, "conv_a", "resp_read", []).over_with(events())
        assert [e async for e in read] == ["event"]  # ended before the store ended its turn: abandoned
        kept = ConversationTurn(view, "conv_a", "resp_kept", [])
        streamed = kept.over_with(events())
        assert await streamed.__anext__() == "event"
        kept.handed_on()  # (the store kept the response: its turn is the store's to end)
        del streamed
        closed = ConversationTurn(view, "conv_a", "resp_closed", []).over_with(events())
        await closed.aclose()
        return view.abandoned

    assert asyncio.run(scenario()) == ["resp_unread", "resp_read", "resp_closed"]


def test_a_turn_whose_caller_left_as_the_store_gave_it_is_let_go():
    """The store gave the turn, and the caller was cancelled (its client left)
    before the answer came back: nothing abandoned it, and the conversation
    answered conversation_locked for the turn's lease (request_timeout_s + 60 s)."""
    store = ResponseStore(max_bytes=1 << 20)
    assert store.create_conversation(_conversation("conv_a"), [])

    class Slowly:  # (an actor method: applied at once, answered later)
        def __init__(self, method, delay_s: float) -> None:
            self.method, self.delay_s = method, delay_s

        def remote(self, *args):
            async def answer():
                result = self.method(*args)
                await asyncio.sleep(self.delay_s)
                return result
            return answer()

    class Stored:
        enabled = True
        handle = type("Handle", (), {"begin_turn": Slowly(store.begin_turn, 10.0),
                                     "end_turn": Slowly(store.end_turn, 0.0)})()

        async def call(self, remote):
            return await remote(self.handle)

    async def scenario():
        conversations = StoredConversations(Stored(), request_timeout_s=300)
        taking = asyncio.ensure_future(conversations.turn("conv_a", "resp_left"))
        await asyncio.sleep(0.05)  # (the store gave it the turn; the answer is on its way)
        taking.cancel()
        await asyncio.gather(taking, return_exceptions=True)
        await asyncio.sleep(0.05)  # (the turn let go in a task of its own)

    asyncio.run(scenario())
    assert store.begin_turn("conv_a", "resp_next", 600.0).running_id is None
