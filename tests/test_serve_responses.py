"""OpenAI's Responses API (`POST /v1/responses`) over real HTTP, through the OpenAI
client: each request answers what the chat request it stands for answers (the
conversation's items as messages, its tools, its text format), as a response
whole or as the Responses events; bad requests are 400s with a JSON message; a stored response is continued by
`previous_response_id` as the whole conversation would be, found, listed and
deleted. (The translation: cluster/responses_body.py, cluster/responses_format.py;
the store: cluster/response_store.py.)"""

from __future__ import annotations

import json
import os
import time

import httpx
import openai
import pytest
import ray

from tests.conftest import served_app, wait_idle

ARGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "mode": "colocated",
    "colocated": {"replicas": 1, "num_cpus": 1},
    "engine": {"block_size": 16, "num_kv_blocks": 256},
    "limits": {"max_prompt_tokens": 600, "max_new_tokens": 2000},
    "pool_name": "test-pool-responses",
    "scheduler_replicas": 2,  # (stored responses: any replica continues any response)
}
MODEL = "tandem-tiny-qwen2"
CITY = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 8}},
        "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": CITY}


@pytest.fixture(scope="module")
def base_url(serve_port):
    yield from served_app("responses", ARGS, serve_port)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_a_conversation_answers_as_its_chat_request_does(client):
    """Instructions, messages, an earlier call and its output: the same prompt,
    so the same greedy answer, as the chat request of those messages; the usage
    in the Responses names; a cut answer is incomplete."""
    items = [{"role": "user", "content": "What is the weather in Oslo?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
             {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}]
    messages = [{"role": "system", "content": "Be brief."}, items[0],
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
                {"role": "user", "content": "And tomorrow?"}]
    answer = client.responses.create(model=MODEL, instructions="Be brief.", input=items, max_output_tokens=12,
                                     temperature=0, tools=[WEATHER], tool_choice="none")
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                          tools=[{"type": "function", "function": {
                                              k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="none")
    assert answer.object == "response" and answer.id.startswith("resp_") and answer.store is True
    assert answer.output_text == chat.choices[0].message.content
    assert [item.type for item in answer.output] == ["message"]
    assert answer.usage.input_tokens == chat.usage.prompt_tokens and answer.usage.output_tokens == 12
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.instructions == "Be brief." and answer.max_output_tokens == 12
    assert [(tool.name, tool.strict) for tool in answer.tools] == [("get_weather", True)]


def test_function_tools_are_strict_unless_they_say_not(client):
    """A required call: a function_call item, its arguments of the schema (strict
    by default in this API), the call id a chat call's; a named one the same."""
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        for seed in range(3):
            answer = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                                             tool_choice=choice, temperature=1.0, max_output_tokens=150,
                                             parallel_tool_calls=False, extra_body={"seed": seed})
            calls = [item for item in answer.output if item.type == "function_call"]
            assert answer.status == "completed" and calls, answer.output
            for call in calls:
                assert call.name == "get_weather" and call.call_id.startswith("call_")
                arguments = json.loads(call.arguments)
                assert set(arguments) == {"city"} and len(arguments["city"]) <= 8, arguments


def test_a_text_format_holds_the_answer(client):
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer", "minimum": 0,
                                                                       "maximum": 9}}, "additionalProperties": False}
    answer = client.responses.create(model=MODEL, input="Pick a digit.", temperature=1.0, max_output_tokens=40,
                                     text={"format": {"type": "json_schema", "name": "digit", "schema": schema,
                                                      "strict": True}}, extra_body={"seed": 3})
    assert 0 <= json.loads(answer.output_text)["n"] <= 9
    assert answer.text.format.type == "json_schema"


def _events(client, **request) -> list:
    with client.responses.stream(**request) as stream:
        return list(stream)


def test_the_stream_is_the_responses_events_and_ends_with_the_whole_response(client):
    """Created, in progress, the message item and its part, text deltas, their
    dones, completed: numbered in order, the deltas adding up to the text of the
    final response, which is what the request unstreamed gets (greedy)."""
    request = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 16, "temperature": 0}
    events = _events(client, **request)
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"], kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    whole = client.responses.create(**request)
    assert text == final.output_text == whole.output_text and final.usage.output_tokens == 16
    assert final.output[0].id == events[2].item.id


