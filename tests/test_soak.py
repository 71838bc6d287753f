"""Unit tests of the soak benchmark's pure parts: the request mix is valid input to
the API, responses are judged by the endpoint's contract, RSS growth against its
tolerance. No cluster, no timings."""

from __future__ import annotations

import json
import random

import pytest

from actors.sampling_defaults import SamplingDefaults
from benchmarks.soak_probes import MIB, memory_growth, slope_bytes_per_min
from benchmarks.soak_traffic import Endpoint, RawResponse, SoakRequest, draw_request
from benchmarks.soak_verdict import Outcome, judge
from cluster import openai_format as fmt
from cluster.api_models import ChatBody, CompletionBody
from cluster.sglang_body import GenerateBody


# ---- the mix ------------------------------------------------------------------------------
def test_the_mix_is_seeded_and_valid_for_the_api():
    def draw(seed: int) -> list[SoakRequest]:
        rng = random.Random(seed)
        return [draw_request(rng, i, 2048) for i in range(300)]

    requests = draw(3)
    assert [r.body for r in requests] == [r.body for r in draw(3)]
    models = {"/generate": GenerateBody, "/v1/completions": CompletionBody, "/v1/chat/completions": ChatBody}
    for request in requests:
        body = models[request.endpoint.path].model_validate(request.body)
        assert body.stream == request.endpoint.is_stream
        openai = SamplingDefaults()
        params = body.sampling(16, openai)
        params = params[0] if isinstance(body, GenerateBody) else params
        assert params.max_new_tokens == request.max_new_tokens and params.stop == request.stop
        assert len(request.stop) <= 8  # manifests/local.yaml: max_stop_sequences
        assert (request.num_prompt_tokens or 0) <= 1024
        if request.cancel_after_events is not None:
            assert request.endpoint.is_stream and request.max_new_tokens >= 64
        if request.abort_after_events is not None:  # a single-prompt stream, named for /generate
            assert request.endpoint.is_stream and not request.endpoint.is_batch and request.max_new_tokens >= 64
            assert request.cancel_after_events is None
            assert request.body.get("rid", f"soak-{request.index}") == f"soak-{request.index}"
            assert ("rid" in request.body) == (request.endpoint.path == "/generate")
    assert {r.endpoint for r in requests} == set(Endpoint)
    batches = [r for r in requests if r.endpoint.is_batch]
    assert {r.num_answers for r in batches} >= {2, 4, 6} and all(r.num_prompt_tokens is None for r in batches)
    assert any(r.cancel_after_events for r in requests) and any(r.stop for r in requests)
    assert {r.endpoint for r in requests if r.abort_after_events} == {
        Endpoint.GENERATE_STREAM, Endpoint.COMPLETIONS_STREAM, Endpoint.CHAT_STREAM}


# ---- judging ------------------------------------------------------------------------------
def request(endpoint: Endpoint, max_new_tokens: int = 4, stop=(), include_usage=False, cancel_after=None,
            abort_after=None):
    return SoakRequest(0, endpoint, {}, max_new_tokens, tuple(stop), include_usage, cancel_after, abort_after)


def generate_event(text: str, ids: list[int], reason: str | None) -> str:
    meta = {"prompt_tokens": 8, "completion_tokens": len(ids), "cached_tokens": 0,
            "finish_reason": None if reason is None else {"type": reason}}
    return json.dumps({"text": text, "output_ids": ids, "meta_info": meta})


def sse_payloads(*payloads) -> list[str]:
    """What the client keeps of `fmt.sse(...)` lines: the text after `data: `."""
    return [fmt.sse(p).removeprefix("data: ").strip() for p in payloads]


def streamed(events: list[str], cancelled: bool = False, abort_status: int | None = None) -> RawResponse:
    return RawResponse(http_status=200, events=events, is_cancelled=cancelled, abort_status=abort_status)


GENERATE_STREAM = [generate_event("ab", [5], None), generate_event("abcd", [5, 6], None),
                   generate_event("abcdef", [5, 6, 7, 8], "length"), "[DONE]"]


def test_a_complete_generate_stream_is_ok():
    verdict = judge(request(Endpoint.GENERATE_STREAM), streamed(GENERATE_STREAM))
    assert verdict.outcome is Outcome.OK, verdict.reason
    assert (verdict.finish_reason, verdict.num_output_tokens) == ("length", 4)


@pytest.mark.parametrize("events, why", [
    (GENERATE_STREAM[:-1], "without [DONE]"),
    (GENERATE_STREAM[:2] + ["[DONE]"], "finish reason None"),
    (GENERATE_STREAM[:1] + sse_payloads({"error": {"message": "worker died"}}) + ["[DONE]"], "error event"),
    (GENERATE_STREAM[:2] + ["{not json"] + GENERATE_STREAM[2:], "JSONDecodeError"),
    ([generate_event("ab", [5, 6], "length"), "[DONE]"], "after 2 of 4 tokens"),
])
def test_a_broken_generate_stream_fails(events, why):
    verdict = judge(request(Endpoint.GENERATE_STREAM), streamed(events))
    assert verdict.outcome is Outcome.FAILED and why in verdict.reason


