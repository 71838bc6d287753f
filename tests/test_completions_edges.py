"""The OpenAI endpoints' answers at their edges, from a real GlobalScheduler
(known cost models: tests/scheduler_setup.py) whose workers' events are
scripted (what the workers send is tested against real ones in
tests/test_serve_app.py): a batch's usage, answers nested past Python's limit,
and bodies a plain JSON decoder reads but JSON does not allow. Each case
failed before a review found it."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from actors.messages import TokenEvent
from actors.sampling_params import SamplingParams
from actors.tokenization import load_tokenizer
from cluster import strict_json
from cluster.api_models import ChatBody, CompletionBody, template_messages
from cluster.completions import Completions
from cluster.tool_calls import TOOL_CALL_FORMATS
from tests.scheduler_setup import make_scheduler


def _completions(tiny_qwen2_dir, texts: list[str], num_cached: int = 0, reason: str = "stop") -> Completions:
    """Completions whose every request answers `texts`, one token each, having
    found `num_cached` of its prompt's tokens cached, and ends for `reason`."""
    scheduler = make_scheduler(ttft_ms=10_000)

    async def events(request, choice, inflight):
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            yield TokenEvent(request.request_id, [5 + i], text, None, last, reason if last else None, time.time(),
                             num_cached)

    scheduler._events = events
    return Completions(scheduler, load_tokenizer(tiny_qwen2_dir), "tiny", TOOL_CALL_FORMATS["hermes"])


async def _sse(response) -> list[str]:
    text = "".join([piece if isinstance(piece, str) else piece.decode() async for piece in response.body_iterator])
    return [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]


PROMPTS = [list(range(100, 140)), list(range(200, 240))]


@pytest.mark.parametrize("stream", [False, True])
def test_a_batchs_usage_counts_the_cached_tokens_of_every_prompt(tiny_qwen2_dir, stream):
    """`prompt_tokens` summed every prompt, `cached_tokens` only the first's."""
    completions = _completions(tiny_qwen2_dir, ["a", "b"], num_cached=16)
    body = CompletionBody.model_validate({"prompt": PROMPTS, "max_tokens": 2, "n": 2, "stream": stream,
                                          "stream_options": {"include_usage": True} if stream else None})

    async def run():
        answer = await completions.answer(body, body.prompts(), SamplingParams(max_new_tokens=2), PROMPTS,
                                          chat=False)
        return json.loads((await _sse(answer))[-2])["usage"] if stream else answer["usage"]

    usage = asyncio.run(run())
    assert usage["prompt_tokens"] == 80 and usage["prompt_tokens_details"]["cached_tokens"] == 32


def test_every_chunk_and_body_says_when_the_request_came(tiny_qwen2_dir, monkeypatch):
    """Each chunk read the clock: a stream that crossed a second changed
    `created` (OpenAI: "each chunk has the same timestamp"), and a body was
    stamped when its answer ended (a review's probe, a clock a second a call)."""
    import itertools

    import cluster.openai_format as fmt

    clock = itertools.count(1_700_000_000)
    monkeypatch.setattr(fmt.time, "time", lambda: next(clock))
    completions = _completions(tiny_qwen2_dir, ["a", "b", "c"])
    body = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "stream": True,
                                    "stream_options": {"include_usage": True}})

    async def run():
        answer = await completions.answer(body, ["p"], SamplingParams(max_new_tokens=3), [[1, 2]], chat=True)
        return [json.loads(line) for line in await _sse(answer) if line != "[DONE]"]

    chunks = asyncio.run(run())
    assert len(chunks) >= 4 and {chunk["created"] for chunk in chunks} == {1_700_000_000}


DEEP_CALL = "<tool_call>" + "[" * 1500 + "]" * 1500 + "</tool_call>"  # (a client can force it: guided_regex)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_nested_past_pythons_limit_is_text_not_a_failure(tiny_qwen2_dir, stream):
    """The call parser's json.loads raised RecursionError, which it did not
    catch: unstreamed, a 500; streamed, the stream cut with no error and no [DONE]."""
    completions = _completions(tiny_qwen2_dir, [DEEP_CALL[:700], DEEP_CALL[700:]])
    assert asyncio.run(_tool_chat_content(completions, stream)) == DEEP_CALL


