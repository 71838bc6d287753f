"""An open-loop async client for Tandem's streaming `/generate`: what each request saw.

Each request is sent at its workload arrival time whether or not earlier ones have
finished (open loop, as real traffic is), as

    POST {base}/generate {"input_ids": [...], "stream": true,
                          "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": true}}

and read as Server-Sent Events: `data: {...}` lines carrying the cumulative
`output_ids`, ending with `data: [DONE]`; `data: {"error": ...}` is a failure.

Per request (`RequestRecord`, times in seconds on the client's monotonic clock):
- `ttft_s`: from sending the request to receiving its first output token;
- `token_times_s`: when each output token arrived, relative to sending; tokens that
  arrive in the same SSE event share one time, so the gap between them is 0 (that
  is what the client saw);
- `e2e_s`: from sending to the end of the stream;
- `num_cached_tokens`: prompt tokens the server found in a prefix cache;
- `status`: `ok` (200 and exactly `max_new_tokens` tokens), `rejected` (429, the
  scheduler's early SLO rejection), `error` (any other status, an error event, a
  short stream, a connection failure), `timeout` (past `request_timeout_s` or the
  run's `max_duration_s`), `not_sent` (its arrival time fell after `max_duration_s`).

Bounded: at most `max_in_flight` requests open at once (later arrivals wait for a
slot, and their send time is when they actually went out), every request ends by
its timeout, the whole run by `max_duration_s`. Loopback addresses only.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from benchmarks.workload import BenchRequest, Workload

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


@dataclass
class RequestRecord:
    index: int
    num_prompt_tokens: int
    max_new_tokens: int
    arrival_s: float  # scheduled, from the start of the run
    sent_s: float | None = None  # actual, from the start of the run
    status: str = "not_sent"
    http_status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    ended_s: float | None = None  # from the start of the run, whatever its status (a timeout's, an error's too)
    token_times_s: list[float] = field(default_factory=list)  # each token's arrival (an event's tokens: its time)
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (meta_info)
    error: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def gaps_s(self) -> list[float]:
        """The gaps its reader saw between the events that brought tokens: n - 1
        for n tokens where each event brings one. An event of k tokens is one gap
        (the stall before it), as vLLM's ITL counts it: k - 1 zeros beside it made
        a request stalled 800 ms between 16-token events read as 0 ms at p90."""
        times = self.token_times_s
        events = [t for i, t in enumerate(times) if not i or t != times[i - 1]]
        return [b - a for a, b in zip(events, events[1:])]


def check_loopback(base_url: str) -> None:
    host = urlparse(base_url).hostname
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"the benchmark client talks to loopback only, not {host!r}")


def generate_body(request: BenchRequest, stream: bool = True) -> dict:
    return {
        "input_ids": request.prompt_ids,
        "sampling_params": {"max_new_tokens": request.max_new_tokens, "temperature": 0, "ignore_eos": True},
        "stream": stream,
    }


async def send_one(client, base_url: str, request: BenchRequest, record: RequestRecord, started: float) -> None:
    """Stream one request into `record` (fills every field; raises nothing but
    cancellation)."""
    sent = time.perf_counter()
    record.sent_s = sent - started
    try:
        await _stream_one(client, base_url, request, record, sent)
    finally:  # (a timeout's cancellation too: the run lasted until then)
        record.ended_s = time.perf_counter() - started


async def _stream_one(client, base_url: str, request: BenchRequest, record: RequestRecord, sent: float) -> None:
    try:
        async with client.stream("POST", f"{base_url}/generate", json=generate_body(request)) as response:
            record.http_status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.status = "rejected" if response.status_code == 429 else "error"
                record.error = body[:300]
                return
            seen = 0
            async for payload in sse_payloads(response):
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    record.status, record.error = "error", str(event["error"])[:300]
                    return
                now = time.perf_counter() - sent
                record.num_cached_tokens = event.get("meta_info", {}).get("cached_tokens") or 0
                new = len(event.get("output_ids", ())) - seen
                if new > 0:
                    if record.ttft_s is None:
                        record.ttft_s = now
                    record.token_times_s += [now] * new
                    seen += new
        record.e2e_s = time.perf_counter() - sent
        if record.num_output_tokens == request.max_new_tokens:
            record.status = "ok"
        else:
            record.status = "error"
            record.error = f"got {record.num_output_tokens} of {request.max_new_tokens} tokens"
    except Exception as exc:  # connection reset, bad JSON: a failed request, not a failed run
        record.status, record.error = "error", f"{type(exc).__name__}: {exc}"[:300]


async def sse_payloads(response):
    """The `data:` payloads of a server-sent-events response, in order."""
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


async def run_workload(
    base_url: str,
    workload: Workload,
    *,
    request_timeout_s: float = 300.0,
    max_duration_s: float = 1800.0,
    max_in_flight: int = 256,
    progress: str | None = None,
) -> list[RequestRecord]:
    """Send every request at its arrival time; return one record per request, in
    workload order. `progress`: a tqdm description, or None for no bar."""
    import httpx

    check_loopback(base_url)
    records = [RequestRecord(r.index, r.num_prompt_tokens, r.max_new_tokens, r.arrival_s) for r in workload.requests]
    bar = _progress_bar(progress, len(records))
    slots = asyncio.Semaphore(max_in_flight)
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    timeout = httpx.Timeout(request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        started = time.perf_counter()
        deadline = started + max_duration_s

        async def one(request: BenchRequest, record: RequestRecord) -> None:
            async with slots:
                remaining = min(request_timeout_s, deadline - time.perf_counter())
                if remaining <= 0:
                    return
                try:
                    await asyncio.wait_for(send_one(client, base_url, request, record, started), remaining)
                except asyncio.TimeoutError:
                    record.status, record.error = "timeout", f"no end within {remaining:.0f} s"
            if bar is not None:
                bar.update(1)

        tasks = []
        for request, record in zip(workload.requests, records):
            wait = started + request.arrival_s - time.perf_counter()
            if started + request.arrival_s >= deadline:
                break
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(request, record)))
        await asyncio.gather(*tasks)
    if bar is not None:
        bar.close()
    return records


def _progress_bar(desc: str | None, total: int):
    if desc is None:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True)
