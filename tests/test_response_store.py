"""The stored responses' bookkeeping (cluster/response_store.py), the actor's class
run in this process: conversations walked back through their ancestors, the byte
bound evicting least recently used first (a continued conversation is used, all
of it), what an id no longer stored answers; and a conversation too long for a
prompt losing its oldest turns (`truncation: "auto"`,
cluster/conversation_truncation.py). Over HTTP, with the actor:
tests/test_serve_responses.py."""

from __future__ import annotations

import asyncio
import json
import math
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.api_models import ApiError, ChatMessage
from cluster.background_responses import BackgroundResponses, EventFeed, stream_to_store
from cluster.conversation_truncation import drop_oldest_turns
from cluster.response_store import LOST_AFTER_S, ResponseStore
from cluster.stored_responses import StoredResponses


def _response(response_id: str, previous: str | None, text: str) -> dict:
    output = [{"type": "message", "id": f"msg_{response_id}", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    return {"id": response_id, "object": "response", "status": "completed", "previous_response_id": previous,
            "output": output, "store": True}


def _asked(text: str) -> list[dict]:
    return [{"type": "message", "id": f"in_{text}", "role": "user", "status": "completed",
             "content": [{"type": "input_text", "text": text}]}]


def _texts(items: list[dict]) -> list[str]:
    return [item["content"][0]["text"] for item in items]


def _size(response: dict, items: list[dict]) -> int:
    return len(json.dumps([response, items], separators=(",", ":")))


def test_a_conversation_is_its_ancestors_items_then_its_own():
    store = ResponseStore(max_bytes=1 << 20)
    store.put(_response("a", None, "A1"), _asked("q1"))
    store.put(_response("b", "a", "A2"), _asked("q2"))
    store.put(_response("c", "b", "A3"), _asked("q3"))
    store.put(_response("x", "a", "X2"), _asked("other"))  # (a branch: two responses continue "a")
    assert _texts(store.conversation("c").items) == ["q1", "A1", "q2", "A2", "q3", "A3"]
    assert _texts(store.conversation("x").items) == ["q1", "A1", "other", "X2"]
    assert _texts(store.conversation("a").items) == ["q1", "A1"]
    assert store.conversation("nope").missing_id == "nope"
    assert store.delete("b") and not store.delete("b")
    assert store.conversation("c").missing_id == "b", "the ancestor missing is named"
    assert _texts(store.conversation("x").items) == ["q1", "A1", "other", "X2"], "a branch without it still stands"


def test_the_bound_evicts_the_least_recently_used_and_a_continued_conversation_is_used_whole():
    entries = [(_response(name, previous, "answer " + name), _asked(name))
               for name, previous in (("a", None), ("b", "a"), ("p", None), ("q", "p"))]
    sizes = [_size(*entry) for entry in entries]
    store = ResponseStore(max_bytes=sum(sizes))
    for entry in entries:
        assert store.put(*entry)
    assert store.num_bytes == sum(sizes) and store.stats()["responses"] == 4
    assert _texts(store.conversation("b").items)[:1] == ["a"]  # a and b used: p and q are now the oldest
    new = (_response("r", None, "answer r"), _asked("r"))
    assert store.put(*new)
    assert store.get("p") is None, "the least recently used goes first"
    assert store.get("a") is not None and store.get("b") is not None
    assert store.num_bytes == sum(sizes) - sizes[2] + _size(*new) and store.num_evicted >= 1
    assert store.num_bytes <= store.max_bytes


def test_a_response_larger_than_the_bound_is_not_kept_and_evicts_nothing():
    store = ResponseStore(max_bytes=600)
    assert store.put(_response("a", None, "short"), _asked("q"))
    assert not store.put(_response("big", None, "x" * 1000), _asked("q"))
    assert store.get("big") is None and store.get("a") is not None and store.num_evicted == 0


def test_keeping_a_response_again_replaces_it():
    store = ResponseStore(max_bytes=1 << 20)
    store.put(_response("a", None, "one"), _asked("q"))
    store.put(_response("a", None, "two, longer"), _asked("q"))
    assert _texts(store.get("a").response["output"]) == ["two, longer"]
    assert store.num_bytes == _size(_response("a", None, "two, longer"), _asked("q"))


@pytest.mark.parametrize("call, status, message", [
    (lambda stored: stored.conversation("resp_1"), 400, "stores no responses"),
    (lambda stored: stored.get("resp_1"), 404, "not found"),
    (lambda stored: stored.delete("resp_1"), 404, "not found"),
])
def test_with_the_store_off_ids_are_answered_as_unknown(call, status, message):
    stored = StoredResponses(pool=None, max_mib=0)  # (off: the pool is never asked for a store)
    with pytest.raises(ApiError) as raised:
        asyncio.run(call(stored))
    assert raised.value.status == status and message in str(raised.value)
    kept = asyncio.run(stored.keep({"id": "resp_1", "store": False}, []))
    assert kept["store"] is False


def _chat(*turns: str) -> list[ChatMessage]:
    """Messages from role:text strings (`a` an assistant's, `t` a tool's answer to call c)."""
    roles = {"s": "system", "d": "developer", "u": "user", "a": "assistant", "t": "tool"}
    messages = []
    for spec in turns:
        role, text = spec.split(":", 1)
        message = {"role": roles[role], "content": text}
        if role == "t":
            message["tool_call_id"] = "c"
        messages.append(ChatMessage.model_validate(message))
    return messages


def _fits_within(limit: int, calls: list | None = None):
    def fits(messages) -> bool:
        if calls is not None:
            calls.append(len(messages))
        return sum(len(m.content) for m in messages) <= limit

    return fits


def test_truncation_keeps_a_conversation_that_fits_and_drops_the_fewest_oldest_turns():
    messages = _chat("s:sys", "u:aaaa", "a:bbbb", "u:cccc", "a:dddd", "t:eeee", "a:ffff", "u:gggg")
    assert drop_oldest_turns(messages, _fits_within(100)) is messages
    kept = drop_oldest_turns(messages, _fits_within(3 + 16))  # sys + the last two turns (cccc ... gggg) is 23
    assert [m.content for m in kept] == ["sys", "gggg"]
    kept = drop_oldest_turns(messages, _fits_within(3 + 20))
    assert [m.content for m in kept] == ["sys", "cccc", "dddd", "eeee", "ffff", "gggg"], "a call's output stays"
    kept = drop_oldest_turns(messages, _fits_within(1))
    assert [m.content for m in kept] == ["sys", "gggg"], "the last turn stays, for the prompt's check to refuse"


def test_truncation_keeps_the_instructions_given_with_a_kept_turn():
    """A request continuing a conversation with `[developer, user]` as its input:
    its developer message went with the turn before it, dropped, and the turn
    kept was answered without its instructions."""
    messages = _chat("s:sys", "u:aaaa", "a:bbbb", "u:cccc", "a:dddd", "d:in French", "u:eeee")
    kept = drop_oldest_turns(messages, _fits_within(3 + 9 + 4))
    assert [m.content for m in kept] == ["sys", "in French", "eeee"]
    kept = drop_oldest_turns(messages, _fits_within(1))
    assert [m.content for m in kept] == ["sys", "in French", "eeee"], "the last turn stays whole"


def test_truncation_keeps_no_calls_output_without_its_call():
    """The client spoke between a call and its output (user, the call, user, the
    output): cut at the second user message, the output was kept without the
    call that made it."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "aaaa"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "user", "content": "bbbb"}, {"role": "tool", "content": "cccc", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "dddd"}, {"role": "user", "content": "eeee"}]]
    kept = drop_oldest_turns(messages, _fits_within(16))  # from "bbbb" on would fit
    assert [m.content for m in kept] == ["eeee"]
    assert drop_oldest_turns(messages, _fits_within(20)) is messages
    # A client that reuses an id every turn (call_0): each output answers the latest call of its id
    # (matched to the first, every turn's output reached back to turn one, and no turn could go)
    turns = []
    for k in range(4):
        turns += [{"role": "user", "content": f"u{k}"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "content": f"t{k}", "tool_call_id": "call_1"},
                  {"role": "assistant", "content": f"a{k}"}]
    messages = [ChatMessage.model_validate(m) for m in turns]
    kept = drop_oldest_turns(messages, _fits_within(6))
    assert [m.content for m in kept] == ["u3", "", "t3", "a3"]


@given(st.lists(st.tuples(st.sampled_from("uatd"), st.integers(1, 30)), min_size=1, max_size=40),
       st.integers(0, 400), st.booleans())
@settings(max_examples=300, deadline=None)
def test_truncation_drops_exactly_the_turns_a_scan_would_in_few_tries(parts, limit, with_system):
    """Against the plain scan (drop one turn at a time, oldest first, until it
    fits; a turn from the developer messages right before its user message):
    the same messages, in at most log2(turns) + 2 renderings."""
    specs = (["s:" + "s" * 5] if with_system else []) + [f"{role}:" + "x" * size for role, size in parts]
    messages = _chat(*specs)
    calls: list = []
    kept = drop_oldest_turns(messages, _fits_within(limit, calls))
    fits = _fits_within(limit)
    num_head = next((k for k, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    head, rest = messages[:num_head], messages[num_head:]
    starts = [0]
    for k, m in enumerate(rest):
        if k > 0 and m.role == "user":
            instructed = [j for j in range(1, k) if all(r.role == "developer" for r in rest[j:k])]
            starts.append(min(instructed, default=k))
    expected = next((head + rest[k:] for k in starts if fits(head + rest[k:])), head + rest[starts[-1]:])
    assert kept == expected
    assert len(calls) <= math.log2(len(starts)) + 2


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_a_background_response_runs_beats_and_finishes_unless_cancelled_or_lost():
    clock = _Clock()
    store = ResponseStore(max_bytes=1 << 20, clock=clock)
    for name in ("done", "cancelled", "lost", "deleted"):
        store.put({**_response(name, None, ""), "status": "queued", "background": True}, _asked(name))
    assert store.conversation("done").running_id == "done", "a running response cannot be continued yet"
    clock.now_s = 10.0
    assert [store.beat(name) for name in ("done", "cancelled")] == ["in_progress", "in_progress"]
    assert store.finish({**_response("done", None, "answer"), "status": "completed"}, _asked("done"))
    assert _texts(store.conversation("done").items) == ["done", "answer"]
    assert store.cancel("cancelled")["status"] == "cancelled"
    assert store.beat("cancelled") == "cancelled", "its replica hears of it at its next beat"
    assert not store.finish({**_response("cancelled", None, "late"), "status": "completed"}, _asked("x"))
    assert store.get("cancelled").response["status"] == "cancelled" and store.cancel("cancelled") is not None
    assert store.delete("deleted")
    assert not store.finish({**_response("deleted", None, "late"), "status": "completed"}, _asked("x"))
    assert store.get("deleted") is None, "a deleted response stays deleted when its replica finishes it"
    assert store.get("lost").response["status"] == "queued"  # 10 s without a beat: not yet given up
    clock.now_s = 10.0 + LOST_AFTER_S + 0.1
    assert store.get("done").response["status"] == "completed", "a finished response is never lost"
    lost = store.get("lost").response
    assert lost["status"] == "failed" and "stopped" in lost["error"]["message"]
    assert store.beat("lost") == "failed", "a replica that comes back stops too"
    assert store.beat("nope") is None
    # Each status change counted in the bytes (they drifted: a failure's error is over a hundred)
    names = ("done", "cancelled", "lost")
    assert store.num_bytes == sum(_size(store.get(name).response, _asked(name)) for name in names)


def test_a_streamed_responses_events_are_kept_a_whole_prefix_and_finished_with_it():
    """Added as its replica writes them; the last ones with its final state in
    one call (a reader that sees it finished has them all); over the bound,
    those kept stay a prefix; a response not streamed keeps none."""
    store = ResponseStore(max_bytes=1 << 20)
    store.put({**_response("s", None, ""), "status": "queued", "background": True}, _asked("s"), streamed=True)
    store.put({**_response("plain", None, ""), "status": "queued", "background": True}, _asked("p"))
    assert store.add_events("s", ["e0", "e1"]) and not store.add_events("plain", ["e0"])
    assert store.events("plain", -1) is None and store.events("nope", -1) is None
    page = store.events("s", 0)
    assert page.events == ["e1"] and not page.is_over
    assert store.finish({**_response("s", None, "answer"), "status": "completed", "background": True}, _asked("s"),
                        ["e2", "e3"])
    page = store.events("s", -1)
    assert page.events == ["e0", "e1", "e2", "e3"] and page.is_over
    assert store.num_bytes == sum(entry.size for entry in store.entries.values())
    small = ResponseStore(max_bytes=_size(_response("t", None, ""), _asked("t")) + 400)
    small.put({**_response("t", None, ""), "status": "queued"}, _asked("t"), streamed=True)
    assert small.add_events("t", ["a" * 100]) and not small.add_events("t", ["b" * 500])
    assert not small.add_events("t", ["c"]), "none after one that did not fit: a whole prefix"
    assert small.events("t", -1).events == ["a" * 100]
    assert small.finish({**_response("t", None, "x"), "status": "completed"}, _asked("t"), ["d"])
    page = small.events("t", -1)  # (its cut carried over: the prefix kept went, and the last ones came after it)
    assert page.events == ["a" * 100] and page.is_over
    small.put({**_response("t", None, ""), "status": "queued"}, _asked("t"), streamed=True)
    assert small.add_events("t", ["a" * 100]) and not small.add_events("t", ["b" * 500])
    small.cancel("t")
    assert small.events("t", -1).is_over, "cancelled: no more will come"
    small.put({**_response("u", None, ""), "status": "queued"}, _asked("u"), streamed=True)
    assert small.add_events("u", ["a" * 100])
    assert small.finish({**_response("u", None, "done"), "status": "completed"}, _asked("u"), ["b" * 500])
    page = small.events("u", -1)
    assert page.events == ["a" * 100] and page.is_over, "last events too large: those before still kept"


def test_a_background_response_stopped_here_stops_at_once_not_at_its_next_beat():
    """`BackgroundResponses.stop` (a cancel or delete that lands on the replica
    serving the response): its answer is cancelled now, so its request's streams
    close and its workers stop; before, it ran on until the store said so at the
    next beat, up to BEAT_S later, its tokens streaming meanwhile."""
    class Store:
        beats = 0

        async def beat(self, response_id):
            Store.beats += 1
            return "in_progress"

    async def scenario():
        background, stopped = BackgroundResponses(Store()), asyncio.Event()

        async def answer():
            try:
                await asyncio.sleep(3600)
            finally:
                stopped.set()

        background.start("resp_1", answer())
        await asyncio.sleep(0.05)  # running, its first beat made
        assert background.stop("resp_1") and not background.stop("resp_other")
        await asyncio.wait_for(stopped.wait(), 5)  # (a hang guard: the beat, always in_progress, never stops it)
        await asyncio.sleep(0)
        return background.running, Store.beats

    running, beats = asyncio.run(scenario())
    assert running == {} and beats == 1  # stopped with no beat after the first


def test_a_streamed_background_response_stopped_before_its_events_closes_its_feed():
    """A cancel while it waited for admission or its first token stopped it
    before the code that closes its feed: the POST's stream stayed open for good."""
    class Store:
        async def beat(self, response_id):
            return "in_progress"

    async def scenario(wait_s: float | None):
        background, feed, began = BackgroundResponses(Store()), EventFeed(), []

        async def answer():  # (a streamed one's: its events, which close the feed, come after admission)
            began.append(True)
            await asyncio.sleep(3600)

        background.start("resp_1", answer(), on_end=feed.close)
        if wait_s is not None:
            await asyncio.sleep(wait_s)
        background.stop("resp_1")
        await asyncio.wait_for(_read_all(feed.read()), 5)  # (the POST's stream: it ends)
        return bool(began)

    assert asyncio.run(scenario(0.05))  # stopped while it waited
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (never awaited: closed, no warning)
        assert not asyncio.run(scenario(None))  # stopped before it began


def test_an_event_feed_gives_every_reader_every_event_from_the_first_until_closed():
    async def run():
        feed = EventFeed()
        early = asyncio.ensure_future(_read_all(feed.read()))
        for k in range(3):
            feed.add(f"e{k}")
            await asyncio.sleep(0)
        late = asyncio.ensure_future(_read_all(feed.read()))
        await asyncio.sleep(0)
        feed.add("e3")
        feed.close()
        return await early, await late

    assert asyncio.run(run()) == (["e0", "e1", "e2", "e3"],) * 2


async def _read_all(events) -> list:
    return [event async for event in events]


def test_a_streamed_background_response_reaches_its_feed_and_the_store_whole():
    """`stream_to_store` over the real store: every event to the feed, all kept
    in order with the final state, however the flushes fell."""
    store = ResponseStore(max_bytes=1 << 20)
    store.put({**_response("s", None, ""), "status": "queued", "background": True}, _asked("s"), streamed=True)

    class Replica:  # (the replica's view: the store's calls awaited, as over Ray)
        async def add_events(self, response_id, events, first):
            store.add_events(response_id, events, first=first)

    async def written():
        for k in range(50):
            yield f"e{k}"
            await asyncio.sleep(0.005)

    async def run():
        feed = EventFeed()
        reading = asyncio.ensure_future(_read_all(feed.read()))
        final = {**_response("s", None, "done"), "status": "completed", "background": True}

        async def finish(last, first):
            store.finish(final, _asked("s"), last, first)

        await stream_to_store(Replica(), "s", written(), feed, finish)
        return await reading

    expected = [f"e{k}" for k in range(50)]
    assert asyncio.run(run()) == expected
    assert store.events("s", -1).events == expected and store.get("s").response["status"] == "completed"


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_streams_last_event_reaches_its_post_only_once_the_store_kept_the_final_state(cancelled, monkeypatch):
    """A cancel that landed just before the final state was stored: the store
    kept "cancelled" (every GET said so) while the POST's stream had already
    sent `response.completed`, and a flush (each event flushes here) had put it
    in the store, where a replay sent it. Now that event waits for the store's
    word: both streams end without it, as a cancel ends one."""
    import cluster.background_responses

    monkeypatch.setattr(cluster.background_responses, "FLUSH_S", 0.0)
    store = ResponseStore(max_bytes=1 << 20)
    store.put({**_response("s", None, ""), "status": "queued", "background": True}, _asked("s"), streamed=True)
    completed = 'event: response.completed\ndata: {"type":"response.completed"}\n\n'

    class Replica:
        async def add_events(self, response_id, events, first):
            store.add_events(response_id, events, first=first)

    async def written():
        yield "e0"
        yield completed

    async def run():
        feed = EventFeed()
        reading = asyncio.ensure_future(_read_all(feed.read()))
        final = {**_response("s", None, "done"), "status": "completed", "background": True}

        async def finish(last, first):
            if cancelled:  # (it lands between the last event and the final state's store)
                store.cancel("s")
            return store.finish(final, _asked("s"), last, first)

        await stream_to_store(Replica(), "s", written(), feed, finish)
        return await reading

    sent = asyncio.run(run())
    assert store.get("s").response["status"] == ("cancelled" if cancelled else "completed")
    assert sent == store.events("s", -1).events == (["e0"] if cancelled else ["e0", completed])


def test_a_streamed_background_responses_events_reach_the_store_during_a_pause():
    """The events written before a pause (waiting for admission or the first
    token, a stall) went to the store only when the next one came: a replay from
    another replica missed them for as long, and they were lost with the replica."""
    store = ResponseStore(max_bytes=1 << 20)
    store.put({**_response("s", None, ""), "status": "queued", "background": True}, _asked("s"), streamed=True)
    go_on = asyncio.Event()

    class Replica:
        async def add_events(self, response_id, events, first):
            store.add_events(response_id, events, first=first)

    async def written():
        for k in range(3):
            yield f"e{k}"
        await go_on.wait()  # (the pause)
        yield "e3"

    async def run():
        feed = EventFeed()
        final = {**_response("s", None, "done"), "status": "completed", "background": True}

        async def finish(last, first):
            store.finish(final, _asked("s"), last, first)

        streaming = asyncio.ensure_future(stream_to_store(Replica(), "s", written(), feed, finish))
        for _ in range(100):  # (FLUSH_S is 0.1 s: up to 5 s here)
            if len(store.events("s", -1).events) == 3:
                break
            await asyncio.sleep(0.05)
        paused = store.events("s", -1).events
        go_on.set()
        await streaming
        return paused

    assert asyncio.run(run()) == ["e0", "e1", "e2"]
    assert store.events("s", -1).events == ["e0", "e1", "e2", "e3"] and store.get("s").response["status"] == "completed"


def test_a_batch_of_events_sent_again_is_kept_once_and_one_lost_cuts_the_stream():
    """A flush stopped mid-call (a cancel) may have reached the store, and its
    events were sent again: stored twice, a replay repeated sequence numbers.
    Each batch says where it starts; a batch after a lost one keeps nothing."""
    store = ResponseStore(max_bytes=1 << 20)
    store.put({**_response("s", None, ""), "status": "queued", "background": True}, _asked("s"), streamed=True)
    assert store.add_events("s", ["e0", "e1"], first=0)
    assert store.add_events("s", ["e1", "e2", "e3"], first=1)  # (e1 again, and those after it)
    assert store.events("s", -1).events == ["e0", "e1", "e2", "e3"]
    final = {**_response("s", None, "done"), "status": "completed", "background": True}
    assert store.finish(final, _asked("s"), ["e3", "e4"], first=3)
    assert store.events("s", -1).events == ["e0", "e1", "e2", "e3", "e4"]
    store.put({**_response("g", None, ""), "status": "queued", "background": True}, _asked("g"), streamed=True)
    assert store.add_events("g", ["e0"], first=0) and not store.add_events("g", ["e5"], first=5)
    assert store.events("g", -1).events == ["e0"]


def test_a_finished_stream_keeps_the_longest_prefix_of_its_events_that_fits():
    """Its events put back in one call with the final state, and over the bound
    together, none were kept: a resumed stream got nothing, no completion."""
    events = [f"event {k:03d} " + "x" * 60 for k in range(40)]
    final = {**_response("s", None, "y" * 600), "status": "completed", "background": True}
    bound = _size(final, _asked("s")) + sum(map(len, events[:25]))
    store = ResponseStore(max_bytes=bound)
    store.put({**_response("s", None, ""), "status": "queued", "background": True}, _asked("s"), streamed=True)
    store.add_events("s", events[:30], first=0)  # (fits beside the small queued state)
    assert store.finish(final, _asked("s"), events[30:], first=30)
    kept = store.events("s", -1).events
    assert 0 < len(kept) < 30 and kept == events[: len(kept)]


def test_an_evicted_running_response_leaves_the_growing_entry_the_most_recent():
    """Evicting a running response ended its turn through the conversation's
    reader, which made that conversation the most recent: the entry growing was
    evicted under itself (the client's items lost), its bytes counted on, and
    later puts failed (a StopIteration: 500s)."""
    def item(name: str, length: int) -> dict:
        return {"type": "message", "id": name, "role": "user", "status": "completed",
                "content": [{"type": "input_text", "text": "x" * length}]}

    store = ResponseStore(max_bytes=3000)
    conversation = {"object": "conversation", "created_at": 0, "metadata": {}}
    assert store.create_conversation({**conversation, "id": "conv_b"}, [item("b0", 600)])
    store.begin_turn("conv_b", "resp_r", 100)
    assert store.put({**_response("resp_r", None, ""), "status": "queued", "background": True,
                      "conversation": {"id": "conv_b"}}, [item("r0", 10)])
    store.conversation_items("conv_b", 20, "desc", None)  # (read: more recent than resp_r)
    assert store.create_conversation({**conversation, "id": "conv_a"}, [item("a0", 300)])
    assert store.add_items("conv_a", [item("a1", 1900)]) is True
    assert store.get_conversation("conv_a") is not None
    assert store.num_bytes == sum(entry.size for entry in store.entries.values())


def test_a_finished_response_too_large_to_store_fails_rather_than_runs_on():
    """It stayed in progress, and read as its replica's death once the beats stopped."""
    store = ResponseStore(max_bytes=2000)
    assert store.put({**_response("big", None, ""), "status": "queued", "background": True}, _asked("big"))
    final = {**_response("big", None, "z" * 5000), "status": "completed", "background": True}
    assert not store.finish(final, _asked("big"))
    response = store.get("big").response
    assert response["status"] == "failed" and "larger than this server stores" in response["error"]["message"]


def test_a_response_too_large_to_store_on_a_conversation_fails_and_adds_nothing_to_it():
    """Its turn's items went into the conversation first, and the conversation,
    grown, evicted the running response itself: a 404 instead of failed, the
    conversation holding a turn reported as not kept, and the failure's bytes
    counted for an entry gone."""
    store = ResponseStore(max_bytes=2000)
    assert store.create_conversation({"id": "conv_1", "object": "conversation", "created_at": 0, "metadata": {}},
                                     [])
    assert store.begin_turn("conv_1", "resp_a", 600).running_id is None
    asked = [{"type": "message", "id": "msg_in", "role": "user", "status": "completed",
              "content": [{"type": "input_text", "text": "hello"}]}]
    queued = {**_response("resp_a", None, ""), "status": "queued", "background": True, "instructions": "I" * 900,
              "conversation": {"id": "conv_1"}}
    assert store.put(queued, asked)
    assert not store.finish({**_response("resp_a", None, "O" * 1000), "status": "completed", "background": True,
                             "instructions": "I" * 900, "conversation": {"id": "conv_1"}}, asked)
    assert store.response("resp_a")["status"] == "failed"
    assert store.get_conversation("conv_1").items == []
    assert store.num_bytes == sum(entry.size for entry in store.entries.values())