@pytest.mark.parametrize("stream", [False, True])
def test_text_held_back_when_an_answer_is_aborted_is_sent(tiny_qwen2_dir, stream):
    """An answer aborted by its client (`/abort_request`) ends with an event of
    no text: streamed, the chunk of what the tool-call writer held back (a tag's
    start) was not sent, as OpenAI has no finish reason "abort" to send it with;
    unstreamed, the same text is the answer."""
    completions = _completions(tiny_qwen2_dir, ["Checking. ", "<tool_c", ""], reason="abort")
    assert asyncio.run(_tool_chat_content(completions, stream)) == "Checking. <tool_c"


async def _tool_chat_content(completions: Completions, stream: bool) -> str:
    """The content of a chat answer with tools: the message's, or the stream's
    deltas joined (the stream ending with [DONE])."""
    body = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                    "stream": stream})
    answer = await completions.answer(body, ["p"], SamplingParams(max_new_tokens=8), [[1, 2]], chat=True)
    if not stream:
        return answer["choices"][0]["message"]["content"]
    payloads = await _sse(answer)
    assert payloads[-1] == "[DONE]"
    return "".join(json.loads(p)["choices"][0]["delta"].get("content") or "" for p in payloads[:-1])


def test_a_past_calls_arguments_nested_past_pythons_limit_are_kept_as_written():
    """They were parsed for the chat template with json.loads, whose RecursionError
    made the request a 500."""
    deep = "[" * 50000
    body = ChatBody.model_validate({"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]})
    (call,) = template_messages(body.messages)[1]["tool_calls"]
    assert call["function"]["arguments"] == deep


@pytest.mark.parametrize("arguments", ["", "  ", None])
def test_a_past_call_without_arguments_reaches_the_template_as_an_empty_object(arguments):
    """Found by a review: "" was written into the prompt as `"arguments": }`, and
    null was a 400 (vLLM reads both as {})."""
    body = ChatBody.model_validate({"messages": [
        {"role": "user", "content": "what time is it?"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "get_time", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c", "content": "12:00"}]})
    (call,) = template_messages(body.messages)[1]["tool_calls"]
    assert call["function"]["arguments"] == {}


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_an_assistants_reasoning_sent_back_reaches_the_template(field):
    """Found by a review: it was dropped (Qwen3's template writes it back as a
    <think> block in a tool loop; vLLM passes it on)."""
    body = ChatBody.model_validate({"messages": [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, field: "I should call get_weather.",
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "12C"}]})
    messages = template_messages(body.messages)
    assert messages[1]["reasoning_content"] == "I should call get_weather."
    assert "reasoning_content" not in messages[0] and "reasoning_content" not in messages[2]


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(constant):
    """Python's decoder reads them; a free-form field (a Responses request's
    `reasoning`) carried one into the response, which could then not be written
    as JSON: a 500 after the answer was generated and stored."""
    with pytest.raises(json.JSONDecodeError, match=f"{constant} is not a JSON number"):
        strict_json.loads(f'{{"input": "x", "reasoning": {{"summary": {constant}}}}}'.encode())
    assert strict_json.loads(b'{"input": "NaN"}') == {"input": "NaN"}


def test_a_developer_message_is_a_system_one_for_a_template_without_that_role(tiny_qwen2_dir):
    """Qwen2.5's and Qwen3's templates have no `developer` role: such a message
    was dropped, answered 200 with its instructions unread. It is rendered as a
    `system` one there (as vLLM's Responses path maps it); a template that names
    the role gets it as it is."""
    from cluster.api_models import knows_developer_role

    tokenizer = load_tokenizer(tiny_qwen2_dir)
    body = ChatBody.model_validate({"messages": [{"role": "developer", "content": "Answer in French."},
                                                 {"role": "user", "content": "hi"}]})
    assert not knows_developer_role(tokenizer.chat_template)
    messages = template_messages(body.messages, developer_as_system=True)
    assert [m["role"] for m in messages] == ["system", "user"]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nAnswer in French.<|im_end|>")
    assert knows_developer_role({"default": "{% if m.role == 'developer' %}{% endif %}"})
    assert [m["role"] for m in template_messages(body.messages)] == ["developer", "user"]


def test_an_error_body_always_has_param_as_openai_sends_it():
    """OpenAI's and vLLM's error bodies always have `param`, null where no field
    is to blame; it was there only where one was (a review's find)."""
    from cluster.api_models import ApiError

    assert ApiError(400, "bad").body() == {"error": {"message": "bad", "type": "invalid_request_error",
                                                     "param": None, "code": 400}}
    assert ApiError(400, "bad", param="top_p").body()["error"]["param"] == "top_p"


def test_a_worker_error_mid_stream_is_an_error_body_with_param(tiny_qwen2_dir):
    """The streamed error bodies were written by hand, without `param`."""
    scheduler = make_scheduler(ttft_ms=10_000)

    async def failing(request, choice, inflight):
        yield TokenEvent(request.request_id, [5], "a", None, False, None, time.time())
        yield TokenEvent(request.request_id, [], "", None, True, "error", time.time(), error="the actor died")

    scheduler._events = failing
    completions = Completions(scheduler, load_tokenizer(tiny_qwen2_dir), "tiny", TOOL_CALL_FORMATS["hermes"])
    body = CompletionBody.model_validate({"prompt": "x", "max_tokens": 4, "stream": True})

    async def run():
        answer = await completions.answer(body, body.prompts(), SamplingParams(max_new_tokens=4), [[1, 2]], chat=False)
        return [json.loads(line) for line in await _sse(answer) if line != "[DONE]"]

    (error,) = [chunk["error"] for chunk in asyncio.run(run()) if "error" in chunk]
    assert error == {"message": "the actor died", "type": "worker_error", "param": None, "code": 500}


def test_a_body_field_refused_is_named_as_param():
    """OpenAI names the field to blame in `param`; a body's pydantic errors said
    it only in the message (`param` null). JSON that does not parse blames none."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from cluster.ingress_guard import install_guard

    app = FastAPI()
    install_guard(app)

    @app.post("/chat")
    async def chat(body: ChatBody):
        return {}

    client = TestClient(app)
    answer = client.post("/chat", json={"messages": [{"role": "user", "content": "x"}], "n": 0})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "n"
    assert answer.json()["error"]["message"] == "n: Input should be greater than or equal to 1"
    broken = client.post("/chat", content=b"{", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["param"] is None


def test_a_content_length_of_other_digits_is_refused_not_a_500():
    """'²' is a digit to str.isdigit and no number to int: the guard's 500. (An
    HTTP server's parser refuses such a header first; the guard does too.)"""
    from fastapi import FastAPI

    from cluster.config import AppSettings
    from cluster.ingress_guard import install_guard

    app = FastAPI()
    install_guard(app)
    app.state.settings = AppSettings.model_validate({"model": {"preset": "tiny"}})  # (the guard reads its limits)
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/chat", "raw_path": b"/chat", "root_path": "", "query_string": b"", "server": ("x", 80),
             "client": ("y", 1),
             "headers": [(b"content-type", b"application/json"), (b"content-length", "²".encode("latin-1"))]}
    asyncio.run(app(scope, receive, send))
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [413]


def test_stop_reason_is_vllms():
    """The stop string, or the request's own stop token, that ended a choice for
    "stop"; None for the model's end token, and for any other end."""
    from cluster.openai_format import stop_reason

    assert stop_reason("stop", "\n\n", ()) == "\n\n" and stop_reason("stop", 7, (7, 9)) == 7
    assert stop_reason("stop", 151645, (7,)) is None and stop_reason("length", "x", ()) is None
    assert stop_reason("stop", None, ()) is None
    assert stop_reason("stop", 128009, (7, 128009), eos_token_ids=(128009,)) is None  # (EOS first, as vLLM's)