def test_a_streamed_call_comes_as_a_function_call_item(client):
    events = _events(client, model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required",
                     temperature=0, max_output_tokens=150, parallel_tool_calls=False)
    added = [event.item for event in events if event.type == "response.output_item.added"]
    assert added and all(item.type == "function_call" for item in added)
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    final = events[-1]
    assert final.type == "response.completed"
    calls = [item for item in final.response.output if item.type == "function_call"]
    assert [call.arguments for call in calls] == [event.arguments for event in done]
    assert all(set(json.loads(call.arguments)) == {"city"} for call in calls)


def test_logprobs_of_the_output_text(client):
    answer = client.responses.create(model=MODEL, input="Hi", max_output_tokens=5, temperature=0, top_logprobs=2,
                                     include=["message.output_text.logprobs"])
    part = answer.output[0].content[0]
    assert len(part.logprobs) == 5 and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text


@pytest.mark.parametrize("body, message", [
    ({"input": "x", "previous_response_id": "resp_1"}, "Previous response with id 'resp_1' not found."),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "reads text only"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item type 'item_reference'"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.call_id"),
    ({"input": "x", "truncation": "middle"}, "truncation"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice must be"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "response_format type 'xml'"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}}]}, "multipleOf"),
    ({"input": "x", "model": "gpt-4o"}, "not found"),
    ({"input": ""}, "input"),
    ({"input": "x", "include": ["message.output_text.logprob"]}, "'message.output_text.logprobs'"),
])
def test_requests_it_cannot_serve_are_refused(base_url, body, message):
    response = httpx.post(f"{base_url}/v1/responses", json=body)
    assert 400 <= response.status_code < 500 and message in response.json()["error"]["message"], response.text


def test_a_stream_its_client_leaves_ends_its_request(base_url):
    """The worker's blocks all come back, nothing left running."""
    for _ in range(3):
        with httpx.stream("POST", f"{base_url}/v1/responses", json={
                "input": "keep going", "max_output_tokens": 200, "stream": True}) as response:
            for index, _ in enumerate(response.iter_lines()):
                if index >= 12:
                    break
    pool = ray.get_actor(ARGS["pool_name"], namespace="tandem")
    for member in ray.get(pool.list_members.remote()):
        wait_idle(member.handle)


def test_a_calls_output_items_go_back_as_the_next_turns_input(client):
    """What an agent loop sends: the first answer's items as the client got them,
    then the call's output; the next answer is text (tool_choice "none"), and
    its message goes back too."""
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=150)
    call = next(item for item in first.output if item.type == "function_call")
    items = [{"role": "user", "content": "Weather in Oslo?"}, *(item.model_dump() for item in first.output),
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    second = client.responses.create(model=MODEL, input=items, tools=[WEATHER], tool_choice="none", temperature=0,
                                     max_output_tokens=8)
    assert [item.type for item in second.output] == ["message"] and second.output_text
    items += [*(item.model_dump() for item in second.output), {"role": "user", "content": "Thanks."}]
    third = client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=4)
    assert third.output_text and third.usage.input_tokens > second.usage.input_tokens


def test_a_continued_response_answers_as_the_whole_conversation_would(client):
    """The second turn by previous_response_id: the same prompt (so the same
    greedy answer and input tokens) as the first turn's items sent back whole,
    without the first turn's instructions (OpenAI's rule); a third turn goes back
    through both, the second's prompt from the prefix cache."""
    first = client.responses.create(model=MODEL, instructions="Answer in one word.", input="Name a colour.",
                                    temperature=0, max_output_tokens=6)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="And a fruit?",
                                     temperature=0, max_output_tokens=6)
    items = [{"role": "user", "content": "Name a colour."}, *(item.model_dump() for item in first.output),
             {"role": "user", "content": "And a fruit?"}]
    twin = client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=6, store=False)
    assert second.previous_response_id == first.id and second.store is True and twin.store is False
    assert second.output_text == twin.output_text and second.usage.input_tokens == twin.usage.input_tokens
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="And a tree?",
                                    temperature=0, max_output_tokens=6)
    assert third.usage.input_tokens_details.cached_tokens >= 32, third.usage
    items += [*(item.model_dump() for item in second.output), {"role": "user", "content": "And a tree?"}]
    assert third.output_text == client.responses.create(model=MODEL, input=items, temperature=0,
                                                        max_output_tokens=6, store=False).output_text


