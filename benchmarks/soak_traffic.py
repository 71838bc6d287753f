"""Soak traffic: what the closed-loop clients of `tandem bench soak` send, and the
raw responses they collect.

A `SoakRequest` is one HTTP request drawn from a seeded mix (`draw_request`):
- endpoint (`Endpoint`): `/generate` streaming and not, one prompt or SGLang's
  batch (2-3 prompts, `n` 1 or 2), `/v1/completions` streaming and not,
  `/v1/chat/completions` streaming;
- prompt: token ids (exact length, clipped log-normal around 128 tokens) for
  `/generate` and completions, or text (random words) for chat and some
  `/generate` calls;
- `max_new_tokens`, greedy or seeded sampling, EOS honoured or ignored, and in some
  requests stop strings that the tiny model's random text often contains;
- for some streaming requests a deliberate cancellation: the client closes the
  connection after `cancel_after_events` data events that carry output;
- for some other single-prompt streams a deliberate abort: after
  `abort_after_events` such events the client asks `/abort_request` to end it (by
  the `/generate` request's rid, or the OpenAI completion's id from its first
  chunk) and reads on to the end.

`send(client, base_url, request, timeout_s)` returns a `RawResponse` holding what
came back, unjudged: the HTTP status, the body (non-streaming or error) or the SSE
`data:` payloads in order (streaming), whether the client cancelled, and a transport
error if the exchange broke (connection reset, timeout). It raises nothing but
cancellation of the calling task. `benchmarks/soak_verdict.py` judges the result.
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
import random
import time
from dataclasses import dataclass, field

from benchmarks.http_client import sse_payloads
from benchmarks.workload import random_tokens

STOP_STRINGS = ("ou", "eng", "st", "ack", "zq")  # the tiny model's text holds most of these often
# Text prompts: random words, about 3 tokens a word with the tiny tokenizer.
WORDS = ("the", "robot", "river", "quiet", "story", "light", "engine", "seven", "garden", "across", "paper",
         "winter", "signal", "bright", "under", "stone", "market", "follow", "number", "cloud")


class Endpoint(enum.Enum):
    GENERATE_STREAM = ("/generate", True, False)
    GENERATE = ("/generate", False, False)
    GENERATE_BATCH_STREAM = ("/generate", True, True)
    GENERATE_BATCH = ("/generate", False, True)
    COMPLETIONS_STREAM = ("/v1/completions", True, False)
    COMPLETIONS = ("/v1/completions", False, False)
    CHAT_STREAM = ("/v1/chat/completions", True, False)

    def __init__(self, path: str, is_stream: bool, is_batch: bool) -> None:
        self.path = path
        self.is_stream = is_stream
        self.is_batch = is_batch  # SGLang's batch of prompts (and n): answers a list

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")


MIX = {  # endpoint -> share of requests
    Endpoint.GENERATE_STREAM: 0.25,
    Endpoint.GENERATE: 0.10,
    Endpoint.GENERATE_BATCH_STREAM: 0.05,
    Endpoint.GENERATE_BATCH: 0.05,
    Endpoint.COMPLETIONS_STREAM: 0.20,
    Endpoint.COMPLETIONS: 0.10,
    Endpoint.CHAT_STREAM: 0.25,
}


@dataclass(frozen=True)
class SoakRequest:
    index: int
    endpoint: Endpoint
    body: dict
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    include_usage: bool = False  # OpenAI streams: a final usage chunk was asked for
    cancel_after_events: int | None = None  # the client hangs up after this many output events
    abort_after_events: int | None = None  # the client asks /abort_request to end it after this many

    @property
    def num_prompt_tokens(self) -> int | None:
        """Exact for token-id prompts; None for text (the server tokenizes) and
        for a batch."""
        prompt = self.body.get("input_ids", self.body.get("prompt"))
        return len(prompt) if isinstance(prompt, list) and not self.endpoint.is_batch else None

    @property
    def num_answers(self) -> int:
        """A batch's prompts times its n; one otherwise."""
        if not self.endpoint.is_batch:
            return 1
        return len(self.body["input_ids"]) * self.body["sampling_params"].get("n", 1)


@dataclass
class RawResponse:
    http_status: int | None = None
    body: str | None = None  # non-streaming body, or the body of a non-200 answer
    events: list[str] = field(default_factory=list)  # SSE data payloads, in order
    is_cancelled: bool = False  # the client hung up on purpose
    abort_status: int | None = None  # /abort_request's HTTP status, if the client asked it
    transport_error: str | None = None
    e2e_s: float | None = None


