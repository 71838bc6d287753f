"""Concurrent requests over real HTTP get what the offline engine gives each alone
(hypothesis): batches of fuzzed completions (every sampling field, seeded, token
prompts that share a prefix now and then) sent at once to a disaggregated app whose
decode worker has little KV memory, each answer's text and finish reason equal to
`LLM.generate`'s for the same request. A request's tokens depend on its seed alone,
not on the batch it shares, the prefix cache, delta transfer or overlapped decode
(README), so any difference is a bug of the path between. Then every worker is
back to idle. A burst larger than D's KV waits for room instead of failing."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.llm import LLM
from actors.model_builder import ensure_checkpoint
from actors.sampling_params import InvalidRequestError, SamplingParams
from tests.conftest import served_app
from tests.test_engine_fuzz import requests
from tests.test_serve_app import wait_workers_idle

ENGINE = {"block_size": 16, "prefill_chunk_size": 64, "max_num_batched_tokens": 256, "num_kv_blocks": 64}
MAX_NEW_TOKENS = 200
ARGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "mode": "disaggregated",
    "channel": "gloo",
    "engine": ENGINE,
    "limits": {"max_prompt_tokens": 600, "max_new_tokens": MAX_NEW_TOKENS},
    "slo": {"early_rejection": False},
    # A handshake waits in D's line up to this: the burst's last requests wait for
    # three of theirs to end, under the 10 s default on a quiet machine, not always
    # on a loaded one (the burst's point is the waiting, not the bound).
    "timeouts": {"handshake_s": 60},
    "pool_name": "test-pool-concurrency",
}


@pytest.fixture(scope="module")
def base_url(serve_port):
    yield from served_app("concurrency", ARGS, serve_port)


def completion_body(prompt: list[int], fields: dict) -> dict:
    """The fuzzed fields in /v1/completions' names (every one explicit: the
    checkpoint's defaults apply to neither side)."""
    body = dict(prompt=prompt, max_tokens=fields["max_new_tokens"], min_tokens=fields["min_new_tokens"],
                logit_bias={str(token): bias for token, bias in fields["logit_bias"]},
                **{name: fields[name] for name in ("temperature", "top_p", "min_p", "top_k", "seed", "stop_token_ids",
                                                   "ignore_eos", "repetition_penalty", "frequency_penalty",
                                                   "presence_penalty", "bad_words")})
    if fields["allowed_token_ids"]:
        body["allowed_token_ids"] = fields["allowed_token_ids"]
    if fields.get("regex") is not None:  # structured output, in vLLM's name; with logprobs asked for, no
        body["guided_regex"] = fields["regex"]  # jump-forward: the answer's tokens then differ (README)
        body["logprobs"] = fields["logprobs"]
    return body


def test_concurrent_requests_get_what_each_gets_alone(base_url):
    llm = LLM(ensure_checkpoint("tiny", "qwen2"), **{**ENGINE, "num_kv_blocks": 512})
    counts = {"requests": 0}

    @settings(max_examples=8, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(requests(), min_size=2, max_size=16), prefix=st.lists(st.integers(3, 2000), max_size=40),
           longer=st.sampled_from([1, 10, 20]))
    def check(batch, prefix, longer):
        accepted = []
        for index, (prompt, fields) in enumerate(batch):
            fields["seed"] = index if fields["seed"] is None else fields["seed"]
            fields["max_new_tokens"] *= longer
            try:
                params = SamplingParams(**fields)
                llm.engine.validate(prefix + prompt, params)
            except InvalidRequestError:
                continue
            if params.max_new_tokens <= MAX_NEW_TOKENS:
                accepted.append((prefix + prompt, fields, params))
        expected = llm.generate([prompt for prompt, _, _ in accepted], [params for _, _, params in accepted])

        async def send_all():
            async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json=completion_body(prompt, fields))
                                              for prompt, fields, _ in accepted))

        for response, alone in zip(asyncio.run(send_all()), expected, strict=True):
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (alone.text, alone.finish_reason)
            counts["requests"] += len(accepted)

    check()
    assert counts["requests"] >= 20, counts
    wait_workers_idle(ARGS["pool_name"])


def test_a_burst_beyond_the_decode_workers_kv_waits_for_room(base_url):
    """Twelve 300-token prompts at once, each to write 150 tokens, where D's KV holds
    about three such requests: D refuses the others for now, and their handshakes
    ask again until finished requests free blocks. (They were answered 503, "no
    workers are ready", after one retry.)"""

    async def burst():
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": list(range(3 + i, 303 + i)), "max_tokens": 150, "ignore_eos": True, "temperature": 0})
                for i in range(12)))

    for response in asyncio.run(burst()):
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 150
    wait_workers_idle(ARGS["pool_name"])
