"""The Responses API's translation, without a server: a request's items as the chat
messages they stand for (cluster/responses_body.py), hostile items refused with
an ApiError and nothing else, and a chat stream's chunks as the Responses events,
ending with the response an unstreamed request gets (cluster/responses_format.py).
Over HTTP: tests/test_serve_responses.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cluster.api_models import ApiError
from cluster.conversations_body import NewConversation, checked_items
from cluster.responses_body import ResponsesBody
from cluster.responses_format import ResponseEvents, whole


def _messages(body: dict) -> list[dict]:
    chat = ResponsesBody.model_validate(body).chat_body()
    return [m.model_dump(exclude_none=True, exclude={"tool_calls"}) | (
        {"calls": [c.function.name for c in m.tool_calls]} if m.tool_calls else {}) for m in chat.messages]


def test_stored_items_each_have_a_status_as_openais_types_need():
    """A message sent as parts, a function call and its output are stored with
    status `completed` (a message sent as a string had one; the others none);
    a status the client gave is kept."""
    items = checked_items([
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "user", "content": "as a string"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}", "status": "incomplete"}])
    assert [item["status"] for item in items] == ["completed"] * 4 + ["incomplete"]
    assert all(isinstance(item["id"], str) for item in items)


def test_items_become_the_chat_messages():
    """Instructions first; an assistant's text and the calls after it one turn
    (as chat's assistant message carries its calls), parallel calls together;
    call outputs as tool messages; reasoning left out."""
    call = lambda i: {"type": "function_call", "call_id": f"c{i}", "name": f"f{i}", "arguments": "{}"}  # noqa: E731
    body = {"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        call(1), call(2),
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        call(3),
    ]}
    assert _messages(body) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Let me look.", "calls": ["f1", "f2"]},
        {"role": "tool", "content": "one", "tool_call_id": "c1"}, {"role": "tool", "content": "two", "tool_call_id": "c2"},
        {"role": "assistant", "calls": ["f3"]}]
    assert _messages({"input": "Hello"}) == [{"role": "user", "content": "Hello"}]


def test_text_after_a_turns_calls_is_that_turns():
    """A streamed answer with text after its call stores message, call, message;
    sent back, the turn is one assistant message (its texts joined, as the
    unstreamed answer's content) with the call, its output right after it."""
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    said = lambda text: {"type": "message", "role": "assistant",  # noqa: E731
                         "content": [{"type": "output_text", "text": text}]}
    output = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    turn = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Let me check.\n\nDone.", "calls": ["f"]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert _messages({"input": [{"role": "user", "content": "Hi"}, said("Let me check."), call,
                                said("\n\nDone."), output]}) == turn
    assert _messages({"input": [{"role": "user", "content": "Hi"}, call, said("Let me check.\n\nDone."),
                                output]}) == turn
    # two assistant messages with no call between them stay two; text after a call's output is a new turn
    assert [m["role"] for m in _messages({"input": [said("a"), said("b"), call, output, said("c")]})] == [
        "assistant", "assistant", "tool", "assistant"]


def test_tools_and_formats_in_chat_spelling():
    body = ResponsesBody.model_validate({
        "input": "x", "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "g", "strict": False}],
        "tool_choice": {"type": "function", "name": "g"}, "max_output_tokens": 7, "reasoning": {"effort": "low"},
        "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}, "strict": True}}})
    chat = body.chat_body()
    assert [(t.function.name, t.function.strict) for t in chat.tools] == [("f", True), ("g", False)]
    assert chat.tool_choice == {"type": "function", "function": {"name": "g"}} and chat.max_completion_tokens == 7
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"},
                                                                           "strict": True}}
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}


def test_metadata_and_reasoning_effort_are_held_to_openais_bounds():
    """Metadata of at most 16 pairs, keys of 64 characters, values of 512 (as a
    conversation's), and a reasoning effort OpenAI names (each was taken as given)."""
    ok = {"input": "x", "metadata": {"k" * 64: "v" * 512}, "reasoning": {"effort": "minimal"}}
    assert ResponsesBody.model_validate(ok).metadata == ok["metadata"]
    for bad, said in (({"metadata": {str(i): "v" for i in range(17)}}, "at most 16 pairs, not 17"),
                      ({"metadata": {"k" * 65: "v"}}, "keys of at most 64 characters"),
                      ({"metadata": {"k": "v" * 513}}, "values of at most 512"),
                      ({"reasoning": {"effort": "bogus"}}, "effort must be one of none, minimal, low")):
        with pytest.raises(ValidationError, match=said):
            ResponsesBody.model_validate({"input": "x", **bad})


