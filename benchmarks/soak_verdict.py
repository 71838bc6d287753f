"""Judging one soak exchange: was the response complete, a deliberate rejection, a
deliberate cancellation, or a failure?

`judge(request, response) -> Verdict`, pure (no I/O, no clock). Outcomes:
- `REJECTED`: HTTP 429 whose JSON error has type `slo_rejection` (early admission);
- `CANCELLED`: the client hung up on purpose mid-stream, and every event it read
  before that was well formed (no error event);
- `ABORTED`: the client asked `/abort_request` to end its stream (answered 200),
  and the stream is complete as below but ended by the abort: finish reason
  `abort` (`/generate`) or null (OpenAI's), with fewer than `max_new_tokens`
  tokens (a stream that finished before the abort landed is `OK`);
- `OK`: HTTP 200 and a complete response of the endpoint's shape:
  - non-streaming: a JSON body with the expected fields (`/generate`: `text`,
    `output_ids`, `meta_info` with `finish_reason.type` and `completion_tokens`
    (a streamed chunk's `finish_reason` is null before the last), a batch a list
    of those, one an answer; completions: `object`,
    `choices[0].text`, `finish_reason`, `usage`);
  - streaming: every `data:` payload parses, none is an error, exactly one finish
    reason arrives (on the last output event; a batch's, each answer's on its
    last, the answers told apart by `index`, all of them there), and the stream
    ends with `[DONE]`; chat streams open with the assistant role;
  - in both: the finish reason is `length` or `stop`; the output has at most
    `max_new_tokens` tokens, exactly that many when it ended on `length` (where the
    count is known); the text holds none of the request's stop strings (generation
    ends at the first one, which is cut off); a batch's verdict is its first
    answer's, with the tokens of all;
- `FAILED`: anything else (other statuses, a 429 of another kind, transport errors,
  timeouts, malformed or truncated bodies), with the reason.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from benchmarks.soak_traffic import Endpoint, RawResponse, SoakRequest

FINISH_REASONS = ("length", "stop")


class Outcome(enum.Enum):
    OK = "ok"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str | None = None  # why it failed
    finish_reason: str | None = None  # of a complete response
    num_output_tokens: int | None = None  # None where the response does not say


class Malformed(Exception):
    """The response broke the endpoint's contract; the message says how."""


def judge(request: SoakRequest, response: RawResponse) -> Verdict:
    if response.transport_error is not None:
        return Verdict(Outcome.FAILED, f"transport: {response.transport_error}")
    if response.http_status == 429:
        if _error_type(response.body) == "slo_rejection":
            return Verdict(Outcome.REJECTED)
        return Verdict(Outcome.FAILED, f"429 that is not an SLO rejection: {(response.body or '')[:200]}")
    if response.http_status != 200:
        return Verdict(Outcome.FAILED, f"HTTP {response.http_status}: {(response.body or '')[:200]}")
    try:
        if not request.endpoint.is_stream:
            return _judge_body(request, json.loads(response.body or ""))
        return _judge_stream(request, response)
    except (Malformed, ValueError, KeyError, TypeError, IndexError) as exc:
        return Verdict(Outcome.FAILED, f"{type(exc).__name__}: {exc}"[:300])