def test_a_streamed_response_is_stored_as_its_last_event_says(client):
    first = client.responses.create(model=MODEL, input="Count to three.", temperature=0, max_output_tokens=8)
    events = _events(client, model=MODEL, previous_response_id=first.id, input="Again.", temperature=0,
                     max_output_tokens=8)
    final = events[-1].response
    assert events[0].response.store is True and final.previous_response_id == first.id
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    unstreamed = client.responses.create(model=MODEL, previous_response_id=first.id, input="Again.",
                                         temperature=0, max_output_tokens=8)
    assert unstreamed.output_text == final.output_text


def test_abort_request_by_a_responses_id_ends_it_incomplete_and_stored_so(base_url, client):
    """SGLang's /abort_request names a Responses API response by its id, on
    either replica: the stream ends `response.incomplete`, reason "abort", with
    what it had written, and the stored response says the same."""
    body = {"model": MODEL, "input": "keep going", "max_output_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.Client(base_url=base_url, timeout=60) as http:
        with http.stream("POST", "/v1/responses", json=body) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    if events[-1]["type"] == "response.output_text.delta" and len(events) == 6:
                        aborted = http.post("/abort_request", json={"rid": events[0]["response"]["id"]})
    assert aborted.status_code == 200 and aborted.json() == {"aborted": 1}, aborted.text
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and final["incomplete_details"] == {"reason": "abort"}
    assert 1 <= final["usage"]["output_tokens"] < 1500 and final["output"][-1]["status"] == "incomplete"
    assert client.responses.retrieve(final["id"]).model_dump()["incomplete_details"] == {"reason": "abort"}
    pool = ray.get_actor(ARGS["pool_name"], namespace="tandem")
    for member in ray.get(pool.list_members.remote()):
        wait_idle(member.handle)


def test_a_stored_response_is_found_its_input_listed_and_deleted(client, base_url):
    items = [{"role": "user", "content": f"line {k}"} for k in range(5)]
    answer = client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=3)
    assert client.responses.retrieve(answer.id).model_dump() == answer.model_dump()
    listed = client.responses.input_items.list(answer.id)  # (newest first, as OpenAI lists them)
    assert [item.content[0].text for item in listed.data] == [f"line {k}" for k in reversed(range(5))]
    assert all(item.id.startswith("msg_") for item in listed.data) and not listed.has_more
    page = client.responses.input_items.list(answer.id, order="asc", limit=2)
    rest = client.responses.input_items.list(answer.id, order="asc", limit=2, after=page.last_id)
    assert [i.content[0].text for i in page.data + rest.data] == ["line 0", "line 1", "line 2", "line 3"]
    assert page.has_more and rest.has_more
    every = [item.id for item in client.responses.input_items.list(answer.id, order="asc")]  # (the pager's walk)
    assert len(every) == 5 and every[:2] == [item.id for item in page.data]
    deleted = httpx.delete(f"{base_url}/v1/responses/{answer.id}")
    assert deleted.status_code == 200 and deleted.json() == {"id": answer.id, "object": "response", "deleted": True}
    for response in (httpx.get(f"{base_url}/v1/responses/{answer.id}"),
                     httpx.get(f"{base_url}/v1/responses/{answer.id}/input_items"),
                     httpx.delete(f"{base_url}/v1/responses/{answer.id}")):
        assert response.status_code == 404 and "not found" in response.json()["error"]["message"], response.text
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, previous_response_id=answer.id, input="more")
    assert refused.value.code == "previous_response_not_found" and refused.value.param == "previous_response_id"


def test_what_is_not_stored_cannot_be_continued_and_a_gap_is_named(client, base_url):
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert httpx.get(f"{base_url}/v1/responses/{unstored.id}").status_code == 404
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="Hi again",
                                     max_output_tokens=2)
    client.responses.delete(first.id)
    response = httpx.post(f"{base_url}/v1/responses", json={"previous_response_id": second.id, "input": "x"})
    assert response.status_code == 400 and first.id in response.json()["error"]["message"], response.text
    for query, message in (("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order"),
                           ("after=msg_none", "after"), ("limit=x", "limit"),
                           ("before=msg_x", "before is not supported")):  # (was dropped: the first page again)
        response = httpx.get(f"{base_url}/v1/responses/{second.id}/input_items?{query}")
        assert response.status_code == 400 and message in response.json()["error"]["message"], (query,
                                                                                                 response.text)