def test_a_stream_the_client_hung_up_on_is_cancelled_unless_it_held_an_error():
    cancel = request(Endpoint.GENERATE_STREAM, cancel_after=2)
    assert judge(cancel, streamed(GENERATE_STREAM[:2], cancelled=True)).outcome is Outcome.CANCELLED
    error = sse_payloads({"error": {"message": "boom", "type": "worker_error"}})
    assert judge(cancel, streamed(GENERATE_STREAM[:1] + error, cancelled=True)).outcome is Outcome.FAILED


def test_a_stream_its_client_aborted_ends_as_aborted_or_complete():
    """An abort ends the stream complete but early: finish reason abort (OpenAI's
    null), fewer tokens than asked for; a stream that ended before the abort
    landed is complete. Only a request its client aborted may end so."""
    aborted = generate_event("abc", [5, 6], "abort")
    abort = request(Endpoint.GENERATE_STREAM, abort_after=1)
    verdict = judge(abort, streamed(GENERATE_STREAM[:1] + [aborted, "[DONE]"], abort_status=200))
    assert verdict.outcome is Outcome.ABORTED and verdict.num_output_tokens == 2, verdict.reason
    assert judge(abort, streamed(GENERATE_STREAM, abort_status=200)).outcome is Outcome.OK  # ended first
    refused = judge(abort, streamed(GENERATE_STREAM[:1] + [aborted, "[DONE]"], abort_status=400))
    assert refused.outcome is Outcome.FAILED and "/abort_request answered 400" in refused.reason
    unasked = judge(request(Endpoint.GENERATE_STREAM), streamed(GENERATE_STREAM[:1] + [aborted, "[DONE]"]))
    assert unasked.outcome is Outcome.FAILED and "'abort'" in unasked.reason
    whole = judge(abort, streamed([generate_event("abcd", [5, 6, 7, 8], "abort"), "[DONE]"], abort_status=200))
    assert whole.outcome is Outcome.FAILED and "after all its 4 tokens" in whole.reason
    chat = request(Endpoint.CHAT_STREAM, max_new_tokens=5, include_usage=True, abort_after=1)
    assert judge(chat, streamed(chat_chunks(None, usage=True), abort_status=200)).outcome is Outcome.ABORTED


def batch_request(num_prompts: int, n: int, cancel_after=None) -> SoakRequest:
    body = {"input_ids": [[3, 4]] * num_prompts, "sampling_params": {"max_new_tokens": 4, "n": n}}
    return SoakRequest(0, Endpoint.GENERATE_BATCH_STREAM, body, 4, cancel_after_events=cancel_after)


def indexed(payload: str, index: int) -> str:
    return json.dumps({**json.loads(payload), "index": index})


def test_a_batch_stream_is_judged_answer_by_answer():
    """SGLang's batch (2 prompts x n=2): each answer's events by their index,
    interleaved; all four complete is ok, one missing or broken fails it."""
    answers = [[indexed(e, k) for e in GENERATE_STREAM[:-1]] for k in range(4)]
    interleaved = [e for step in zip(*answers) for e in step] + ["[DONE]"]
    verdict = judge(batch_request(2, 2), streamed(interleaved))
    assert verdict.outcome is Outcome.OK, verdict.reason
    assert (verdict.finish_reason, verdict.num_output_tokens) == ("length", 16)
    without_3 = [e for e in interleaved if '"index": 3' not in e]
    assert "no events for answers [3]" in judge(batch_request(2, 2), streamed(without_3)).reason
    assert "index 4 in a batch of 4" in judge(batch_request(2, 2), streamed(
        interleaved[:-1] + [indexed(GENERATE_STREAM[0], 4), "[DONE]"])).reason
    cut = [e for e in interleaved if not ('"index": 1' in e and '"length"' in e)]  # answer 1 never ends
    assert "finish reason None" in judge(batch_request(2, 2), streamed(cut)).reason
    assert judge(batch_request(2, 2, cancel_after=1), streamed(interleaved[:2], cancelled=True)).outcome \
        is Outcome.CANCELLED


def test_a_batch_body_is_a_list_of_answers():
    request_ = SoakRequest(0, Endpoint.GENERATE_BATCH, {"input_ids": [[3], [4], [5]], "sampling_params": {
        "max_new_tokens": 3}}, 3)
    answer = {"text": "abc", "output_ids": [5, 6, 7], "meta_info": {"completion_tokens": 3,
                                                                    "finish_reason": {"type": "length"}}}
    verdict = lambda b: judge(request_, RawResponse(http_status=200, body=json.dumps(b)))  # noqa: E731
    assert verdict([answer] * 3).outcome is Outcome.OK and verdict([answer] * 3).num_output_tokens == 9
    assert "a batch of 3 answered with" in verdict([answer] * 2).reason
    assert verdict(answer).outcome is Outcome.FAILED  # one answer for three prompts