# ---- the mix ----------------------------------------------------------------------------
def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return min(max(round(rng.lognormvariate(math.log(median), sigma)), low), high)


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def draw_request(rng: random.Random, index: int, vocab_size: int, cancel_share: float = 0.12,
                 abort_share: float = 0.08) -> SoakRequest:
    """One request of the mix, every choice drawn from `rng`."""
    endpoint = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    cancel_after = abort_after = None
    drawn = rng.random()
    if endpoint.is_stream and drawn < cancel_share:
        cancel_after = rng.randint(1, 4)
    elif endpoint.is_stream and not endpoint.is_batch and drawn < cancel_share + abort_share:
        abort_after = rng.randint(1, 4)
    ended_early = cancel_after is not None or abort_after is not None
    max_new = _lognormal(rng, 32, 0.8, 4, 192) if not ended_early else rng.randint(64, 192)
    stop = tuple(rng.sample(STOP_STRINGS, rng.randint(1, 3))) if rng.random() < 0.35 else ()
    greedy = rng.random() < 0.5
    temperature, seed = (0.0, None) if greedy else (0.8, rng.randrange(2**31))
    ignore_eos = rng.random() < 0.5
    num_tokens = _lognormal(rng, 128, 1.0, 8, 1024)

    if endpoint.path == "/generate":
        params = {"max_new_tokens": max_new, "temperature": temperature, "ignore_eos": ignore_eos}
        if seed is not None:
            params["seed"] = seed
        if stop:
            params["stop"] = list(stop)
        body = {"sampling_params": params, "stream": endpoint.is_stream}
        if abort_after is not None:
            body["rid"] = f"soak-{index}"
        if endpoint.is_batch:
            params["n"] = rng.randint(1, 2)
            body["input_ids"] = [random_tokens(rng, _lognormal(rng, 64, 0.8, 8, 512), vocab_size)
                                 for _ in range(rng.randint(2, 3))]
        elif rng.random() < 0.25:
            body["text"] = _text(rng, max(1, num_tokens // 3))
        else:
            body["input_ids"] = random_tokens(rng, num_tokens, vocab_size)
        return SoakRequest(index, endpoint, body, max_new, stop, cancel_after_events=cancel_after,
                           abort_after_events=abort_after)

    body = {"max_tokens": max_new, "temperature": temperature, "ignore_eos": ignore_eos, "stream": endpoint.is_stream}
    if seed is not None:
        body["seed"] = seed
    if stop:
        body["stop"] = list(stop)
    include_usage = endpoint.is_stream and rng.random() < 0.5
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if endpoint is Endpoint.CHAT_STREAM:
        body["messages"] = [{"role": "system", "content": _text(rng, rng.randint(3, 20))},
                            {"role": "user", "content": _text(rng, max(1, num_tokens // 3))}]
    else:
        body["prompt"] = random_tokens(rng, num_tokens, vocab_size)
    return SoakRequest(index, endpoint, body, max_new, stop, include_usage, cancel_after, abort_after)


# ---- sending ------------------------------------------------------------------------------
async def send(client, base_url: str, request: SoakRequest, timeout_s: float) -> RawResponse:
    """One exchange, bounded by `timeout_s` end to end."""
    response = RawResponse()
    started = time.perf_counter()
    try:
        await asyncio.wait_for(_exchange(client, base_url, request, response), timeout_s)
    except asyncio.TimeoutError:
        response.transport_error = f"no end within {timeout_s:.0f} s"
    except Exception as exc:  # a broken exchange is a failed request, not a failed run
        response.transport_error = f"{type(exc).__name__}: {exc}"[:300]
    response.e2e_s = time.perf_counter() - started
    return response


async def _exchange(client, base_url: str, request: SoakRequest, response: RawResponse) -> None:
    url = f"{base_url}{request.endpoint.path}"
    if not request.endpoint.is_stream:
        answer = await client.post(url, json=request.body)
        response.http_status, response.body = answer.status_code, answer.text
        return
    async with client.stream("POST", url, json=request.body) as answer:
        response.http_status = answer.status_code
        if answer.status_code != 200:
            response.body = (await answer.aread()).decode(errors="replace")
            return
        num_output_events = 0
        async for payload in sse_payloads(answer):
            response.events.append(payload)
            if payload != "[DONE]" and _carries_output(payload):
                num_output_events += 1
            if request.cancel_after_events is not None and num_output_events >= request.cancel_after_events:
                response.is_cancelled = True
                return  # leaving the block closes the connection mid-stream
            if request.abort_after_events is not None and response.abort_status is None \
                    and num_output_events >= request.abort_after_events:
                rid = request.body.get("rid") or json.loads(response.events[0])["id"]
                response.abort_status = (await client.post(f"{base_url}/abort_request", json={"rid": rid})).status_code


def _carries_output(payload: str) -> bool:
    """An event with generated tokens or text (unparseable: no)."""
    try:
        event = json.loads(payload)
    except ValueError:
        return False
    if not isinstance(event, dict):
        return False
    if "output_ids" in event:
        return bool(event["output_ids"])
    choices = event.get("choices") or []
    return any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices if isinstance(c, dict))
