"""Early rejection and the API key over HTTP, on a colocated deployment whose SLO
no request can meet: every admitted-looking request is refused before any prefill."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import ray

from tests.conftest import served_app

ARGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "mode": "colocated",
    "colocated": {"replicas": 1, "num_cpus": 1},
    "engine": {"block_size": 16, "num_kv_blocks": 256},
    "slo": {"ttft_ms": 0.001, "tbt_ms": 1000},
    "api_key": "s3cret",
    "pool_name": "test-pool-strict",
}
AUTH = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def base_url(serve_port):
    yield from served_app("strict", ARGS, serve_port)


def test_health_needs_no_key_but_everything_else_does(base_url):
    assert httpx.get(f"{base_url}/health").status_code == 200
    for path in ("/v1/models", "/metrics"):
        response = httpx.get(f"{base_url}{path}")
        assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
    for wrong_key in ("Bearer nope", "Bearer s3cre", "Bearer s3crett", "Bearer s3creT", "s3cret", b"Bearer s3cr\xe9t"):
        wrong = httpx.post(f"{base_url}/generate", json={"text": "x"}, headers={"Authorization": wrong_key})
        assert wrong.status_code == 401, (wrong_key, wrong.text)
    assert httpx.post(f"{base_url}/flush_cache").status_code == 401
    # SLO admission turns every request away here (ttft_ms 0.001): a deep health
    # probe says the pools are busy, not that the server is down.
    probe = httpx.get(f"{base_url}/health_generate", headers=AUTH, timeout=60)
    assert probe.status_code == 200 and probe.json()["status"] == "busy", probe.text
    assert "predicted TTFT" in probe.json()["message"]
    assert httpx.get(f"{base_url}/v1/models", headers=AUTH).status_code == 200


def test_a_request_that_cannot_meet_its_slo_is_rejected_early(base_url):
    response = httpx.post(f"{base_url}/generate", json={"text": "hello " * 50, "max_new_tokens": 8}, headers=AUTH)
    assert response.status_code == 429
    assert int(response.headers["Retry-After"]) >= 1
    error = response.json()["error"]
    assert error["type"] == "slo_rejection"
    assert error["target_ttft_ms"] == 0.0 and error["predicted_ttft_ms"] > 0
    assert "predicted TTFT" in error["message"] and "exceeds the SLO" in error["message"]
    # No prefill was spent on it: the worker never ran a request.
    pool = ray.get_actor(ARGS["pool_name"], namespace="tandem")
    [member] = ray.get(pool.list_members.remote())
    stats = ray.get(member.handle.stats.remote())
    assert stats.num_running == 0 and stats.num_used_blocks == 0
    metrics = httpx.get(f"{base_url}/metrics", headers=AUTH).text
    assert "tandem_rejections_total" in metrics


def test_a_background_response_refused_at_admission_is_failed_and_frees_its_conversation(base_url):
    """Its POST answered already (queued), the refusal is the response's
    failure: polled, or streamed as `response.created` and `response.queued`
    (the response queued), then `response.failed`
    (replayed the same), and
    the conversation it was on takes the next response (refused too, but not
    as locked)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="s3cret", max_retries=0)
    conversation = client.conversations.create()
    queued = client.responses.create(input="hello " * 50, max_output_tokens=8, background=True,
                                     conversation=conversation.id)
    deadline = time.monotonic() + 30
    while (answer := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, answer.status
        time.sleep(0.1)
    assert answer.status == "failed" and answer.error.code == "slo_rejection", answer.error
    with pytest.raises(openai.RateLimitError):  # (refused again: its turn was freed with its failure)
        client.responses.create(input="hello " * 50, max_output_tokens=8, conversation=conversation.id)
    assert client.conversations.items.list(conversation.id).data == [], "a failed response adds nothing"
    events = list(client.responses.create(input="hello " * 50, max_output_tokens=8, background=True, stream=True))
    assert [event.type for event in events] == ["response.created", "response.queued", "response.failed"]
    assert events[0].response.status == "queued"
    assert events[2].response.error.code == "slo_rejection" and events[2].response.status == "failed"
    replayed = list(client.responses.retrieve(events[2].response.id, stream=True))
    assert [event.model_dump() for event in replayed] == [event.model_dump() for event in events]
