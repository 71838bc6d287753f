"""The Serve application over real HTTP: OpenAI client, /generate, streaming,
metrics, cancellation, schema fuzzing, and a scheduler replica restart (bad input:
tests/test_serve_bad_input.py)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from pathlib import Path
from typing import Literal

import httpx
import openai
import pydantic
import pytest
import ray
from ray import serve

from actors.llm import LLM
from actors.model_builder import ensure_checkpoint
from actors.sampling_params import SamplingParams
from tests.conftest import served_app

ENGINE = {"block_size": 16, "prefill_chunk_size": 64, "max_num_batched_tokens": 256, "num_kv_blocks": 512}
ARGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "mode": "disaggregated",
    "channel": "gloo",
    "engine": ENGINE,
    "prefill": {"replicas": 2},
    "limits": {"max_prompt_tokens": 600, "max_new_tokens": 200, "max_stop_sequences": 2, "max_body_bytes": 100_000},
    "pool_name": "test-pool-main",
}


@pytest.fixture(scope="module")
def base_url(serve_port):
    yield from served_app("main", ARGS, serve_port)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def pool_members(pool_name: str):
    return ray.get(ray.get_actor(pool_name, namespace="tandem").list_members.remote())


def wait_workers_idle(pool_name: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [ray.get(m.handle.check_accounting.remote()) for m in pool_members(pool_name)]
        if all(s.num_used_blocks == 0 and s.num_reserved == 0 and s.num_running == 0 and s.num_waiting_handshakes == 0
               for s in stats):
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


def test_the_seeds_request(base_url):
    response = httpx.post(f"{base_url}/generate", json={"text": "Hello there", "max_new_tokens": 32, "temperature": 0.7})
    assert response.status_code == 200, response.text
    body = response.json()
    meta = body["meta_info"]
    assert isinstance(body["text"], str) and meta["completion_tokens"] == len(body["output_ids"])
    # Unseeded at temperature 0.7, the tiny model can sample its end-of-text token (after 23 tokens in a run here;
    # as the 32nd in one, a stop with 32 tokens, which this read as a length that came out a stop)
    reason = meta["finish_reason"]["type"]
    assert len(body["output_ids"]) <= 32 and reason in ("stop", "length")
    assert reason == "stop" or len(body["output_ids"]) == 32


def test_sglang_sampling_params_and_input_ids(base_url):
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    response = httpx.post(f"{base_url}/generate", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["output_ids"]) == 4


def test_generate_answers_sglangs_batch_as_it_answers_each_prompt(base_url):
    """A batch of texts with params and a rid a prompt: a list in prompt order,
    each answer what the prompt alone gets (greedy)."""
    prompts = ["The first prompt", "A second prompt, a little longer than the first", "third"]
    params = [{"max_new_tokens": m, "temperature": 0} for m in (3, 6, 4)]
    body = {"text": prompts, "sampling_params": params, "rid": ["a", "b", "c"]}
    batch = httpx.post(f"{base_url}/generate", json=body, timeout=60)
    assert batch.status_code == 200, batch.text
    answers = batch.json()
    assert [a["meta_info"]["id"] for a in answers] == ["a", "b", "c"]
    assert [len(a["output_ids"]) for a in answers] == [3, 6, 4]
    for prompt, p, answer in zip(prompts, params, answers):
        alone = httpx.post(f"{base_url}/generate", json={"text": prompt, "sampling_params": p}, timeout=60).json()
        assert (answer["text"], answer["output_ids"]) == (alone["text"], alone["output_ids"])


def test_a_burst_sharing_a_new_prompt_sends_it_to_the_decode_worker_once(base_url):
    """Eight requests that begin with the same 96 tokens, new to the workers, sent at
    once: the first reservation on D holds the prompt's blocks, and every later one
    shares them, cached or still on their way (actors/arriving_blocks.py), so P sends
    them once. Their answers are those of each prompt sent alone. Their usage's
    `cached_tokens` are their P's count, as the prompt-token metric's."""
    rng = random.Random("a new system prompt")
    system = [rng.randrange(3, 2000) for _ in range(96)]
    prompts = [system + [rng.randrange(3, 2000) for _ in range(20)] for _ in range(8)]
    greedy = {"max_new_tokens": 4, "temperature": 0}

    async def burst():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(http.post(f"{base_url}/generate", json={
                "input_ids": prompt, "sampling_params": greedy}) for prompt in prompts))

    series = [f'tandem_kv_transfer_blocks_total{{kind="{kind}"}}' for kind in ("sent", "held", "borrowed")]
    series.append('tandem_prompt_tokens_total{source="cache"}')
    before = [_counter(base_url, s) for s in series]
    answers = [answer.json() for answer in asyncio.run(burst())]
    sent, held, borrowed, cached = (_counter(base_url, s) - b for s, b in zip(series, before))
    assert (sent, held + borrowed) == (8 + 7 * 2, 7 * 6), answers  # 8 blocks a prompt; after the first, 6 not sent
    assert sum(a["meta_info"]["cached_tokens"] for a in answers) == cached
    for prompt, answer in zip(prompts, answers):
        alone = httpx.post(f"{base_url}/generate", json={"input_ids": prompt, "sampling_params": greedy}, timeout=60)
        assert alone.json()["output_ids"] == answer["output_ids"]


def test_a_prompts_choices_share_its_prefill_and_its_transfer(base_url):
    """n = 4 on a prompt new to the workers: the others start once the first is
    routed, on its pair, so on D they borrow its blocks still on their way (P
    computes and sends the prompt once, then each other choice its last block),
    and each choice answers as the prompt alone does with its seed (choice j:
    seed + j)."""
    prompt = [random.Random("n choices").randrange(3, 2000) for _ in range(580)]  # 37 blocks, 36 a cache may serve
    params = {"max_new_tokens": 6, "temperature": 1.0, "seed": 11}
    series = [f'tandem_kv_transfer_blocks_total{{kind="{kind}"}}' for kind in ("sent", "held", "borrowed")]
    series.append('tandem_prompt_tokens_total{source="cache"}')
    before = [_counter(base_url, s) for s in series]
    answers = httpx.post(f"{base_url}/generate", json={"input_ids": prompt, "sampling_params": {**params, "n": 4}},
                         timeout=60).json()
    sent, held, borrowed, cached = (_counter(base_url, s) - b for s, b in zip(series, before))
    assert (sent, held + borrowed) == (37 + 3, 3 * 36) and borrowed > 0, (sent, held, borrowed)
    assert cached == 3 * 36 * 16  # one P computed it: the others found it there
    for j, answer in enumerate(answers):
        alone = httpx.post(f"{base_url}/generate", timeout=60, json={
            "input_ids": prompt, "sampling_params": {**params, "seed": params["seed"] + j}}).json()
        assert answer["output_ids"] == alone["output_ids"]


def test_generate_streams_a_batch_with_n_choices_by_index(base_url):
    """Two id prompts, n = 2, seeded: four requests, prompt i's choice j at index
    2i + j, choice j drawing from seed + j; streamed chunks say their index and
    end as the whole answer does."""
    body = {"input_ids": [[5, 6, 7], [9, 10, 11, 12]], "rid": ["p", "q"], "return_logprob": True,
            "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "seed": 3, "n": 2}}
    whole = httpx.post(f"{base_url}/generate", json=body, timeout=60).json()
    assert [a["meta_info"]["id"] for a in whole] == ["p-0", "p-1", "q-0", "q-1"]
    assert [a["meta_info"]["prompt_tokens"] for a in whole] == [3, 3, 4, 4]
    alone = httpx.post(f"{base_url}/generate", timeout=60, json={
        "input_ids": [9, 10, 11, 12], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "seed": 4}}).json()
    assert whole[3]["output_ids"] == alone["output_ids"] != whole[2]["output_ids"]
    with httpx.stream("POST", f"{base_url}/generate", json={**body, "stream": True}, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    last = {}
    for chunk in map(json.loads, (line[5:] for line in lines[:-1])):
        last[chunk["index"]] = chunk
    assert sorted(last) == [0, 1, 2, 3]
    assert [last[k]["output_ids"] for k in range(4)] == [a["output_ids"] for a in whole]
    assert all(last[k]["meta_info"]["finish_reason"] == {"type": "length", "length": 4} for k in range(4))
    for k, answer in enumerate(whole):  # return_logprob: each chunk's meta_info has the logprobs so far
        streamed, meta = last[k]["meta_info"], answer["meta_info"]
        assert [t for _, t, _ in streamed["output_token_logprobs"]] == answer["output_ids"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == answer["output_ids"]
        assert [v for v, _, _ in streamed["output_token_logprobs"]] == pytest.approx(
            [v for v, _, _ in meta["output_token_logprobs"]], abs=1e-4)
        assert {text for _, _, text in meta["output_token_logprobs"]} == {None}  # no return_text_in_logprobs
        assert [len(top) for top in streamed["output_top_logprobs"]] == [2] * 4


def test_penalties_over_http_equal_the_offline_engine(base_url, client):
    llm = LLM(ensure_checkpoint("tiny", "qwen2"), **ENGINE)
    penalties = dict(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9]
    (offline,) = llm.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, **penalties))
    (plain,) = llm.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    assert offline.token_ids != plain.token_ids
    response = httpx.post(f"{base_url}/generate", json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, **penalties}})
    assert response.json()["output_ids"] == offline.token_ids
    completion = client.completions.create(model="tandem-tiny-qwen2", prompt=prompt, max_tokens=16, temperature=0,
                                           frequency_penalty=1.0, presence_penalty=0.5,
                                           extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    assert completion.choices[0].text == offline.text


def test_n_choices_each_a_request_seeded_apart(client):
    kwargs = dict(model="tandem-tiny-qwen2", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5,
                  extra_body={"ignore_eos": True})
    three = client.completions.create(n=3, **kwargs)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.usage.completion_tokens == 24 and three.usage.prompt_tokens > 0
    # Choice i draws from seed + i: the same text as a one-choice request with that seed.
    for i, choice in enumerate(three.choices):
        alone = client.completions.create(**{**kwargs, "seed": 5 + i})
        assert choice.text == alone.choices[0].text
    assert len({c.text for c in three.choices}) > 1
    streamed = {}
    for chunk in client.chat.completions.create(model="tandem-tiny-qwen2", n=2, stream=True, max_tokens=6,
                                                temperature=0, messages=[{"role": "user", "content": "hi"}],
                                                stream_options={"include_usage": True}):
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).append(choice.delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert sorted(streamed) == [0, 1] and "".join(streamed[0]) == "".join(streamed[1])  # greedy: the same
    whole = client.chat.completions.create(model="tandem-tiny-qwen2", n=2, max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": "hi"}])
    assert [c.message.content for c in whole.choices] == ["".join(streamed[0])] * 2
    assert usage.completion_tokens == whole.usage.completion_tokens > 0  # both choices', counted once


def _counter(base_url, series: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def test_a_batch_of_prompts_numbers_its_choices_prompt_major(client):
    kwargs = dict(model="tandem-tiny-qwen2", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kwargs) for p in ("Once upon", [5, 6, 7])]
    batch = client.completions.create(prompt=["Once upon", "x"], n=2, echo=True, **kwargs)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices[:2]] == ["Once upon" + alone[0].choices[0].text] * 2
    assert all(c.text.startswith("x") for c in batch.choices[2:])
    ids = client.completions.create(prompt=[[5, 6, 7], [8, 9]], **kwargs)
    assert ids.choices[0].text == alone[1].choices[0].text and len(ids.choices) == 2
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 10
    streamed = {}
    for chunk in client.completions.create(prompt=[[5, 6, 7], [5, 6, 7]], stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {0: alone[1].choices[0].text, 1: alone[1].choices[0].text}


def test_later_choices_prefill_from_the_first_ones_cache(base_url, client):
    """Two prefill workers, cache-aware routing: the later choices start once the
    first is routed, go to its P (not to the idle one, which would compute the
    whole prompt again for a few milliseconds less), wait for its blocks and find
    all of the prompt but the last block there (the metric every prefill reports)."""
    prompt = list(range(300, 780))  # 480 tokens: 29 full blocks can hit
    series = 'tandem_prompt_tokens_total{source="cache"}'
    before = _counter(base_url, series)
    client.completions.create(model="tandem-tiny-qwen2", prompt=prompt, n=3, max_tokens=4, temperature=0.7, seed=1,
                              extra_body={"ignore_eos": True})
    assert _counter(base_url, series) - before == 2 * 464


def test_tokenize_gives_the_ids_requests_use(base_url, client):
    tokens = httpx.post(f"{base_url}/tokenize", json={"prompt": "The quick brown fox"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0 and "token_strs" not in tokens
    spelt = httpx.post(f"{base_url}/tokenize", json={"prompt": "The quick brown fox", "return_token_strs": True})
    assert spelt.json()["tokens"] == tokens["tokens"]  # (vLLM's: each token as the vocabulary spells it)
    assert "".join(spelt.json()["token_strs"]).replace("\u0120", " ") == "The quick brown fox"
    by_text = httpx.post(f"{base_url}/generate", json={"text": "The quick brown fox", "max_new_tokens": 6,
                                                       "temperature": 0}).json()
    by_ids = httpx.post(f"{base_url}/generate", json={"input_ids": tokens["tokens"], "max_new_tokens": 6,
                                                      "temperature": 0}).json()
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_text["meta_info"]["prompt_tokens"] == tokens["count"]
    messages = [{"role": "user", "content": "hi there"}]
    chat_tokens = httpx.post(f"{base_url}/tokenize", json={"messages": messages}).json()
    chat = client.chat.completions.create(model="tandem-tiny-qwen2", messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens == chat_tokens["count"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_tools = httpx.post(f"{base_url}/tokenize", json={"messages": messages, "tools": tools}).json()
    chat = client.chat.completions.create(model="tandem-tiny-qwen2", messages=messages, tools=tools, max_tokens=2)
    assert chat.usage.prompt_tokens == with_tools["count"] > chat_tokens["count"]  # (the tools were left out)
    none = httpx.post(f"{base_url}/tokenize", json={"messages": messages, "tools": tools, "tool_choice": "none"})
    chat = client.chat.completions.create(model="tandem-tiny-qwen2", messages=messages, tools=tools,
                                          tool_choice="none", max_tokens=2)
    assert chat.usage.prompt_tokens == none.json()["count"] == chat_tokens["count"]  # (counted them: 356 against 14)
    text = httpx.post(f"{base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "The quick brown fox"
    for path, body in (("/tokenize", {}), ("/tokenize", {"prompt": "x", "messages": messages}),
                       ("/tokenize", {"prompt": "x", "tools": tools}),
                       ("/tokenize", {"prompt": "x", "return_token_strs": [1]}),
                       ("/detokenize", {"tokens": [10**9]}), ("/detokenize", {"tokens": "abc"})):
        response = httpx.post(f"{base_url}{path}", json=body)
        assert response.status_code == 400 and "message" in response.json()["error"], (path, body)


def test_chat_can_continue_a_prefilled_answer(base_url, client):
    """`continue_final_message` (vLLM's): the assistant's last message is left
    open, no end of turn after it, and the model writes on from it; /tokenize with
    the same fields gives the ids the request is served from."""
    from actors.tokenization import load_tokenizer

    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "Well, the"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    text = load_tokenizer(ensure_checkpoint("tiny", "qwen2")).apply_chat_template(messages, tokenize=False, **fields)
    assert text.endswith("<|im_start|>assistant\nWell, the")
    tokens = httpx.post(f"{base_url}/tokenize", json={"messages": messages, **fields}).json()["tokens"]
    chat = client.chat.completions.create(model="tandem-tiny-qwen2", messages=messages, max_tokens=6, temperature=0,
                                          extra_body={**fields, "ignore_eos": True})
    assert chat.usage.prompt_tokens == len(tokens)
    (offline,) = LLM(ensure_checkpoint("tiny", "qwen2"), block_size=16).generate(
        [tokens], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    assert chat.choices[0].message.content == offline.text


def test_prompt_logprobs_by_echo_and_by_logprob_start_len(base_url, client):
    """How evaluation harnesses score a text: echo, logprobs, max_tokens 0 (OpenAI),
    or SGLang's logprob_start_len; both give each prompt token's logprob."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = httpx.post(f"{base_url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    sglang = httpx.post(f"{base_url}/generate", json={
        "text": prompt, "max_new_tokens": 1, "temperature": 0, "return_logprob": True, "logprob_start_len": 0,
        "top_logprobs_num": 2, "return_text_in_logprobs": True}).json()["meta_info"]
    assert [t for _, t, _ in sglang["input_token_logprobs"]] == ids and sglang["input_token_logprobs"][0][0] is None
    text = httpx.post(f"{base_url}/detokenize", json={"tokens": [ids[1]]}).json()["prompt"]
    assert sglang["input_token_logprobs"][1][2] == text  # return_text_in_logprobs: each token's own text
    assert sglang["input_top_logprobs"][0] is None and len(sglang["input_top_logprobs"][1]) == 2
    assert len(sglang["output_top_logprobs"]) == 1 and len(sglang["output_top_logprobs"][0]) == 2
    alone = httpx.post(f"{base_url}/generate", json={  # (SGLang's frontend scores a choice so: it was a 400)
        "text": prompt, "max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 2}).json()
    assert (alone["text"], alone["output_ids"], alone["meta_info"]["completion_tokens"]) == ("", [], 0)
    assert alone["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert alone["meta_info"]["input_token_logprobs"] == [[None, ids[2], None], *[
        [pytest.approx(lp, abs=1e-5), t, None] for lp, t, _ in sglang["input_token_logprobs"][3:]]]
    scored = client.completions.create(model="tandem-tiny-qwen2", prompt=prompt, echo=True, max_tokens=0,
                                       logprobs=1, temperature=0)
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([lp for lp, _, _ in sglang["input_token_logprobs"][1:]],
                                                               abs=1e-5)
    echoed = client.completions.create(model="tandem-tiny-qwen2", prompt=prompt, echo=True, max_tokens=4,
                                       temperature=0, extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tandem-tiny-qwen2", prompt=prompt, echo=True, max_tokens=4, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert echoed.choices[0].text.startswith(prompt) and streamed == echoed.choices[0].text
    assert echoed.usage.completion_tokens == 4
    # vLLM's prompt_logprobs: by token id, each prompt token's logprob and rank, and the 2 best
    vllm = httpx.post(f"{base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2,
                                                          "echo": True, "logprobs": 1}).json()["choices"][0]
    entries = vllm["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids) and 1 <= len(vllm["logprobs"]["top_logprobs"][1]) <= 2
    assert [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:])] == pytest.approx(
        choice.logprobs.token_logprobs[1:], abs=1e-5)
    assert all(e[str(t)]["rank"] >= 1 and sorted(v["rank"] for v in e.values())[:2] == [1, 2] and len(e) <= 3
               for e, t in zip(entries[1:], ids[1:]))
    chat = httpx.post(f"{base_url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_stop_strings_can_stay_in_the_text(client):
    free = client.completions.create(model="tandem-tiny-qwen2", prompt="Stop here", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[5:7]
    cut, kept = (client.completions.create(model="tandem-tiny-qwen2", prompt="Stop here", max_tokens=20,
                                           temperature=0, stop=[stop],
                                           extra_body={"ignore_eos": True, "include_stop_str_in_output": keep})
                 for keep in (False, True))
    assert cut.choices[0].text == free[: free.find(stop)]
    assert kept.choices[0].text == free[: free.find(stop) + len(stop)]
    assert cut.choices[0].stop_reason == stop  # (vLLM's: the stop string that ended it)
    streamed = list(client.chat.completions.create(model="tandem-tiny-qwen2", messages=[
        {"role": "user", "content": "Stop here"}], max_tokens=20, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    last = streamed[-1].choices[0]
    assert last.finish_reason in ("stop", "length") and (last.stop_reason == stop) == (last.finish_reason == "stop")


def test_stop_token_ids_end_an_openai_request(base_url, client):
    ids = httpx.post(f"{base_url}/generate", json={"text": "Stop here", "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}).json()["output_ids"]
    stopped = client.completions.create(model="tandem-tiny-qwen2", prompt="Stop here", max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": False, "stop_token_ids": [ids[3]]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == ids[3]  # (vLLM's)
    assert stopped.usage.completion_tokens == ids.index(ids[3]) + 1
    text = httpx.post(f"{base_url}/detokenize", json={"tokens": ids}).json()["prompt"]
    for stop, matched in (({"stop_token_ids": [ids[3]]}, ids[3]), ({"stop": ["zzz", text[5:7]]}, text[5:7])):
        answer = httpx.post(f"{base_url}/generate", json={"text": "Stop here", "sampling_params": {  # SGLang's
            "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, **stop}}).json()["meta_info"]["finish_reason"]
        assert answer == {"type": "stop", "matched": matched}, (answer, text)


def test_logit_bias_and_min_tokens_over_http(client):
    forced = client.completions.create(model="tandem-tiny-qwen2", prompt=[5, 6, 7], max_tokens=6, temperature=0,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model="tandem-tiny-qwen2", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, temperature=0, logit_bias={"42": 100},
                                          extra_body={"min_tokens": 6})
    assert forced.usage.completion_tokens == 6 and chat.usage.completion_tokens == 6
    assert forced.choices[0].text == chat.choices[0].message.content
    only = client.completions.create(model="tandem-tiny-qwen2", prompt=[5, 6, 7], max_tokens=6, temperature=1.0,
                                     extra_body={"ignore_eos": True, "allowed_token_ids": [42]})
    assert only.choices[0].text == forced.choices[0].text  # the one token allowed, sampled or not


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
                                           "kind": {"enum": ["cat", "dog", 3]}}, "required": ["name", "kind"]}


def test_structured_output_through_a_prefill_decode_pair(base_url, client):
    """Each API's way of asking for it: P draws the first token from the pattern's
    start, D walks it and draws the rest. A bounded schema ends within its length."""
    messages = [{"role": "user", "content": "A pet, as JSON"}]
    for seed in range(3):
        chat = client.chat.completions.create(
            model="tandem-tiny-qwen2", messages=messages, max_tokens=150, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PERSON}})
        assert chat.choices[0].finish_reason == "stop"
        pet = json.loads(chat.choices[0].message.content)
        assert set(pet) >= {"name", "kind"} and pet["kind"] in ("cat", "dog", 3) and len(pet["name"]) <= 8
    picked = client.completions.create(model="tandem-tiny-qwen2", prompt="Pick:", max_tokens=20, temperature=1.0,
                                       extra_body={"guided_choice": ["left", "right", "neither one"]})
    assert picked.choices[0].text in ("left", "right", "neither one")
    streamed = client.completions.create(model="tandem-tiny-qwen2", prompt="Call", max_tokens=20, stream=True,
                                         extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", "".join(c.choices[0].text for c in streamed))
    sglang = httpx.post(f"{base_url}/generate", json={"text": "Date:", "sampling_params": {
        "max_new_tokens": 20, "regex": r"20\d\d-(0[1-9]|1[0-2])-[0-3]\d"}}).json()
    assert re.fullmatch(r"20\d\d-(0[1-9]|1[0-2])-[0-3]\d", sglang["text"])
    assert sglang["meta_info"]["finish_reason"]["type"] == "stop"


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=30)
    kind: Literal["cat", "dog"]
    nick: str | None = pydantic.Field(None, max_length=6)  # (bounded: the answer ends within max_tokens)


def test_the_openai_clients_parse_gets_its_pydantic_model(client):
    """`client.chat.completions.parse(response_format=Model)`: the client sends the
    model's strict JSON schema ($defs, anyOf with null, bounds) and parses the answer."""
    parsed = client.chat.completions.parse(model="tandem-tiny-qwen2", messages=[{"role": "user", "content": "A pet"}],
                                           response_format=Pet, max_tokens=120, temperature=1.0, seed=2)
    pet = parsed.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.age <= 30 and len(pet.name) <= 8


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def test_tool_calls_by_a_named_function_or_required(client):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    named = client.chat.completions.create(model="tandem-tiny-qwen2", messages=messages, tools=[WEATHER, CLOCK],
                                           max_tokens=60, temperature=1.0, seed=4,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls
    assert named.choices[0].message.content is None and call.function.name == "get_weather"
    assert named.choices[0].finish_reason == "stop"  # (OpenAI's, for a named function: its call is the only answer)
    assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")
    streamed = list(client.chat.completions.create(
        model="tandem-tiny-qwen2", messages=messages, tools=[WEATHER, CLOCK], max_tokens=60, temperature=1.0,
        seed=4, stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in streamed for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments  # seeded: the same
    assert streamed[-1].choices[0].finish_reason == "stop"
    # One call (a random model may go on adding calls to an open list until the length cuts it):
    required = client.chat.completions.create(model="tandem-tiny-qwen2", messages=messages, tools=[WEATHER, CLOCK],
                                              max_tokens=150, temperature=1.0, seed=5, tool_choice="required",
                                              parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1  # (as OpenAI's and vLLM's; was "stop")
    assert all(c.function.name in ("get_weather", "get_time") and isinstance(json.loads(c.function.arguments), dict)
               for c in calls)
    # Streamed with logprobs, the calls come at the end and every token's logprob on the way (they were dropped).
    chunks = list(client.chat.completions.create(
        model="tandem-tiny-qwen2", messages=messages, tools=[WEATHER, CLOCK], max_tokens=150, temperature=1.0,
        seed=5, tool_choice="required", parallel_tool_calls=False, stream=True, logprobs=True,
        stream_options={"include_usage": True}))
    logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert len(logprobs) == chunks[-1].usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # The next turn: the call and its answer go back into the prompt.
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "12 C"}]
    answer = client.chat.completions.create(model="tandem-tiny-qwen2", messages=history, tools=[WEATHER],
                                            tool_choice="none", max_tokens=8)
    assert answer.choices[0].message.tool_calls is None and answer.usage.completion_tokens >= 1


def test_chat_logprobs_bytes_are_each_tokens_own(client):
    """A token holding part of a character gives its own bytes (it gave its text's,
    the replacement character's 239, 191, 189), so a client rebuilds the answer
    from them: here an emoji and CJK characters, held by a pattern and split across
    tokens by this tokenizer."""
    chat = client.chat.completions.create(model="tandem-tiny-qwen2", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=24, logprobs=True, top_logprobs=2,
                                          extra_body={"guided_regex": "😀漢字"})
    choice = chat.choices[0]
    assert choice.message.content == "😀漢字"
    pieces = [bytes(lp.bytes) for lp in choice.logprobs.content]
    assert b"".join(pieces) == "😀漢字".encode()
    assert any(_is_partial(piece) for piece in pieces)  # (else this would prove nothing)
    assert all(len(lp.top_logprobs) == 2 for lp in choice.logprobs.content)


def _is_partial(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return True
    return False


def test_tool_calls_the_model_chooses_under_auto(client):
    """tool_choice "auto" (OpenAI's default with tools): the model's own
    `<tool_call>` blocks are its calls, the rest its text. A random model does not
    write one by itself, so the answer is held by a pattern (vLLM's guided_regex)
    to a sentence and a block; the parse is then checked whole and streamed."""
    pattern = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "[A-Z][a-z]{1,8}", "unit": "celsius"\}\}\n</tool_call>')
    ask = {"model": "tandem-tiny-qwen2", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
           "tools": [WEATHER, CLOCK], "max_tokens": 200, "temperature": 1.0, "seed": 8,
           "extra_body": {"guided_regex": pattern}}
    whole = client.chat.completions.create(**ask).choices[0]
    [call] = whole.message.tool_calls
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert re.fullmatch("[A-Z][a-z]{1,8}", json.loads(call.function.arguments)["city"])
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    assert [(d.function.name, d.function.arguments) for each in deltas for d in each.tool_calls or ()] == [
        (call.function.name, call.function.arguments)]  # seeded: the same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Free to choose, this model writes text: it comes back as text, the tools in its prompt.
    free = client.chat.completions.create(**{**ask, "extra_body": {}, "max_tokens": 12})
    bare = client.chat.completions.create(**{**ask, "extra_body": {}, "max_tokens": 1, "tools": None})
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content
    assert free.choices[0].finish_reason == "length" and free.usage.prompt_tokens > bare.usage.prompt_tokens + 50

    class GetWeather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=10)

    # A strict tool (openai.pydantic_function_tool's): the answer is held (tests/test_hermes_calls.py), text still text.
    strict = client.chat.completions.create(**{**ask, "extra_body": {}, "max_tokens": 12,
                                               "tools": [openai.pydantic_function_tool(GetWeather)]})
    assert strict.choices[0].message.tool_calls is None and strict.choices[0].message.content
    # With a response_format too (an OpenAI Agents SDK agent with an output type): calls, or text of the format.
    summary = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 8}}, "required": ["summary"]}
    agent = client.chat.completions.create(**{**ask, "extra_body": {}, "max_tokens": 200, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": summary}},
        "tools": [openai.pydantic_function_tool(GetWeather)]}).choices[0]
    if agent.message.tool_calls:
        assert agent.finish_reason == "tool_calls" and agent.message.content is None
        assert {c.function.name for c in agent.message.tool_calls} == {"GetWeather"}
    else:
        assert len(json.loads(agent.message.content)["summary"]) <= 8 and agent.finish_reason == "stop"


def test_tool_choices_that_cannot_be_served_are_refused(base_url):
    chat = {"model": "tandem-tiny-qwen2", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    for extra, message in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
                           ({"tool_choice": "required", "guided_regex": "a"}, "give one way")):
        response = httpx.post(f"{base_url}/v1/chat/completions", json={**chat, **extra})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    response = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "tools": [WEATHER]})
    assert response.status_code == 400 and "tools is not supported" in response.text


def test_greedy_over_http_equals_the_offline_engine(base_url, client):
    llm = LLM(ensure_checkpoint("tiny", "qwen2"), **ENGINE)
    prompts = ["The quick brown fox", "Serving models on Ray", "a" * 300, "中文 and émoji 🙂"]
    offline = llm.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    for prompt, expected in zip(prompts, offline):
        response = httpx.post(f"{base_url}/generate", json={
            "text": prompt, "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}})
        assert response.json()["output_ids"] == expected.token_ids
        completion = client.completions.create(
            model="tandem-tiny-qwen2", prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
        assert completion.choices[0].text == expected.text
    conversations = [[{"role": "user", "content": prompt}] for prompt in prompts[:2]]
    tools = [WEATHER]  # (rendered by the template; the answers are text: the greedy model calls nothing)
    for conversation, expected in zip(conversations, llm.chat(conversations, SamplingParams(
            max_new_tokens=12, temperature=0, ignore_eos=True), tools=tools)):
        chat = client.chat.completions.create(model="tandem-tiny-qwen2", messages=conversation, tools=tools,
                                              max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content == expected.text.strip()
        assert chat.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_openai_completions(client):
    completion = client.completions.create(model="tandem-tiny-qwen2", prompt="Once upon", max_tokens=8,
                                           temperature=0, logprobs=2, seed=3)
    choice = completion.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert completion.usage.completion_tokens == len(choice.logprobs.token_logprobs) <= 8
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    # OpenAI's legacy logprobs always have the chosen token's among the best: with logprobs 0, only it
    sampled = client.completions.create(model="tandem-tiny-qwen2", prompt="Once upon", max_tokens=8,
                                        temperature=1.0, logprobs=0, seed=3).choices[0].logprobs
    assert sampled.top_logprobs == [{token: logprob} for token, logprob in zip(sampled.tokens, sampled.token_logprobs)]


@pytest.mark.parametrize("seed", [4, 8, 12])
def test_openai_completions_streaming(client, seed):
    """A stream gives the text and logprobs the whole response gives: every token's
    entry (a token whose text is held back, part of a character or maybe of a stop
    string, still has its chunk: most of these streams have such a token) and
    text_offsets that run on across chunks."""
    request = dict(model="tandem-tiny-qwen2", prompt="Stream me", max_tokens=40, temperature=1.0, seed=seed,
                   logprobs=1, stop=["zz"], extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(stream=True, **request))
    whole = client.completions.create(**request).choices[0]
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "length"
    logprobs = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for lp in logprobs for t in lp.tokens] == whole.logprobs.tokens and len(whole.logprobs.tokens) == 40
    assert [o for lp in logprobs for o in lp.text_offset] == whole.logprobs.text_offset
    assert whole.logprobs.text_offset == [sum(map(len, whole.logprobs.tokens[:i])) for i in range(40)]


def test_openai_chat_and_chat_streaming(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model="tandem-tiny-qwen2", messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens > 5
    stream = client.chat.completions.create(model="tandem-tiny-qwen2", messages=messages, max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_sse_ends_with_done(base_url):
    with httpx.stream("POST", f"{base_url}/v1/completions",
                      json={"prompt": "x", "max_tokens": 3, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert all(json.loads(line[6:]) for line in lines[:-1])


def test_models_health_metrics_openapi(base_url, client):
    assert [m.id for m in client.models.list().data] == ["tandem-tiny-qwen2"]
    card = httpx.get(f"{base_url}/v1/models").json()["data"][0]
    assert time.time() - 3600 < card["created"] <= time.time()  # when the replica started (it said 1970)
    assert card["max_model_len"] == httpx.post(f"{base_url}/tokenize", json={"prompt": "x"}).json()["max_model_len"]
    assert client.models.retrieve("tandem-tiny-qwen2").model_dump(exclude_none=True) == card
    missing = httpx.get(f"{base_url}/v1/models/gpt-4o")
    assert missing.status_code == 404 and "not found" in missing.json()["error"]["message"]
    health = httpx.get(f"{base_url}/health").json()
    assert health["status"] == "ready" and health["pools"] == ["decode", "prefill"]
    probed = httpx.head(f"{base_url}/health")  # (as load balancers probe: it was a 405)
    assert probed.status_code == 200 and probed.content == b""
    deep = httpx.get(f"{base_url}/health_generate", timeout=60)  # one token through P, the KV transfer and D
    assert deep.status_code == 200 and deep.json()["status"] == "ok" and deep.json()["seconds"] > 0, deep.text
    served = client.completions.create(model="tandem-tiny-qwen2", prompt="count me", max_tokens=2)  # what is counted
    assert served.usage.completion_tokens >= 1
    metrics = httpx.get(f"{base_url}/metrics").text
    assert 'tandem_requests_total{outcome="ok"}' in metrics
    assert "tandem_ttft_seconds_bucket" in metrics and "tandem_kv_blocks_used" in metrics
    assert 'tandem_prompt_tokens_total{source="computed"}' in metrics
    assert 'tandem_kv_transfer_blocks_total{kind="sent"}' in metrics
    assert 'tandem_handshakes_waiting{role="decode"' in metrics
    # A worker's own counts since it started are counters (rate() and increase() read them), not gauges
    for name in ("preemptions_total", "draft_tokens_total", "draft_tokens_accepted_total"):
        assert f"# TYPE tandem_{name} counter" in metrics and f'tandem_{name}{{role="decode"' in metrics
    schema = httpx.get(f"{base_url}/openapi.json").json()
    assert {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"} <= set(schema["paths"])


def test_sglangs_model_info_and_cache_flush(base_url):
    """/get_model_info names the checkpoint; /flush_cache (vLLM's
    /reset_prefix_cache) makes every worker forget its cached prefixes: a prompt
    cached on its second run is computed anew on its third; /version."""
    info = httpx.get(f"{base_url}/get_model_info").json()
    assert info["is_generation"] is True and info["served_model_name"] == "tandem-tiny-qwen2"
    assert (Path(info["model_path"]) / "config.json").is_file() and info["tokenizer_path"] == info["model_path"]
    body = {"text": "a prefix to flush " * 12, "max_new_tokens": 1, "temperature": 0}
    cached = [httpx.post(f"{base_url}/generate", json=body).json()["meta_info"]["cached_tokens"] for _ in range(2)]
    flushed = httpx.post(f"{base_url}/flush_cache")
    assert flushed.status_code == 200, flushed.text
    assert flushed.json()["workers"] == sorted(m.worker_id for m in pool_members(ARGS["pool_name"]))
    after = httpx.post(f"{base_url}/generate", json=body).json()["meta_info"]["cached_tokens"]
    assert cached[0] == 0 and cached[1] >= 32 and after == 0, (cached, after)
    assert httpx.post(f"{base_url}/reset_prefix_cache").json()["workers"] == flushed.json()["workers"]  # vLLM's name
    assert httpx.get(f"{base_url}/flush_cache").status_code == 200  # (SGLang's takes GET too: it was a 405)
    assert httpx.get(f"{base_url}/version").json() == {"version": "0.1.0"}


def test_abort_request_ends_the_named_requests_as_they_stand(base_url):
    """SGLang's /abort_request: by a /generate rid (each of its n choices), by an
    OpenAI completion's id, or every request (`abort_all`); each answers with
    what it had made, finish_reason {"type": "abort"} (OpenAI's: null); a request
    of another name goes on, and both workers are freed."""

    async def data_lines(response):
        async for line in response.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                yield json.loads(line[5:])

    async def scenario():
        endless = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            other = asyncio.ensure_future(http.post("/generate", json={"text": "another name", "rid": "keep",
                                                                       "max_new_tokens": 150, "ignore_eos": True}))
            async with http.stream("POST", "/generate", json={"text": "abort me", "rid": "pair", "n": 2,
                                                              **endless}) as pair, \
                    http.stream("POST", "/v1/completions", json={"prompt": "abort me too", "max_tokens": 200,
                                                                  "ignore_eos": True, "stream": True}) as openai_way:
                pair_chunks, openai_chunks = data_lines(pair), data_lines(openai_way)
                started = set()
                async for chunk in pair_chunks:  # both choices decoding
                    started.add(chunk["index"])
                    if len(started) == 2:
                        break
                completion_id = (await anext(openai_chunks))["id"]
                # Both at once: one after the other, the second came about 0.8 s into 200 tokens
                # of a module whose limit is 200, and the completion could have ended by itself.
                by_rid, by_id = [answer.json() for answer in await asyncio.gather(
                    http.post("/abort_request", json={"rid": "pair"}),
                    http.post("/abort_request", json={"rid": completion_id}))]
                pair_last = {chunk["index"]: chunk async for chunk in pair_chunks}
                openai_last = [chunk async for chunk in openai_chunks][-1]
            other = await other  # before abort_all
            async with http.stream("POST", "/generate", json={"text": "one of all", **endless}) as one, \
                    http.stream("POST", "/generate", json={"text": "another of all", **endless}) as another:
                streams = [data_lines(one), data_lines(another)]
                for chunks in streams:  # each decoding
                    await anext(chunks)
                by_all = (await http.post("/abort_request", json={"abort_all": True})).json()
                alls = [[chunk async for chunk in chunks][-1] for chunks in streams]
            return by_rid, by_id, by_all, pair_last, openai_last, alls, other

    by_rid, by_id, by_all, pair_last, openai_last, alls, other = asyncio.run(scenario())
    assert (by_rid, by_id, by_all) == ({"aborted": 2}, {"aborted": 1}, {"aborted": 2})
    assert sorted(pair_last) == [0, 1]
    for chunk in pair_last.values():
        assert chunk["meta_info"]["finish_reason"] == {"type": "abort"}
        assert 1 <= chunk["meta_info"]["completion_tokens"] == len(chunk["output_ids"]) < 200
    assert openai_last["choices"][0]["finish_reason"] is None
    for last in alls:
        assert last["meta_info"]["finish_reason"] == {"type": "abort"} and len(last["output_ids"]) >= 1
    assert other.status_code == 200 and len(other.json()["output_ids"]) == 150
    assert other.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 150}
    wait_workers_idle(ARGS["pool_name"])


def test_profiling_is_off_without_a_profile_dir(base_url):
    response = httpx.post(f"{base_url}/start_profile", json={"num_steps": 2})
    assert response.status_code == 400 and "profiling is off: set profile_dir" in response.json()["error"]["message"]


def test_a_redeploy_that_changes_what_the_workers_run_is_refused_and_the_app_serves_on(base_url):
    """`serve run`/`serve deploy` of the manifest with an engine setting changed:
    the app builder refuses it, naming the setting and how to apply it, before
    Serve touches the running deployment, which goes on serving
    (cluster/pool_settings.py; the replica's own check: tests/test_pool_sizes.py)."""
    from ray import serve

    from cluster.app import build_app

    changed = {**ARGS, "engine": {**ENGINE, "prefill_chunk_size": 32}}
    with pytest.raises(ValueError, match=r"changes engine\.prefill_chunk_size: 64 -> 32: to apply them, tear"):
        serve.run(build_app(changed), name="main", route_prefix="/main", blocking=False)
    assert httpx.get(f"{base_url}/health").json()["status"] == "ready"
    response = httpx.post(f"{base_url}/generate", json={"text": "still here", "max_new_tokens": 2})
    assert response.status_code == 200, response.text


def unhandled_errors_logged() -> int:
    """How many times cluster/app.py's handler of unexpected errors has logged one
    (Serve's replicas write their stderr to the session's worker logs)."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return sum(path.read_text(errors="replace").count("unhandled error") for path in logs.glob("worker-*.err"))


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_frees_both_workers(base_url, n):
    """Streams closed by their clients (OpenAI's and SGLang's) end their requests on
    both workers, and none of them is an error on the scheduler's side."""
    logged = unhandled_errors_logged()
    bodies = [("/generate", {"text": "keep going", "max_new_tokens": 200, "n": n, "ignore_eos": True}),
              ("/v1/completions", {"prompt": "keep going", "max_tokens": 200, "n": n, "ignore_eos": True})]
    for attempt in range(6):
        path, body = bodies[attempt % 2]
        with httpx.stream("POST", f"{base_url}{path}", json={**body, "stream": True}) as response:
            for index, _ in enumerate(response.iter_lines()):
                if index >= 4:
                    break
    wait_workers_idle(ARGS["pool_name"])
    assert unhandled_errors_logged() == logged


def test_requests_right_after_a_prefill_worker_dies_are_retried_and_served(base_url):
    """A P dies while the scheduler still lists it: a request that lands on it fails
    before its first token and is retried on the other P; every request is served."""
    victim = next(m for m in pool_members(ARGS["pool_name"]) if m.role == "prefill")
    ray.kill(victim.handle)
    for index in range(4):
        body = {"text": f"right after {index}", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        response = httpx.post(f"{base_url}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert len(response.json()["output_ids"]) == 3
    deadline = time.monotonic() + 120  # the pool replaces the dead P, and the new one is ready
    while True:
        prefill_ids = {m.worker_id for m in pool_members(ARGS["pool_name"]) if m.role == "prefill"}
        if victim.worker_id not in prefill_ids and len(prefill_ids) == ARGS["prefill"]["replicas"]:
            break
        assert time.monotonic() < deadline, prefill_ids
        time.sleep(1)
    wait_workers_idle(ARGS["pool_name"], timeout_s=60)


def test_scheduler_replica_restart_keeps_the_pools(base_url):
    before = sorted(m.worker_id for m in pool_members(ARGS["pool_name"]))
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"] and "main" in a["name"]]
    assert replicas
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            response = httpx.post(f"{base_url}/generate", json={"text": "again", "max_new_tokens": 3}, timeout=30)
            if response.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    assert response.status_code == 200
    assert sorted(m.worker_id for m in pool_members(ARGS["pool_name"])) == before


def test_a_killed_pool_manager_is_replaced_and_serving_resumes(base_url):
    """The pool manager dies for good, and its workers with it: the scheduler starts
    a new one, /health says starting meanwhile, and requests are served again by new
    workers; nothing of the old pool is left running."""
    old = pool_members(ARGS["pool_name"])
    ray.kill(ray.get_actor(ARGS["pool_name"], namespace="tandem"), no_restart=True)
    deadline = time.monotonic() + 180
    response = None
    while time.monotonic() < deadline:
        try:
            response = httpx.post(f"{base_url}/generate", json={"text": "after", "max_new_tokens": 3}, timeout=30)
            if response.status_code == 200:
                break
            assert response.status_code == 503, response.text  # starting: a clear answer, never a 500
        except httpx.HTTPError:
            pass
        time.sleep(1)
    assert response is not None and response.status_code == 200, response and response.text
    new = pool_members(ARGS["pool_name"])
    assert {m.role for m in new} == {"prefill", "decode"}
    for member in old:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(member.handle.ping.remote(), timeout=30)
    wait_workers_idle(ARGS["pool_name"])


def test_fuzzed_requests_from_the_openapi_schema_never_get_a_5xx(base_url):
    """Hostile input, generated from the server's own OpenAPI schema (schemathesis),
    bounded in count: every answer is < 500 and the server keeps serving."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_dict(httpx.get(f"{base_url}/openapi.json").json())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 6
    for operation in operations:

        @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(base_url=base_url, timeout=60)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])

        check()
    assert httpx.post(f"{base_url}/generate", json={"text": "alive", "max_new_tokens": 2}).status_code == 200
    wait_workers_idle(ARGS["pool_name"])


def test_a_stopping_replica_finishes_the_stream_it_serves(base_url):
    """Serve stops a scheduler replica (here the app is deleted; a redeploy or fewer
    replicas stop one the same way) while it streams: the stream runs to its last
    token and [DONE], and the stop waits for it (cluster/app.py's build_app). The
    module's last test: the app is gone after it."""
    lines, started = [], threading.Event()

    def stream() -> None:
        body = {"prompt": "keep going", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    serve.delete("main")  # returns once the replica has stopped
    assert not reader.is_alive()  # the stream had ended by then
    reader.join()
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["usage"]["completion_tokens"] == 200
    assert json.loads(lines[-3])["choices"][0]["finish_reason"] == "length"
