"""Bad input over real HTTP: every refusal is a 4xx with a JSON message that says
what to change, malformed and oversized bodies included, and the server goes on
serving. A colocated deployment (what is refused is refused before any worker);
the disaggregated app's own checks, and the schema fuzzing, are in
tests/test_serve_app.py."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import shutil
import tempfile
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import served_app

PROFILE_DIR = Path(tempfile.gettempdir()) / f"tandem-test-profiles-{os.getpid()}"
PROFILE_CALL_S = 60  # a worker's first trace starts torch's profiler (seconds on a loaded machine)
ARGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "mode": "colocated",
    "profile_dir": str(PROFILE_DIR),
    "colocated": {"replicas": 1, "num_cpus": 1},
    "engine": {"block_size": 16, "num_kv_blocks": 256, "max_model_len": 700},  # a prompt (600) can fill it
    "limits": {"max_prompt_tokens": 600, "max_new_tokens": 200, "max_stop_sequences": 2, "max_body_bytes": 100_000},
    "pool_name": "test-pool-bad-input",
}


@pytest.fixture(scope="module")
def base_url(serve_port):
    yield from served_app("bad-input", ARGS, serve_port)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/generate", {"text": "", "max_new_tokens": 4}, "prompt is empty"),
        ("/generate", {"max_new_tokens": 4}, "exactly one of"),
        ("/generate", {"text": "x", "max_new_tokens": -1}, "max_new_tokens"),  # (0: the prompt alone)
        ("/generate", {"text": "x", "temperature": -1}, "temperature"),
        ("/generate", {"text": "x", "sampling_params": {"seed": -2**63 - 1}}, "seed"),
        ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed"),
        ("/generate", {"text": "x", "top_p": 0}, "top_p"),
        ("/generate", {"text": "x" * 2000}, "limit is 600"),
        ("/generate", {"input_ids": [99999999]}, "token ids"),
        ("/generate", {"text": "x", "max_new_tokens": 5000}, "up to 5000 new tokens; the limit is 200"),
        ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c"]}, "stop sequences"),
        ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
        ("/v1/completions", {"prompt": ["x"] * 33, "n": 2}, "more than 64 requests"),
        ("/v1/completions", {"prompt": ["x", ""]}, "prompt is empty"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/generate", {"text": "x", "sampling_params": {"max_tokens": 4}}, "sampling_params.max_tokens: unknown field"),
        ("/generate", {"text": "x", "sampling_params": {"stream_interval": 4}}, "stream_interval is not supported"),
        ("/generate", {"text": "x", "sampling_params": {"n": 17}}, "sampling_params.n"),
        ("/generate", {"text": ["x", "y"], "sampling_params": [{}]}, "a list needs a batch of as many prompts"),
        ("/generate", {"text": "x", "rid": ["a"]}, "a list needs a batch of as many prompts (this is one prompt)"),
        ("/generate", {"text": ["x", "y"], "rid": "r"}, "rid must be a list"),
        ("/generate", {"text": []}, "the batch of prompts is empty"),
        ("/generate", {"text": ["x", "y"], "sampling_params": [{"n": 2}, {}]}, "the same n"),
        ("/generate", {"input_ids": [[1], [2]] * 17, "sampling_params": {"n": 2}}, "more than 64 requests"),
        ("/generate", {"text": ["x", ""]}, "prompt is empty"),
        ("/generate", {"input_ids": [[1, 2], 3]}, "input_ids.1: Input should be a valid list"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens 0 needs echo"),
        ("/generate", {"text": "x", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
        ("/generate", {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2},  # (it was answered [])
         "logprob_start_len (2) must be less than the prompt's 2 tokens"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
         "content part type 'image_url' is not supported"),
        ("/v1/completions", {"prompt": {"nested": 1}}, "prompt"),
        ("/generate", {"text": 42}, "text"),
        ("/generate", {"text": "x", "max_new_tokens": "many"}, "max_new_tokens"),
        ("/generate", {"text": "x", "max_new_tokens": -3}, "max_new_tokens"),
        ("/generate", {"text": "x", "stream": "sometimes"}, "stream"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}, "limit"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": -2.5},
         "presence_penalty"),
        ("/generate", {"text": "x", "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 300}}, "logit_bias values"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "outside the vocabulary"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_new_tokens"),
        ("/v1/completions", {"prompt": "x", "suffix": "!"}, "suffix is not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "response_format": {"type": "xml"}}, "response_format type 'xml'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"schema": {"type": "integer", "multipleOf": 2}}}}, "uses multipleOf"),
        ("/v1/completions", {"prompt": "x", "guided_regex": r"(a)\1"}, "backreferences are not supported"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]}, "give one way"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a+", "bad_words": ["no"]}, "cannot be combined"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= x"}}, "grammar not supported"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": "yes"}},
         "choice must be a non-empty list"),  # (a string was its letters)
        ("/generate", {"text": "x", "sampling_params": {"regex": "a("}}, "regex is not valid"),
        ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= x"}}, "ebnf is not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"},
                                  "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice must be"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": "f"}}] * 2}, "f named twice"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"function": 3}]}]}, "messages.1.tool_calls.0.function"),  # (was a 500)
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "not of type 'array'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_regex": "a+",
            "tool_choice": "required", "tools": [{"type": "function", "function": {
                "name": "f", "strict": True}}]}, "not guided_regex and tool_choice"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [  # held: auto, strict
            {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
                "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}}}]}, "multipleOf"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, "name"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
         "tool_choice 'required' needs tools"),
        ("/generate", {"text": "x", "sampling_params": {"json_schema": "{"}}, "json_schema is not valid JSON"),
        # Schemas that break the meta-schema (each was a 500: a TypeError in the writer)
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"$defs": 5}}}},
         "not a valid JSON schema: at $defs: 5 is not of type 'object'"),
        ("/v1/completions", {"prompt": "x", "guided_json": {"type": {}}}, "at type: {} is not one of ['array', "),
        ("/generate", {"text": "x", "sampling_params": {"json_schema": '{"type": "string", "format": []}'}},
         "at format: [] is not of type 'string'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"type": ["string", {}]}}}}}]},
         "tool 'f''s parameters is not a valid JSON schema: at properties/a/type/1: {}"),
        ("/v1/completions", {"prompt": "x", "guided_json": {"type": "integer", "enum": ["a"]}},
         'enum value "a" is not of type integer: no output could match the schema'),
        ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
        ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search is not supported"),
        ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be >= 1"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs is not available"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 21},
         "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "allowed_token_ids": []},
         "allowed_token_ids"),
        ("/v1/completions", {"prompt": "x", "allowed_token_ids": [99999]}, "outside the vocabulary"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 3, "stop_token_ids": [-280, 0]}, "stop_token_ids token id"),
        ("/generate", {"text": "x", "sampling_params": {"stop_token_ids": [10**9]}}, "outside the vocabulary"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 30169}, "min_tokens (30169) must be <= "
         "max_tokens (4)"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 201}, "at least 201 new tokens; the limit is 200"),
        ("/v1/completions", {"prompt": [10] * 550, "max_tokens": 151}, "prompt has 550 tokens and the request asks "
         "for up to 151 new tokens: 701 tokens, past the model's context of 700"),
        ("/generate", {"input_ids": [10] * 550, "sampling_params": {"max_new_tokens": 151}},
         "past the model's context"),
        ("/v1/completions", {"prompt": "x", "bad_words": ["no", " "]}, "bad_words must be words"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo is not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
         "top_logprobs needs logprobs: true"),
        ("/generate", {"text": "x", "lora_path": "adapter"}, "lora_path is not supported"),
        # Fields that change the answer, which were taken and ignored
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 'x' }}"},
         "chat_template is not supported: the checkpoint's chat template renders every request"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "documents": [{"text": "d"}]},
         "documents is not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
         "modalities is not supported: the answer is text only"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids is not supported"),
        ("/generate", {"text": "x", "return_hidden_states": True}, "return_hidden_states is not supported"),
        # Token ids that are not integers (a bool was read as the id 1)
        ("/v1/completions", {"prompt": [True, 5]}, "prompt"),
        ("/generate", {"input_ids": [1, "2"]}, "input_ids"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [False]}, "stop_token_ids"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options is only allowed with stream: true"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
         "continue_final_message needs add_generation_prompt: false"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
                                  "add_generation_prompt": False}, "continues an assistant's message"),
        # /abort_request names one request or all of them
        ("/abort_request", {}, "name the request to abort (`rid`), or set `abort_all`"),
        ("/abort_request", {"rid": "a", "abort_all": True}, "`rid` and `abort_all` exclude each other"),
        ("/abort_request", {"rid": 5}, "rid"),
        ("/abort_request", {"abort_all": "yes"}, "abort_all"),
        ("/abort_request", {"rid": "r" * 129}, "rid"),
        ("/abort_request", {"rid": "r", "request_id": "r"}, "request_id"),  # a misspelt field is not ignored
        # /start_profile: the folder is the manifest's, the steps a positive integer
        ("/start_profile", {"output_dir": "/etc"}, "output_dir is not supported: the traces go to the manifest's"),
        ("/start_profile", {"activities": ["MEM"]}, "activities is not supported"),
        ("/start_profile", {"num_steps": 0}, "num_steps"),
        ("/start_profile", {"num_steps": "5"}, "num_steps"),
        ("/start_profile", {"steps": 5}, "steps"),
    ],
)
def test_bad_input_is_a_clear_400(base_url, path, body, message):
    response = httpx.post(f"{base_url}{path}", json=body)
    assert response.status_code == 400, response.text
    said = response.json()["error"]["message"]
    assert message in said
    assert "Traceback" not in said and "ray::" not in said and 'File "' not in said  # a worker's refusal too


def _failed_requests(base_url) -> float:
    metrics = httpx.get(f"{base_url}/metrics").text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith('tandem_requests_total{outcome="error"}'))


def test_token_ids_the_model_cannot_take_are_refused_before_routing(base_url):
    """Found by P's engine, they were refused after D had reserved blocks, and
    counted among the failed requests (which the autoscaler reads)."""
    before = _failed_requests(base_url)
    eos = httpx.post(f"{base_url}/tokenize", json={"prompt": "<|endoftext|>", "add_special_tokens": False})
    (eos_id,) = eos.json()["tokens"]
    for body, message in (({"logit_bias": {"99999": 1}}, "outside the vocabulary"),
                          ({"stop_token_ids": [99999]}, "outside the vocabulary"),
                          ({"allowed_token_ids": [3, 99999]}, "outside the vocabulary"),
                          ({"allowed_token_ids": [eos_id], "min_tokens": 1}, "all banned from the first draw")):
        response = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
        assert response.status_code == 400 and message in response.text, response.text
    assert _failed_requests(base_url) == before


@pytest.mark.parametrize(
    "content, status",
    [
        (b"{not json", 400),
        (b"", 400),
        (b"[1, 2, 3]", 400),
        (b'{"text": "\\u00ff\\u00fe", "max_new_tokens": 2}', 200),  # JSON escapes are fine text
        (b'{"text": "' + bytes([0xFF, 0xFE]) + b'"}', 400),  # invalid UTF-8
        (b'{"text": "x"' + b" " * (10 * 2**20) + b"}", 413),  # a 10 MB body
        (b'{"text": "\\ud83d\\ude00", "max_new_tokens": 2}', 200),  # a surrogate pair escaped: one character
        (b'{"text": "\\\\ud800", "max_new_tokens": 2}', 200),  # an escaped backslash, then text
        (b'{"text": "\\ud800", "max_new_tokens": 2}', 400),  # a lone surrogate (was a 500)
        (b'{"text": "' + bytes([0xED, 0xA0, 0x80]) + b'", "max_new_tokens": 2}', 400),  # one as UTF-8 bytes
    ],
    ids=["bad-json", "empty", "array", "escaped", "invalid-utf8", "10MB", "pair", "backslash", "lone-surrogate",
         "surrogate-bytes"],
)
def test_malformed_and_oversized_bodies(base_url, content, status):
    response = httpx.post(f"{base_url}/generate", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    if status != 200:
        assert "error" in response.json()


@pytest.mark.parametrize("content, content_type, message", [
    (b"[1, 2]", "application/json", "the body must be a JSON object, not an array"),
    (b'"text"', "application/json", "the body must be a JSON object, not a string"),
    (b'{"text": "x"}', "application/x-www-form-urlencoded",
     "the body must be a JSON object sent as application/json, not application/x-www-form-urlencoded"),
    (b'{"text": "x"}', None, "the body must be a JSON object sent as application/json, not untyped"),
], ids=["array", "string", "form", "untyped"])
def test_a_body_that_is_no_json_object_says_what_it_is(base_url, content, content_type, message):
    """curl -d sends a form's content type: the body is then not read as JSON."""
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(f"{base_url}/generate", content=content, headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == message


@pytest.mark.parametrize("path, body, field", [
    ("/generate", {"text": "a\ud800"}, "text"),
    ("/v1/completions", {"prompt": ["fine", "b\udfff"]}, "prompt.1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udbff!"}]}, "messages.0.content"),
    ("/v1/responses", {"input": "x", "instructions": "\ud800"}, "instructions"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/v1/conversations", {"metadata": {"\ud800": "v"}}, "metadata.\\ud800"),
])
def test_a_lone_surrogate_is_refused_where_it_is(base_url, path, body, field):
    """JSON escapes can spell half a UTF-16 pair, which decodes to no Unicode
    text: the tokenizer raised a TypeError and the store a UnicodeEncodeError
    (500s). Now every endpoint refuses it as invalid JSON, naming the field
    (cluster/strict_json.py)."""
    content = json.dumps({"model": "tandem-tiny-qwen2", **body}).encode()  # ASCII: the surrogate as its escape
    response = httpx.post(f"{base_url}{path}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert message.startswith(f"the body is not valid JSON: {field} holds a lone surrogate"), message


def test_a_body_that_is_not_json_says_where(base_url):
    response = httpx.post(f"{base_url}/generate", content=b'{"text": "x",}',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("the body is not valid JSON: ")


@pytest.mark.parametrize("size, status", [(2**10, 200), (10 * 2**20, 413)], ids=["small", "10MB"])
def test_chunked_bodies_without_a_length_are_held_to_the_limit(base_url, size, status):
    def chunks():
        body = b'{"text": "x", "max_new_tokens": 2' + b" " * size + b"}"
        for start in range(0, len(body), 2**16):
            yield body[start:start + 2**16]

    response = httpx.post(f"{base_url}/generate", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert ("error" in response.json()) == (status != 200)


def test_a_prompt_over_the_limit_is_served_truncated_when_asked(base_url, client):
    """vLLM's truncate_prompt_tokens: a prompt over max_prompt_tokens is a 400;
    asked to keep its last 50 tokens it is served as those alone (the greedy text
    of sending just them), its echo their text, its usage their count; asked for
    -1, it keeps as many as the limit lets in."""
    long_prompt = list(range(100, 800))  # 700 tokens, the limit is 600
    with pytest.raises(openai.BadRequestError, match="the limit is 600"):
        client.completions.create(model="tandem-tiny-qwen2", prompt=long_prompt, max_tokens=4)
    tail = long_prompt[-50:]
    greedy = dict(model="tandem-tiny-qwen2", max_tokens=4, temperature=0)
    kept = client.completions.create(prompt=long_prompt, echo=True, **greedy,
                                     extra_body={"truncate_prompt_tokens": 50, "ignore_eos": True})
    alone = client.completions.create(prompt=tail, **greedy, extra_body={"ignore_eos": True})
    tail_text = httpx.post(f"{base_url}/detokenize", json={"tokens": tail}).json()["prompt"]
    assert kept.choices[0].text == tail_text + alone.choices[0].text
    assert kept.usage.prompt_tokens == 50 and kept.usage.completion_tokens == 4
    whole = client.completions.create(prompt="a short prompt", **greedy, extra_body={"truncate_prompt_tokens": -1})
    assert whole.choices[0].text == client.completions.create(prompt="a short prompt", **greedy).choices[0].text
    most = client.completions.create(prompt=long_prompt, **greedy, extra_body={"truncate_prompt_tokens": -1})
    assert most.usage.prompt_tokens == 600  # -1: as many as the limit lets in (vLLM's context length: 2048)
    assert most.choices[0].text == client.completions.create(prompt=long_prompt[-600:], **greedy).choices[0].text


def test_an_output_length_left_out_is_held_to_the_room_the_prompt_leaves(base_url, client):
    """A default output length (chat's 200, the limit; /generate's 128; completions'
    16) is held to the context a long prompt leaves (vLLM's sizing of an omitted
    max_tokens): 600 prompt tokens leave 100 of the 700. Asked for, 101 would be
    refused (above)."""
    prompt = [10 + i % 500 for i in range(600)]
    generated = httpx.post(f"{base_url}/generate", json={"input_ids": prompt, "ignore_eos": True}, timeout=60)
    assert generated.status_code == 200, generated.text
    meta = generated.json()["meta_info"]
    assert meta["completion_tokens"] == 100 and meta["finish_reason"]["type"] == "length"
    chat_text = httpx.post(f"{base_url}/detokenize", json={"tokens": prompt[:320]}).json()["prompt"]
    chat = client.chat.completions.create(model="tandem-tiny-qwen2", messages=[{"role": "user", "content": chat_text}],
                                          extra_body={"ignore_eos": True})
    assert 500 < chat.usage.prompt_tokens <= 600  # (less than the default's room is left)
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 700
    assert chat.choices[0].finish_reason == "length"
    short = client.completions.create(model="tandem-tiny-qwen2", prompt=prompt, extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 16  # (room for more: the default as it is)


def test_unknown_model_is_404(client, base_url):
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):  # vLLM checks it there too
        wrong = httpx.post(base_url + path, json={"model": "gpt-9", **body}, timeout=30)
        assert wrong.status_code == 404 and "'gpt-9' not found" in wrong.json()["error"]["message"], wrong.text
        served = client.models.list().data[0].id
        assert httpx.post(base_url + path, json={"model": served, **body}, timeout=30).status_code == 200


def test_a_rid_in_flight_twice_names_two_requests(base_url):
    """SGLang's rid is the client's name for a request (meta_info's id); a second
    request with the rid of one in flight is a request of its own, and neither
    touches the other. (Workers knew requests by it: the second was refused as
    already in flight, and the first never ended.)"""

    async def both():
        body = {"rid": "same", "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            async with client.stream("POST", "/generate", json={**body, "text": "a long answer", "stream": True,
                                                                  "max_new_tokens": 200}) as first:
                lines = first.aiter_lines()
                async for line in lines:
                    if line.startswith("data:"):
                        break  # the first has a token: it is in flight
                second = await client.post("/generate", json={**body, "text": "another", "max_new_tokens": 20})
                events = [json.loads(line[5:]) for line in [line async for line in lines] if line.startswith("data:")
                          and line != "data: [DONE]"]
            unnamed = await client.post("/generate", json={"text": "no rid", "max_new_tokens": 2})
        return events[-1], second, unnamed

    first_last, second, unnamed = asyncio.run(both())
    assert second.status_code == 200 and len(second.json()["output_ids"]) == 20
    assert len(first_last["output_ids"]) == 200 and first_last["meta_info"]["finish_reason"] == {"type": "length",
                                                                                             "length": 200}
    assert first_last["meta_info"]["id"] == second.json()["meta_info"]["id"] == "same"
    assert len(unnamed.json()["meta_info"]["id"]) == 32  # made up: a uuid's hex


def test_a_profile_traces_the_workers_steps_into_the_manifests_folder(base_url):
    """/start_profile traces every worker's engine steps (actors/step_profile.py):
    with num_steps it ends by itself after them, else at /stop_profile, which
    names the traces written; one at a time (409), and /stop_profile with none
    running is a 409 too."""
    try:
        started = httpx.post(f"{base_url}/start_profile", json={"num_steps": 3}, timeout=PROFILE_CALL_S)
        assert started.status_code == 200, started.text
        (path,) = started.json()["traces"].values()
        assert Path(path).parent == PROFILE_DIR and path.endswith(".trace.json.gz")
        assert httpx.post(f"{base_url}/generate", json={"text": "traced", "max_new_tokens": 8}).status_code == 200
        # it ended after its 3 steps: named, not ended again
        stopped = httpx.post(f"{base_url}/stop_profile", timeout=PROFILE_CALL_S)
        assert stopped.status_code == 200 and list(stopped.json()["traces"].values()) == [path], stopped.text
        events = json.load(gzip.open(path))["traceEvents"]
        assert sum(1 for e in events if e.get("name", "").startswith("ProfilerStep#")) >= 3  # a range a step
        assert any(e.get("name", "").startswith("aten::") for e in events)  # the steps' operators

        # no body: until stopped
        assert httpx.post(f"{base_url}/start_profile", timeout=PROFILE_CALL_S).status_code == 200
        again = httpx.post(f"{base_url}/start_profile", json={}, timeout=PROFILE_CALL_S)
        assert again.status_code == 409 and "POST /stop_profile" in again.json()["error"]["message"], again.text
        assert httpx.post(f"{base_url}/generate", json={"text": "traced", "max_new_tokens": 2}).status_code == 200
        (second,) = httpx.post(f"{base_url}/stop_profile", timeout=PROFILE_CALL_S).json()["traces"].values()
        assert second != path and Path(second).is_file()
        none = httpx.post(f"{base_url}/stop_profile", timeout=PROFILE_CALL_S)
        assert none.status_code == 409 and "no profile is running" in none.json()["error"]["message"]
    finally:
        httpx.post(f"{base_url}/stop_profile", timeout=PROFILE_CALL_S)
        shutil.rmtree(PROFILE_DIR, ignore_errors=True)


def test_still_serving_after_the_bad_requests(base_url):
    response = httpx.post(f"{base_url}/generate", json={"text": "still here", "max_new_tokens": 2})
    assert response.status_code == 200