VALUES = st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2),
                   st.dictionaries(st.sampled_from(["type", "text"]), st.text(max_size=5), max_size=2))
PARTS = st.lists(st.one_of(VALUES, st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal", None]), "text": VALUES})),
    max_size=3)
ITEMS = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference", 7]),
    "role": st.one_of(st.sampled_from(["user", "assistant", "system", "developer", "tool"]), VALUES),
    "content": st.one_of(VALUES, PARTS), "output": st.one_of(VALUES, PARTS),
    "call_id": VALUES, "name": st.one_of(st.sampled_from(["f", "bad name!"]), VALUES), "arguments": VALUES})
BODIES = st.fixed_dictionaries({"input": st.one_of(st.text(max_size=5), st.lists(ITEMS, max_size=4))}, optional={
    "instructions": VALUES, "tools": st.lists(st.dictionaries(st.sampled_from(["type", "name", "parameters", "strict"]),
                                                              st.one_of(VALUES, st.just("function")), max_size=4),
                                              max_size=2),
    "tool_choice": st.one_of(VALUES, st.sampled_from(["auto", "required", "none"])), "text": st.one_of(VALUES, st.fixed_dictionaries(
        {"format": st.one_of(VALUES, st.fixed_dictionaries({"type": st.sampled_from(["text", "json_schema", "x"])}))})),
    "reasoning": VALUES, "include": VALUES, "top_logprobs": VALUES, "max_output_tokens": VALUES,
    "truncation": st.one_of(VALUES, st.sampled_from(["auto", "disabled"])), "background": VALUES, "store": VALUES,
    "stream": VALUES, "max_tool_calls": VALUES, "previous_response_id": VALUES,
    "conversation": st.one_of(VALUES, st.fixed_dictionaries({"id": VALUES}))})


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES)
def test_hostile_requests_are_refused_with_a_message_and_nothing_else(body):
    """... and what is served can be stored: its input as items, each with an id."""
    try:
        served = ResponsesBody.model_validate(body)
        served.chat_body()
    except (ApiError, ValidationError) as exc:
        assert str(exc)
        return
    items = served.input_items()
    assert len(items) == (1 if isinstance(served.input, str) else len(served.input))
    assert all(isinstance(item["id"], str) and isinstance(item["type"], str) for item in items)
    json.dumps(items)


@pytest.mark.parametrize("body", [{"previous_response_id": ""}, {"conversation": ""}, {"conversation": {"id": ""}}])
def test_an_empty_id_is_refused(body):
    """It was served as if left out, and echoed in the response as given."""
    with pytest.raises(ValidationError):
        ResponsesBody.model_validate({"input": "x", **body})


METADATA = st.one_of(VALUES, st.dictionaries(st.text(max_size=70), VALUES))


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=st.fixed_dictionaries({}, optional={"items": st.one_of(VALUES, st.lists(ITEMS, max_size=4)),
                                                "metadata": METADATA}))
def test_hostile_conversation_items_are_refused_with_a_message_and_nothing_else(body):
    """A new conversation's body (cluster/conversations_body.py): refused with a
    message, or its items kept as a response's input is, each with an id."""
    try:
        items = checked_items(NewConversation.model_validate(body).items)
    except (ApiError, ValidationError) as exc:
        assert str(exc)
        return
    assert len(items) == len(body.get("items") or ())
    assert all(isinstance(item["id"], str) and isinstance(item["type"], str) for item in items)
    json.dumps(items)


def _stream(body: ResponsesBody, chunks: list) -> list[dict]:
    async def chunks_of():
        for chunk in chunks:
            yield chunk

    return _events(ResponseEvents(body, "m").stream(chunks_of()))


