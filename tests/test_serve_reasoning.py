"""A served model's own answer formats over real HTTP: the tiny qwen3_moe (Qwen3's
mixture of experts, served by a worker actor) with `reasoning_parser: think` (the <think> block as `reasoning_content`, whole and
streamed, the answer as `content`, its tokens in the usage, a prefilled open block, Qwen3's
`enable_thinking` through `chat_template_kwargs`) and, as a Llama 3 checkpoint
would be served, `tool_call_parser: llama3_json`, the two at once to see that
they compose (the parsers themselves: tests/test_reasoning.py,
tests/test_llama_calls.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import served_app

ARGS = {
    "model": {"preset": "tiny", "arch": "qwen3_moe"},
    "mode": "colocated",
    "colocated": {"replicas": 1, "num_cpus": 1},
    "engine": {"block_size": 16, "num_kv_blocks": 256},
    "limits": {"max_prompt_tokens": 600, "max_new_tokens": 200},
    "reasoning_parser": "think",
    "tool_call_parser": "llama3_json",
    "pool_name": "test-pool-reasoning",
}
MODEL = "tandem-tiny-qwen3_moe"
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def base_url(serve_port):
    yield from served_app("reasoning", ARGS, serve_port)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_the_reasoning_comes_apart_from_the_answer_whole_and_streamed(client):
    """A random model does not reason by itself: a pattern that writes the block
    (kept as written, since it begins with it) makes it."""
    pattern = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){0,3}\n</think>\n\n[A-Z][a-z]{1,8}\."
    ask = {"model": MODEL, "messages": ASK, "max_tokens": 150, "temperature": 1.0, "seed": 5,
           "extra_body": {"guided_regex": pattern}}
    response = client.chat.completions.create(**ask)
    whole = response.choices[0]
    thought, answer = whole.message.reasoning_content, whole.message.content
    assert whole.finish_reason == "stop" and thought and answer.endswith(".") and "<think>" not in thought
    # Its reasoning tokens: the block's, tags included; the answer's are the rest.
    reasoning_tokens = response.usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < response.usage.completion_tokens
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    chunks = chunks[:-1]  # (the usage chunk has no choices)
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought  # seeded: the same
    assert "".join(d.content or "" for d in deltas) == answer
    first_answer = next(i for i, d in enumerate(deltas) if d.content)  # (it may close the reasoning too)
    assert not any(getattr(d, "reasoning_content", None) for d in deltas[first_answer + 1:])


def test_a_json_answer_may_reason_first(client):
    """response_format holds the answer after the reasoning: the answer starts
    with a block or with the JSON. A random model that opens the block rambles on
    in it until max_tokens (nothing makes it close); one that does not answers the
    JSON as its content."""
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer", "minimum": 0,
                                                                       "maximum": 9}}}
    answered = []
    for seed in range(6):
        choice = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=40, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}).choices[0]
        if choice.message.reasoning_content is None:
            answered.append(json.loads(choice.message.content)["n"])
        else:
            assert choice.finish_reason == "length" and not choice.message.content
    assert answered and all(0 <= n <= 9 for n in answered), answered


def test_an_answer_the_prompt_opened_reasons_from_its_first_token(client, base_url):
    """The assistant's turn prefilled with `<think>` (continue_final_message): the
    answer is reasoning until `</think>`, here all of it (a random model does not
    close the block); the same tokens as a completion of the same prompt."""
    messages = [*ASK, {"role": "assistant", "content": "<think>\n"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=9,
                                          extra_body={"add_generation_prompt": False,
                                                      "continue_final_message": True})
    prompt = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": messages,
                                                      "add_generation_prompt": False,
                                                      "continue_final_message": True}).json()["tokens"]
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=9
                                     ).choices[0].text
    message = chat.choices[0].message
    assert message.content is None and message.reasoning_content == text.strip() and chat.usage.completion_tokens == 12


def test_enable_thinking_false_closes_an_empty_block_in_the_prompt(base_url, client):
    asked = {"model": MODEL, "messages": ASK}
    plain = httpx.post(f"{base_url}/tokenize", json=asked).json()["tokens"]
    closed = httpx.post(f"{base_url}/tokenize", json={**asked, "chat_template_kwargs": {"enable_thinking": False}})
    tail = httpx.post(f"{base_url}/detokenize", json={"tokens": closed.json()["tokens"][len(plain):]}).json()
    assert tail["prompt"] == "<think>\n\n</think>\n\n"
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, seed=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.reasoning_content is None and out.choices[0].message.content
    refused = httpx.post(f"{base_url}/v1/chat/completions", json={**asked, "chat_template_kwargs": {"tools": []}})
    assert refused.status_code == 400 and "tools cannot be set here" in refused.json()["error"]["message"]


def test_a_call_in_llamas_format_after_the_reasoning(client):
    """The answer after the reasoning is a call as Llama 3 writes one (held by a
    pattern, the random model's own choice being text)."""
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["CET", "UTC"]}}}}}
    pattern = r'<think>\n[a-z]{2,8}\n</think>\n\n\{"name": "get_time", "parameters": \{"zone": "(CET|UTC)"\}\}'
    ask = {"model": MODEL, "messages": ASK, "tools": [clock], "max_tokens": 150, "temperature": 1.0, "seed": 3,
           "extra_body": {"guided_regex": pattern}}
    whole = client.chat.completions.create(**ask).choices[0]
    [call] = whole.message.tool_calls
    assert whole.finish_reason == "tool_calls" and whole.message.content is None and whole.message.reasoning_content
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("CET", "UTC")
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert [(d.function.name, d.function.arguments) for d in streamed] == [(call.function.name,
                                                                            call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_responses_answer_puts_its_reasoning_in_a_reasoning_item(client):
    """OpenAI's Responses API (cluster/responses_format.py): the reasoning the chat
    answer of the same request has comes first, as a reasoning item, whole and
    streamed (its reasoning_text deltas), and the answer after it."""
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer", "minimum": 0,
                                                                       "maximum": 9}}}
    reasoned = 0
    for seed in range(6):
        chat = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=40, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}).choices[0]
        request = dict(model=MODEL, input=ASK, max_output_tokens=40, temperature=1.0, extra_body={"seed": seed},
                       text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
        answer = client.responses.create(**request)
        thought = chat.message.reasoning_content
        if thought is None:
            assert [item.type for item in answer.output] == ["message"] and answer.output_text == chat.message.content
            continue
        reasoned += 1
        assert [item.type for item in answer.output] == ["reasoning", "message"] and answer.output_text == ""
        assert answer.output[0].content[0].text == thought and answer.status == "incomplete"
        assert 0 < answer.usage.output_tokens_details.reasoning_tokens <= answer.usage.output_tokens
        with client.responses.stream(**request) as stream:
            events = list(stream)
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
        assert events[-1].response.output[0].content[0].text == thought
    assert reasoned, "no seed reasoned"