def test_only_an_slo_rejection_counts_as_a_deliberate_429():
    slo = json.dumps({"error": {"message": "too slow", "type": "slo_rejection", "code": 429}})
    other = json.dumps({"error": {"message": "busy", "type": "rate_limited", "code": 429}})
    generate = request(Endpoint.GENERATE)
    assert judge(generate, RawResponse(http_status=429, body=slo)).outcome is Outcome.REJECTED
    assert judge(generate, RawResponse(http_status=429, body=other)).outcome is Outcome.FAILED
    assert judge(generate, RawResponse(http_status=503, body=slo)).outcome is Outcome.FAILED
    assert judge(generate, RawResponse(transport_error="ReadTimeout: ")).outcome is Outcome.FAILED


def test_non_streaming_bodies_are_checked_field_by_field():
    generate = request(Endpoint.GENERATE, max_new_tokens=3, stop=["zz"])
    meta = {"completion_tokens": 3, "finish_reason": {"type": "length"}}
    body = {"text": "abc", "output_ids": [5, 6, 7], "meta_info": meta}
    verdict = lambda b: judge(generate, RawResponse(http_status=200, body=json.dumps(b)))  # noqa: E731
    assert verdict(body).outcome is Outcome.OK
    assert verdict({**body, "meta_info": {**meta, "completion_tokens": 2}}).outcome is Outcome.FAILED
    assert verdict({**body, "text": "abzzc"}).outcome is Outcome.FAILED  # a stop string should have ended it
    assert verdict({"text": "abc", "meta_info": meta}).outcome is Outcome.FAILED
    assert judge(generate, RawResponse(http_status=200, body="<html>")).outcome is Outcome.FAILED

    completions = request(Endpoint.COMPLETIONS, max_new_tokens=4)
    done = fmt.completion_body("cmpl-1", "m", [("abc", "stop", None)], fmt.usage(8, 2), chat=False, created=0)
    assert judge(completions, RawResponse(http_status=200, body=json.dumps(done))).outcome is Outcome.OK
    # an aborted request
    cut = fmt.completion_body("cmpl-1", "m", [("abc", None, None)], fmt.usage(8, 2), chat=False, created=0)
    assert judge(completions, RawResponse(http_status=200, body=json.dumps(cut))).outcome is Outcome.FAILED


def chat_chunks(reason: str | None, usage: bool) -> list[str]:
    def chunk(text, why, first=False):
        return fmt.completion_chunk("c-1", "m", text, why, None, True, first, created=0)

    payloads = [chunk("", None, first=True), chunk("ab", None), chunk("c", reason)]
    if usage:
        payloads.append({"id": "c-1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
                         "usage": fmt.usage(8, 3)})
    return sse_payloads(*payloads) + ["[DONE]"]


def test_openai_streams_need_one_finish_reason_and_the_usage_asked_for():
    chat = request(Endpoint.CHAT_STREAM, max_new_tokens=3, include_usage=True)
    ok = judge(chat, streamed(chat_chunks("length", usage=True)))
    assert ok.outcome is Outcome.OK and ok.num_output_tokens == 3, ok.reason
    assert judge(chat, streamed(chat_chunks("length", usage=False))).outcome is Outcome.FAILED
    assert judge(chat, streamed(chat_chunks(None, usage=True))).outcome is Outcome.FAILED
    no_role = chat_chunks("stop", usage=True)[1:]
    assert judge(chat, streamed(no_role)).outcome is Outcome.FAILED
    completions = request(Endpoint.COMPLETIONS_STREAM, max_new_tokens=3)
    wrong_object = judge(completions, streamed(chat_chunks("stop", usage=False)))
    assert wrong_object.outcome is Outcome.FAILED and "text_completion" in wrong_object.reason


# ---- memory ----------------------------------------------------------------------------------
def test_memory_growth_allows_the_larger_of_the_two_tolerances():
    small = memory_growth(100 * MIB, 140 * MIB, 0.10, 50 * MIB)  # +40 MiB: under 50 MiB
    assert small["within"] and small["allowed_bytes"] == 50 * MIB
    large = memory_growth(1000 * MIB, 1090 * MIB, 0.10, 50 * MIB)  # +90 MiB: under 10%
    assert large["within"] and large["allowed_bytes"] == 100 * MIB
    assert not memory_growth(1000 * MIB, 1101 * MIB, 0.10, 50 * MIB)["within"]
    assert memory_growth(300 * MIB, 200 * MIB, 0.10, 50 * MIB)["growth_bytes"] == -100 * MIB


def test_slope_is_a_least_squares_fit_per_minute():
    assert slope_bytes_per_min([(0.0, 100), (30.0, 110), (60.0, 120)]) == pytest.approx(20.0)
    assert slope_bytes_per_min([(5.0, 100)]) is None