def _events(stream) -> list[dict]:
    async def run():
        return [event async for event in stream]

    lines = asyncio.run(run())
    events = []
    for line in lines:
        kind, data = line.removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    return events


def _chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choices,
            **({"usage": usage} if usage else {})}


USAGE = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0},
         "completion_tokens_details": {"reasoning_tokens": 2}}


@pytest.mark.parametrize("finish, incomplete", [("tool_calls", None), ("length", "max_output_tokens"),
                                                (None, "abort")])  # (None: ended by /abort_request)
def test_a_chat_stream_becomes_the_responses_events(finish, incomplete):
    """Reasoning, text, then two calls (one's arguments in two deltas): each an
    item opened, written and closed in turn; the last event's response is the
    one `whole` makes of the same answer unstreamed, ids aside; one cut by its
    limit or aborted is incomplete, and says which."""
    body = ResponsesBody.model_validate({"input": "x", "stream": True})
    events = _stream(body, [
        _chunk({"role": "assistant", "content": ""}), _chunk({"reasoning_content": "hm"}),
        _chunk({"reasoning_content": "m"}), _chunk({"content": "Sure."}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                "function": {"name": "f", "arguments": '{"a": '}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                "function": {"name": "g", "arguments": "{}"}}]}, finish),
        _chunk(usage=USAGE), "[DONE]"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"].removeprefix("response.") for e in events]
    assert kinds == ["created", "in_progress",
                     "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.delta",
                     "reasoning_text.done", "content_part.done", "output_item.done",
                     "output_item.added", "content_part.added", "output_text.delta",
                     "output_text.done", "content_part.done", "output_item.done",
                     "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
                     "function_call_arguments.done", "output_item.done",
                     "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
                     "output_item.done", "incomplete" if incomplete else "completed"]
    streamed = events[-1]["response"]
    unstreamed = whole(body, {"model": "m", "created": 1, "usage": USAGE, "choices": [{
        "index": 0, "finish_reason": finish, "logprobs": None,
        "message": {"role": "assistant", "content": "Sure.", "reasoning_content": "hmm", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}}]})

    def without_ids(response: dict) -> dict:
        return {**response, "id": None, "created_at": None,
                "output": [{k: v for k, v in item.items() if k != "id"} for item in response["output"]]}
    assert without_ids(streamed) == without_ids(unstreamed)
    assert streamed["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    assert [item["status"] for item in streamed["output"]] == (
        ["completed"] * 3 + ["incomplete"] if incomplete else ["completed"] * 4)
    assert streamed["incomplete_details"] == ({"reason": incomplete} if incomplete else None)


def test_a_response_refused_as_it_starts_is_created_then_failed():
    """A background stream refused at admission sent its failure alone, at
    sequence 0: the OpenAI SDK's stream helper raised ("Expected to have received
    response.created before response.failed")."""
    body = ResponsesBody.model_validate({"input": "x", "stream": True, "background": True})
    events = _events(ResponseEvents(body, "m").refused({"code": "slo_rejected", "message": "busy"}))
    assert [(e["type"], e["sequence_number"]) for e in events] == [("response.created", 0), ("response.failed", 1)]
    assert events[1]["response"]["error"] == {"code": "slo_rejected", "message": "busy"}
    waited = ResponseEvents(body, "m")  # (as a background stream is: queued first, then refused)
    opening = [json.loads(e.split("data: ", 1)[1]) for e in waited.queued_events()]
    events = opening + _events(waited.refused({"code": "slo_rejected", "message": "busy"}))
    assert [(e["type"], e["response"]["status"]) for e in events] == [
        ("response.created", "queued"), ("response.queued", "queued"), ("response.failed", "failed")]
    assert [e["sequence_number"] for e in events] == [0, 1, 2]


def test_a_failure_mid_stream_ends_it_failed():
    events = _stream(ResponsesBody.model_validate({"input": "x", "stream": True}), [
        _chunk({"content": "Hel"}), {"error": {"message": "worker died", "type": "worker_error"}}])
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["error"]["message"] == "worker died"
    assert events[-2]["type"] == "response.output_item.done" and events[-2]["item"]["status"] == "incomplete"
