"""How the scheduler counts each request's end (`tandem_requests_total{outcome}`):
a request closed because another of its call's requests was refused or failed
is `withdrawn`, one closed because its client left is `cancelled`, and one
closed after its last event keeps the outcome that event gave it.

The scheduler here is a real GlobalScheduler with known cost models (as in
tests/scheduler_setup.py); what a worker would send is replaced by its events,
since the accounting is the thing under test (the workers' side: tests/test_serve_app.py)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest

from actors.messages import TokenEvent
from actors.sampling_params import SamplingParams
from actors.tokenization import load_tokenizer
from cluster.admission import InFlight, SloRejected
from cluster.api_models import ApiError
from cluster.completions import Completions
from tests.scheduler_setup import make_scheduler

PROMPT = list(range(600))  # 0.6 s of predicted prefill on p0 (1 ms a token)


def _completions(tiny_qwen2_dir, events):
    """Completions over a scheduler (TTFT SLO 1 s: one such prompt fits, two
    queued on the one P do not) whose workers would send `events`."""
    scheduler = make_scheduler(ttft_ms=1000)
    scheduler._events = events
    return Completions(scheduler, load_tokenizer(tiny_qwen2_dir), "tiny", None)


def _outcomes(completions) -> dict[str, float]:
    return {outcome: completions.service.metrics.value("requests_total", outcome=outcome)
            for outcome in ("ok", "error", "rejected", "cancelled", "withdrawn")}


async def _first_token_then_silence(request, choice, inflight):
    await asyncio.sleep(0.01)  # its prefill: queued until then
    yield TokenEvent(request.request_id, [7], "x", None, False, None, time.time())
    await asyncio.Event().wait()


def _requests(count: int):
    """`count` prompts like PROMPT that share no block (no prefix cache hit)."""
    return [([k + 1000, *PROMPT[1:]], SamplingParams(max_new_tokens=8, temperature=0.0), f"call-{k}")
            for k in range(count)]


def test_a_request_closed_because_its_sibling_was_refused_is_withdrawn_not_cancelled(tiny_qwen2_dir):
    completions = _completions(tiny_qwen2_dir, _first_token_then_silence)

    async def call():
        await completions.start_choices(_requests(2), n=1)  # a batch of two prompts: the second is refused

    with pytest.raises(SloRejected):
        asyncio.run(call())
    assert _outcomes(completions) == {"ok": 0, "error": 0, "rejected": 1, "cancelled": 0, "withdrawn": 1}
    assert not completions.service.view.models.inflight


def test_choices_that_never_started_because_the_first_was_refused_are_withdrawn(tiny_qwen2_dir):
    """An n=3 call refused at its first choice counted one request: the two
    others never called generate."""
    completions = _completions(tiny_qwen2_dir, _first_token_then_silence)
    completions.service.view.models.inflight["queued"] = InFlight("queued", "p0", "d0", 900, 10,
                                                                  predicted_ttft_s=2.0)  # (a queue past the SLO)

    async def call():
        await completions.start_choices(_requests(1) * 3, n=3)

    with pytest.raises(SloRejected):
        asyncio.run(call())
    assert _outcomes(completions) == {"ok": 0, "error": 0, "rejected": 1, "cancelled": 0, "withdrawn": 2}
    assert "tandem_e2e_seconds_count" not in completions.service.metrics.render(), (
        "a refusal's instant answer is no end-to-end latency (under overload they put its p50 near 0)")


def test_a_prompts_choices_start_together_charged_its_prefix_once(tiny_qwen2_dir):
    """An n=3 call's other choices start once its first is routed, not after its
    first token: every choice is with the workers before any has a token, and the
    two others are admitted though two such prompts queued on the one P break the
    TTFT SLO (1 s), since the first's prompt, in prefill there, is charged to
    them as cached (the P computes it once; on D they borrow its blocks)."""
    entered: list[str] = []
    all_in = asyncio.Event()

    async def first_token_once_all_are_in(request, choice, inflight):
        entered.append(request.request_id)
        if len(entered) == 3:
            all_in.set()
        try:
            await asyncio.wait_for(all_in.wait(), 5.0)
        except TimeoutError:
            pass  # (so that a call whose choices wait for a first token ends: the test then fails)
        yield TokenEvent(request.request_id, [7], "x", None, True, "length", time.time())

    completions = _completions(tiny_qwen2_dir, first_token_once_all_are_in)

    async def call():
        return await completions.collect_all(await completions.start_choices(_requests(1) * 3, n=3))

    answers = asyncio.run(call())
    assert all_in.is_set() and len(entered) == 3 and [a.finish_reason for a in answers] == ["length"] * 3
    assert _outcomes(completions) == {"ok": 3, "error": 0, "rejected": 0, "cancelled": 0, "withdrawn": 0}


def test_choices_whose_client_left_while_they_started_are_cancelled(tiny_qwen2_dir):
    """The client leaves an n=3 call before any choice has its first token: the
    three started (the first's two others with it) end cancelled, and none is left
    in flight."""
    entered: list[str] = []

    async def never_a_token(request, choice, inflight):
        entered.append(request.request_id)
        await asyncio.Event().wait()
        yield  # (an async generator)

    completions = _completions(tiny_qwen2_dir, never_a_token)

    async def call():
        starting = asyncio.ensure_future(completions.start_choices(_requests(1) * 3, n=3))
        while len(entered) < 3:
            await asyncio.sleep(0.01)
        starting.cancel()  # the client hangs up
        with pytest.raises(asyncio.CancelledError):
            await starting

    asyncio.run(asyncio.wait_for(call(), 10))
    assert _outcomes(completions) == {"ok": 0, "error": 0, "rejected": 0, "cancelled": 3, "withdrawn": 0}
    assert not completions.service.view.models.inflight


def test_a_first_choice_that_fails_once_routed_ends_its_call_without_waiting_for_the_others(tiny_qwen2_dir):
    """The first of an n=3 call is routed, its others start on its pair, then it
    fails before its first token (and its retry finds no other P): the call
    answers its error at once, the two others closed, withdrawn, not left to reach
    a first token that nobody would read (here they never would)."""
    entered: list[str] = []

    async def first_fails_others_never_answer(request, choice, inflight):
        entered.append(request.request_id)
        if request.request_id.startswith("call-0-"):  # (each of the first's attempts)
            await asyncio.sleep(0.01)
            yield TokenEvent(request.request_id, [], "", None, True, "error", time.time(), error="P failed")
            return
        await asyncio.Event().wait()
        yield  # (an async generator)

    completions = _completions(tiny_qwen2_dir, first_fails_others_never_answer)
    requests = [(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.0), f"call-{k}") for k in range(3)]

    async def call():
        await completions.start_choices(requests, n=3)

    with pytest.raises(ApiError) as failed:
        asyncio.run(asyncio.wait_for(call(), 10))
    assert failed.value.status == 503 and "P failed" in str(failed.value)
    assert len(entered) == 3, entered  # (the others had started: closing them is the thing pinned)
    assert _outcomes(completions) == {"ok": 0, "error": 1, "rejected": 0, "cancelled": 0, "withdrawn": 2}
    assert not completions.service.view.models.inflight


@pytest.mark.parametrize("steps", range(6))
def test_every_choice_counts_once_whenever_its_client_leaves(tiny_qwen2_dir, steps):
    """The client leaves `steps` turns of the event loop after an n=3 call's
    first choice is routed: as the others are made, before or after they first
    run. Each of the three counts once, cancelled, those cancelled before
    they ran too."""

    async def never_a_token(request, choice, inflight):
        if request.request_id.startswith("call-0-"):
            leave_after(steps)
        await asyncio.Event().wait()
        yield  # (an async generator)

    def leave_after(turns: int):
        loop = asyncio.get_running_loop()
        loop.call_soon(starting.cancel) if turns == 0 else loop.call_soon(leave_after, turns - 1)

    completions = _completions(tiny_qwen2_dir, never_a_token)
    requests = [(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.0), f"call-{k}") for k in range(3)]

    async def call():
        nonlocal starting
        starting = asyncio.ensure_future(completions.start_choices(requests, n=3))
        with pytest.raises(asyncio.CancelledError):
            await starting

    starting = None
    asyncio.run(asyncio.wait_for(call(), 10))
    assert _outcomes(completions) == {"ok": 0, "error": 0, "rejected": 0, "cancelled": 3, "withdrawn": 0}
    assert not completions.service.view.models.inflight


def test_a_request_whose_client_left_is_cancelled(tiny_qwen2_dir):
    completions = _completions(tiny_qwen2_dir, _first_token_then_silence)

    async def call():
        streams = await completions.start_choices(_requests(1), n=1)
        collecting = asyncio.ensure_future(completions.collect_all(streams))
        await asyncio.sleep(0.05)
        collecting.cancel()  # the client hangs up
        with pytest.raises(asyncio.CancelledError):
            await collecting

    asyncio.run(call())
    assert _outcomes(completions) == {"ok": 0, "error": 0, "rejected": 0, "cancelled": 1, "withdrawn": 0}


@pytest.mark.parametrize("error, outcome", [(None, "ok"), ("worker died", "error")])
def test_a_request_closed_after_its_last_event_keeps_that_events_outcome(tiny_qwen2_dir, error, outcome):
    """`collect` stops at an error event without reading on, and a reader may
    close a stream after its last event: neither is the client leaving."""

    async def last_event(request, choice, inflight):
        yield TokenEvent(request.request_id, [7], "x", None, False, None, time.time())
        yield TokenEvent(request.request_id, [], "", None, True, "length", time.time(), error=error)

    completions = _completions(tiny_qwen2_dir, last_event)

    async def call():
        events = completions.service.generate(PROMPT, SamplingParams(max_new_tokens=8), "r")
        async for event in events:
            if event.finished:
                await events.aclose()  # before reading on to its end
                break

    asyncio.run(call())
    assert _outcomes(completions)[outcome] == 1 and sum(_outcomes(completions).values()) == 1


def test_an_event_of_several_tokens_counts_a_gap_for_each(tiny_qwen2_dir):
    """A speculating D (or `stream_interval` > 1) sends several tokens an event:
    `tandem_tbt_seconds` counted one gap for it, its mean gap, and leant to slow
    single-token events (a review's probe: 2 observations for 10 gaps)."""
    async def nine_at_once(request, choice, inflight):
        yield TokenEvent(request.request_id, [1], "a", None, False, None, time.time())
        yield TokenEvent(request.request_id, list(range(9)), "b" * 9, None, False, None, time.time())
        yield TokenEvent(request.request_id, [2], "c", None, True, "length", time.time())

    scheduler = make_scheduler(ttft_ms=10_000)
    scheduler._events = nine_at_once

    async def run():
        return [e async for e in scheduler.generate(PROMPT, SamplingParams(max_new_tokens=11))]

    asyncio.run(run())
    assert "tandem_tbt_seconds_count 10" in scheduler.metrics.render().splitlines()


def test_a_retry_no_worker_can_take_is_not_counted(tiny_qwen2_dir):
    """One P and one D, and the attempt failed before its first token: the
    request ended "no other worker can take it", counted as retried all the same."""
    async def failed(request, choice, inflight):
        yield TokenEvent(request.request_id, [], "", None, True, "error", time.time(), error="the actor died")

    scheduler = make_scheduler(ttft_ms=10_000)
    scheduler._events = failed

    async def run():
        return [e async for e in scheduler.generate(PROMPT, SamplingParams(max_new_tokens=4))]

    with pytest.raises(ApiError, match="no other worker can take it"):
        asyncio.run(run())
    assert scheduler.metrics.value("retries_total", reason="failed") == 0
    assert scheduler.metrics.value("requests_total", outcome="error") == 1


def test_the_exposition_escapes_newlines_and_e2e_buckets_reach_the_request_timeout():
    """A newline in a label value split its sample line (no label takes user text
    today); e2e buckets ended at 60 s while a request may run 300, and every p99
    past 60 s read as 60."""
    from cluster.metrics import Metrics

    metrics = Metrics()
    metrics.set("queue_depth", "requests\nwaiting", 2, worker="d0\nx")
    metrics.observe("e2e_seconds", "end-to-end latency", 280.0)
    lines = metrics.render().splitlines()
    assert "# HELP tandem_queue_depth requests\\nwaiting" in lines
    assert 'tandem_queue_depth{worker="d0\\nx"} 2' in lines
    assert 'tandem_e2e_seconds_bucket{le="300.0"} 1' in lines and 'tandem_e2e_seconds_bucket{le="120.0"} 0' in lines


def test_each_replicas_counts_are_a_series_of_their_own_on_rays_metrics_port(ray_local, tiny_qwen2_dir):
    """Two schedulers (replicas) count their requests; Ray's metrics port has
    each one's count under its own `replica` tag (cluster/metrics_export.py),
    as /metrics through the Serve proxy, one replica a scrape, cannot."""

    async def last_event(request, choice, inflight):
        yield TokenEvent(request.request_id, [7], "x", None, True, "length", time.time())

    replicas = [_completions(tiny_qwen2_dir, last_event).service for _ in range(2)]
    for count, scheduler in zip((2, 3), replicas):
        assert scheduler.metrics.export is not None  # (Ray is up)

        async def run(scheduler=scheduler):
            for k in range(count):
                async for _ in scheduler.generate([k + 1, *PROMPT[1:]], SamplingParams(max_new_tokens=1)):
                    pass

        asyncio.run(run())
    wanted = {scheduler.replica: float(count) for count, scheduler in zip((2, 3), replicas)}
    port = ray_local.nodes()[0]["MetricsExportPort"]
    deadline = time.monotonic() + 60  # (Ray's agent exports every 10 s or so)
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        seen = {}
        for line in text.splitlines():
            if line.startswith("ray_tandem_requests_total{") and 'outcome="ok"' in line:
                replica = line.split('replica="')[1].split('"')[0]
                seen[replica] = float(line.rsplit(" ", 1)[1])
        if all(seen.get(replica) == count for replica, count in wanted.items()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {replica: seen.get(replica) for replica in wanted} == wanted