def _error_type(body: str | None) -> str | None:
    try:
        return json.loads(body or "")["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return None


def _complete(request: SoakRequest, reason, text: str, num_tokens: int | None) -> Verdict:
    aborted = request.abort_after_events is not None and reason in ("abort", None)
    if reason not in FINISH_REASONS and not aborted:
        raise Malformed(f"finish reason {reason!r}")
    if not isinstance(text, str):
        raise Malformed(f"text is {type(text).__name__}")
    if num_tokens is not None:
        if not 1 <= num_tokens <= request.max_new_tokens:
            raise Malformed(f"{num_tokens} tokens for max_new_tokens {request.max_new_tokens}")
        if reason == "length" and num_tokens != request.max_new_tokens:
            raise Malformed(f"finished on length after {num_tokens} of {request.max_new_tokens} tokens")
        if aborted and num_tokens == request.max_new_tokens:
            raise Malformed(f"aborted after all its {num_tokens} tokens")
    held = [s for s in request.stop if s in text]
    if held:
        raise Malformed(f"output holds stop string {held[0]!r}: {text[-80:]!r}")
    return Verdict(Outcome.ABORTED if aborted else Outcome.OK, finish_reason=reason, num_output_tokens=num_tokens)


# ---- non-streaming --------------------------------------------------------------------------
def _judge_body(request: SoakRequest, body) -> Verdict:
    if isinstance(body, dict) and "error" in body:
        raise Malformed(f"error body: {str(body['error'])[:200]}")
    if request.endpoint is Endpoint.GENERATE_BATCH:
        if not isinstance(body, list) or len(body) != request.num_answers:
            raise Malformed(f"a batch of {request.num_answers} answered with {str(body)[:100]}")
        return _batch([_judge_generate(request, answer) for answer in body])
    if request.endpoint is Endpoint.GENERATE:
        return _judge_generate(request, body)
    if body["object"] != "text_completion":
        raise Malformed(f"object {body['object']!r}")
    (choice,) = body["choices"]
    return _complete(request, choice["finish_reason"], choice["text"], body["usage"]["completion_tokens"])


def _judge_generate(request: SoakRequest, body: dict) -> Verdict:
    ids, meta = body["output_ids"], body["meta_info"]
    if meta["completion_tokens"] != len(ids):
        raise Malformed(f"completion_tokens {meta['completion_tokens']} for {len(ids)} output_ids")
    return _complete(request, meta["finish_reason"]["type"], body["text"], len(ids))


def _batch(verdicts: list[Verdict]) -> Verdict:
    return Verdict(Outcome.OK, finish_reason=verdicts[0].finish_reason,
                   num_output_tokens=sum(v.num_output_tokens for v in verdicts))


# ---- streaming ---------------------------------------------------------------------------------
def _judge_stream(request: SoakRequest, response: RawResponse) -> Verdict:
    payloads = response.events
    is_done = bool(payloads) and payloads[-1] == "[DONE]"
    if "[DONE]" in payloads[:-1]:
        raise Malformed("data after [DONE]")
    events = [json.loads(p) for p in (payloads[:-1] if is_done else payloads)]
    for event in events:
        if not isinstance(event, dict):
            raise Malformed(f"event is {type(event).__name__}")
        if "error" in event:
            raise Malformed(f"error event: {str(event['error'])[:200]}")
    if request.endpoint is Endpoint.GENERATE_BATCH_STREAM:
        answers = [_generate_events(e) for e in _by_index(events, request.num_answers, response.is_cancelled)]
    elif request.endpoint is Endpoint.GENERATE_STREAM:
        reason, text, num_tokens = _generate_events(events)
    else:
        reason, text, num_tokens = _openai_events(request, events)
    if response.is_cancelled:
        return Verdict(Outcome.CANCELLED)
    if response.abort_status not in (None, 200):
        raise Malformed(f"/abort_request answered {response.abort_status}")
    if not is_done:
        raise Malformed(f"stream ended without [DONE] after {len(payloads)} events")
    if request.endpoint is Endpoint.GENERATE_BATCH_STREAM:
        return _batch([_complete(request, *answer) for answer in answers])
    if request.include_usage and num_tokens is None:
        raise Malformed("no usage chunk though include_usage was asked for")
    return _complete(request, reason, text, num_tokens)


def _by_index(events: list[dict], num_answers: int, is_cancelled: bool) -> list[list[dict]]:
    """A batch stream's events, answer by answer (each event's `index`); every
    answer has some unless the client hung up."""
    answers: list[list[dict]] = [[] for _ in range(num_answers)]
    for event in events:
        if not 0 <= event["index"] < num_answers:
            raise Malformed(f"index {event['index']} in a batch of {num_answers}")
        answers[event["index"]].append(event)
    if not is_cancelled and not all(answers):
        raise Malformed(f"no events for answers {[k for k, a in enumerate(answers) if not a]}")
    return [a for a in answers if a]


def _generate_events(events: list[dict]):
    """(finish reason, text, number of tokens) of a /generate stream: cumulative
    `text` and `output_ids`; only the last event may carry a finish reason."""
    reason, text, ids = None, "", []
    for i, event in enumerate(events):
        if len(event["output_ids"]) < len(ids):
            raise Malformed("output_ids shrank")
        text, ids = event["text"], event["output_ids"]
        reason = (event["meta_info"]["finish_reason"] or {}).get("type")  # (null until the last)
        if reason is not None and i != len(events) - 1:
            raise Malformed(f"finish reason {reason!r} before the last event")
    return reason, text, len(ids)


def _openai_events(request: SoakRequest, events: list[dict]):
    """(finish reason, text, number of tokens or None) of an OpenAI stream: text
    deltas; one finish reason, on the last chunk with a choice; then the usage
    chunk (its count) when asked for."""
    chat = request.endpoint is Endpoint.CHAT_STREAM
    expected = "chat.completion.chunk" if chat else "text_completion"
    reason, text, num_tokens = None, "", None
    for i, event in enumerate(events):
        if event["object"] != expected:
            raise Malformed(f"object {event['object']!r}, expected {expected!r}")
        if not event["choices"]:  # the usage chunk
            if not request.include_usage or i != len(events) - 1:
                raise Malformed("unexpected chunk without choices")
            num_tokens = event["usage"]["completion_tokens"]
            continue
        if reason is not None:
            raise Malformed("chunk after the finish reason")
        (choice,) = event["choices"]
        if chat:
            if i == 0 and choice["delta"].get("role") != "assistant":
                raise Malformed("chat stream does not open with the assistant role")
            text += choice["delta"].get("content") or ""
        else:
            text += choice["text"]
        reason = choice["finish_reason"]
    return reason, text, num_tokens