def test_a_store_that_dies_comes_back_empty_and_keeps_storing(client):
    """Ray restarts the store actor: what it held is gone (answered as unknown
    ids), and the responses after it are kept again."""
    before = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    pool = ray.get_actor(ARGS["pool_name"], namespace="tandem")
    store = ray.get(pool.response_store.remote())
    pid = lambda: ray.get(store.__ray_call__.remote(lambda _: os.getpid()), timeout=60)  # noqa: E731
    crashed = pid()
    ray.kill(store, no_restart=False)
    deadline = time.monotonic() + 60
    while pid() == crashed:  # the old process answers for a few ms after the kill (calls are retried meanwhile)
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, previous_response_id=before.id, input="more", max_output_tokens=2)
    assert refused.value.code == "previous_response_not_found"
    after = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert after.store is True and client.responses.retrieve(after.id).id == after.id


def test_truncation_auto_drops_a_long_conversations_oldest_turns(client, base_url):
    """A stored conversation grown past the prompt limit (600 tokens here):
    refused as it is, served with truncation "auto" as its newest turns sent
    whole would be (the fewest oldest turns dropped, greedy: the same answer)."""
    words = "river stone market lantern orchard copper signal harbour meadow ledger".split()
    asked = [" ".join(words[(turn + k) % len(words)] for k in range(60)) + "?" for turn in range(6)]
    previous, items = None, []
    for text in asked[:-1]:
        answer = client.responses.create(model=MODEL, input=text, previous_response_id=previous, temperature=0,
                                         max_output_tokens=8, truncation="auto")
        assert answer.truncation == "auto" and answer.usage.input_tokens <= 600
        previous = answer.id
        items += [{"role": "user", "content": text}, *(item.model_dump() for item in answer.output)]
    refused = httpx.post(f"{base_url}/v1/responses", json={"input": asked[-1], "previous_response_id": previous,
                                                           "max_output_tokens": 8})
    assert refused.status_code == 400 and "the limit is 600" in refused.json()["error"]["message"], refused.text
    last = client.responses.create(model=MODEL, input=asked[-1], previous_response_id=previous, temperature=0,
                                   max_output_tokens=8, truncation="auto")
    items.append({"role": "user", "content": asked[-1]})
    starts = [k for k, item in enumerate(items) if item.get("role") == "user"]
    for start in starts:  # the twin: the fewest oldest turns dropped by hand
        twin = httpx.post(f"{base_url}/v1/responses", json={"input": items[start:], "store": False,
                                                            "temperature": 0, "max_output_tokens": 8})
        if twin.status_code == 200:
            break
    assert start > 0, "the whole conversation fitted: no truncation was needed"
    assert twin.json()["usage"]["input_tokens"] == last.usage.input_tokens <= 600
    assert twin.json()["output"][0]["content"][0]["text"] == last.output_text


def test_an_agent_loop_by_previous_response_id_sends_only_the_calls_output(client):
    """The Agents SDK's way with a stored response: the next turn is the call's
    output alone, answered as the whole conversation sent back would be."""
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=150)
    call = next(item for item in first.output if item.type == "function_call")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input=[output], tools=[WEATHER],
                                     tool_choice="none", temperature=0, max_output_tokens=8)
    whole = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Weather in Oslo?"},
                                                        *(item.model_dump() for item in first.output), output],
                                    tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=8,
                                    store=False)
    assert second.output_text == whole.output_text and second.usage.input_tokens == whole.usage.input_tokens
    listed = client.responses.input_items.list(second.id)
    assert [(item.type, item.call_id) for item in listed.data] == [("function_call_output", call.call_id)]


def _finished(client, response_id: str, within_s: float = 60.0):
    deadline = time.monotonic() + within_s
    while (answer := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"still {answer.status}"
        time.sleep(0.2)
    return answer


def test_a_background_response_is_queued_then_polled_to_the_answer_it_would_have_given(client):
    request = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 40, "temperature": 0}
    queued = client.responses.create(**request, background=True)
    assert queued.status == "queued" and queued.background is True and not queued.output
    answer = _finished(client, queued.id)
    assert answer.status == "incomplete" and answer.usage.output_tokens == 40 and answer.background is True
    assert answer.output_text == client.responses.create(**request).output_text
    later = client.responses.create(model=MODEL, previous_response_id=queued.id, input="more", max_output_tokens=2)
    assert later.previous_response_id == queued.id


def test_a_cancelled_background_response_stops_on_its_worker(client, base_url):
    """Cancelled from whichever replica, the request stops at its replica's next
    beat (a second at most), long before its 2000 tokens (some 8 s here)."""
    queued = client.responses.create(model=MODEL, input="keep going", temperature=0, max_output_tokens=2000,
                                     background=True)  # (greedy: 2000 tokens without an EOS, so it runs till cancelled)
    with pytest.raises(openai.BadRequestError, match="still in progress"):
        client.responses.create(model=MODEL, previous_response_id=queued.id, input="more")
    pool = ray.get_actor(ARGS["pool_name"], namespace="tandem")
    [worker] = [member.handle for member in ray.get(pool.list_members.remote())]
    deadline = time.monotonic() + 10
    while ray.get(worker.check_accounting.remote()).num_running == 0:  # (admitted after the POST answered)
        assert time.monotonic() < deadline, "the background request never reached the worker"
        time.sleep(0.05)
    assert client.responses.retrieve(queued.id).status == "in_progress"
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and client.responses.cancel(queued.id).status == "cancelled"
    wait_idle(worker, within_s=4.0)
    answer = client.responses.retrieve(queued.id)
    assert answer.status == "cancelled" and not answer.output
    done = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    for path, status in ((f"/v1/responses/{done.id}/cancel", 400), ("/v1/responses/resp_none/cancel", 404)):
        response = httpx.post(f"{base_url}{path}")
        assert response.status_code == status, response.text
    streamed = httpx.get(f"{base_url}/v1/responses/{done.id}?stream=true")
    assert streamed.status_code == 400 and "not kept" in streamed.json()["error"]["message"], streamed.text
    for body, message in (({"store": False}, "leave store true"),):
        response = httpx.post(f"{base_url}/v1/responses", json={"input": "x", "background": True, **body})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def _dumped(events) -> list[dict]:
    return [event.model_dump() for event in events]


def test_a_streamed_background_response_is_replayed_from_any_replica_and_resumed(client):
    """Its POST streams the events the unstreamed response is the last of; any
    replica replays them all (`stream=true`), or those after a sequence number."""
    request = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 40, "temperature": 0}
    events = list(client.responses.create(**request, background=True, stream=True))
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.background and final.status == "incomplete"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [(e.type, e.response.status) for e in events[:3]] == [  # (queued as its POST answers: OpenAI's opening)
        ("response.created", "queued"), ("response.queued", "queued"), ("response.in_progress", "in_progress")]
    assert final.output_text == client.responses.create(**request).output_text
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    for _ in range(2):  # (two scheduler replicas)
        assert _dumped(client.responses.retrieve(final.id, stream=True)) == _dumped(events)
    assert _dumped(client.responses.retrieve(final.id, stream=True, starting_after=5)) == _dumped(events[6:])


def test_a_broken_background_stream_resumes_while_it_runs_and_a_cancelled_one_ends(client, base_url):
    """Left after ten events, the response runs on, and a replay after the tenth
    goes on from there as it runs, to its last event; cancelled, a replay ends
    without one."""
    request = {"model": MODEL, "input": "keep going", "max_output_tokens": 300, "temperature": 0,
               "background": True, "stream": True}
    with client.responses.create(**request) as stream:
        first = [event for _, event in zip(range(10), stream)]
    response_id = first[0].response.id
    assert client.responses.retrieve(response_id).status == "in_progress", "the POST's client left; it runs on"
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=9))
    assert [event.sequence_number for event in first + rest] == list(range(len(first) + len(rest)))
    assert rest[-1].type == "response.incomplete" and rest[-1].response.usage.output_tokens == 300
    with client.responses.create(**{**request, "max_output_tokens": 2000}) as stream:
        response_id = next(iter(stream)).response.id
    assert client.responses.cancel(response_id).status == "cancelled"
    pool = ray.get_actor(ARGS["pool_name"], namespace="tandem")
    for member in ray.get(pool.list_members.remote()):
        wait_idle(member.handle, within_s=4.0)  # (stopped at its replica's next beat, its last events stored)
    replayed = list(client.responses.retrieve(response_id, stream=True))
    assert replayed[0].type == "response.created" and all(
        event.type not in ("response.completed", "response.incomplete") for event in replayed)
    for path, status in ((f"/v1/responses/{response_id}?stream=true&starting_after=-2", 400),
                         ("/v1/responses/resp_none?stream=true", 404)):
        assert httpx.get(f"{base_url}{path}").status_code == status, path
