"""Several global scheduler replicas over one pool (Serve `num_replicas`, the
`scheduler_replicas` setting): each routes by the whole of every worker's prefix
cache, a replica that starts late included, and each counts the others' load.
Two schedulers in this process stand for two replicas (benchmarks/scheduler_driver.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.sampling_params import SamplingParams
from benchmarks.scheduler_driver import build_scheduler, complete, refreshing, run_with_pool, wait_ready

SETTINGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "mode": "colocated",
    "colocated": {"replicas": 1},
    "engine": {"block_size": 16, "prefill_chunk_size": 128, "max_num_batched_tokens": 256, "num_kv_blocks": 256},
    "slo": {"early_rejection": False},
    "pool_name": "test-pool-scheduler-replicas",
}
SHORT = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=1500, temperature=0, ignore_eos=True)
# The mean gap's request: its ends are stamped here after each yield, by the scheduler
# before it, so a stall of a few ms between (2 CPUs) moves the mean by it over the gaps.
GAPS = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)


async def _until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s} s")
        await asyncio.sleep(0.1)


def _cached(scheduler, prompt: list[int]) -> int:
    choice = scheduler.plan(prompt)
    return len(prompt) - choice.uncached_tokens


async def _mean_gap_s(scheduler, prompt: list[int], params) -> float:
    """One request to its end, and its mean gap between tokens as its caller saw them."""
    first_s = last_s = None
    num_tokens = 0
    async for event in scheduler.generate(prompt, params):
        assert event.error is None
        if event.token_ids:
            last_s = time.monotonic()
            first_s = first_s or last_s
            num_tokens += len(event.token_ids)
    return (last_s - first_s) / (num_tokens - 1)


def _kept(models, name: str) -> list:
    """The arguments of each call to one of the models' observe_* methods (which still runs)."""
    calls, real = [], getattr(models, name)
    setattr(models, name, lambda *args: (calls.append(args), real(*args)))
    return calls


async def _scenario(pool, settings):
    first_prompt, second_prompt = list(range(3, 99)), list(range(500, 596))  # 96 tokens: 5 blocks can hit
    a = build_scheduler(settings, pool)
    async with refreshing(a, interval_s=0.3):
        await wait_ready(a, timeout_s=180)
        tbt_seen = _kept(a.view.models, "observe_tbt")
        mean_gap_s = await _mean_gap_s(a, first_prompt, GAPS)
        await _until(lambda: _cached(a, first_prompt) == 80, 10, "A routes by the prefix it sent")
        b = build_scheduler(settings, pool)  # starts after A has read the cache events
        async with refreshing(b, interval_s=0.3):
            await wait_ready(b, timeout_s=120)
            await _until(lambda: _cached(b, first_prompt) == 80, 10, "B sees a prefix cached before it started")
            assert (await complete(b, second_prompt, SHORT))[1] is None
            await _until(lambda: _cached(a, second_prompt) == 80 and _cached(b, second_prompt) == 80, 10,
                         "both see the second prefix")

            (worker,) = a.view.members
            seen = await _abort_while_decoding(a, b, worker)
    return dict(seen, worker=worker, tbt_seen=tbt_seen, mean_gap_s=mean_gap_s)


async def _abort_while_decoding(a, b, worker, attempts: int = 3) -> dict:
    """A long request started on A and aborted by name through B (`/abort_request`
    reaching B) once B sees it decode and its first tokens came (A counts it on D
    from its admission: an abort sent before it reached the worker ended it there as
    it came, by its abort mark, and the abort named none it ended). On a loaded
    machine its tokens can all come before B sees it or before the abort lands:
    that says nothing of the abort, so a new one is tried, up to `attempts`;
    `ended_first` counts those."""
    for attempt in range(attempts):
        name = f"long-{attempt}"
        tokens = []
        request = asyncio.ensure_future(_last_event(a, list(range(1000, 1040)), LONG, name, tokens))
        await _until(lambda: request.done() or (b.view.models.peers.decoding.get(worker) == 1 and tokens), 30,
                     "B sees A's decoding request")
        if request.done():  # all its tokens came before B saw it
            assert request.result().finish_reason == "length"
            await _until(lambda: not b.view.models.peers.decoding, 10, "B sees A's request end")  # (not stale)
            continue
        batch, kv_tokens = b.view.models.decode_load(worker)
        inflight_b = len(b.view.models.inflight)
        aborted = await b.view.abort_named(name)
        long_last = await asyncio.wait_for(request, 30)
        await _until(lambda: not b.view.models.peers.decoding, 10, "B sees A's request end")
        if long_last.finish_reason != "length":
            return dict(batch=batch, kv_tokens=kv_tokens, inflight_b=inflight_b, aborted=aborted,
                        long_last=long_last, ended_first=attempt)
    raise AssertionError(f"each of {attempts} long requests ended before B's abort came")


async def _last_event(scheduler, prompt: list[int], params, client_rid: str, tokens: list[int] | None = None):
    async for event in scheduler.generate(prompt, params, client_rid, client_rid):
        last = event
        if tokens is not None:
            tokens += event.token_ids
    return last


def test_replicas_share_the_cache_view_and_count_each_others_load(ray_local, tiny_qwen2_dir):
    r = run_with_pool(SETTINGS, _scenario)
    assert r["inflight_b"] == 0  # the request is A's, and B counts it all the same
    assert r["batch"] == 1 and r["kv_tokens"] > 40
    # B's abort of a request by its client's name ends it on A (`/abort_request`
    # lands on any replica), as aborted, with the tokens it had.
    assert len(r["aborted"]) == 1 and r["long_last"].finish_reason == "abort" and r["long_last"].error is None, (
        r["aborted"], r["long_last"], r["ended_first"])
    # A's D learns its TBT bias from the request it finished (its mean gap between
    # tokens as its caller saw them, as the SLO counts it); not from the one aborted
    # (nor from the long ones that ended before the abort, learnt from all the same).
    assert len(r["tbt_seen"]) == 1 + r["ended_first"]
    prediction, observed_s = r["tbt_seen"][0]
    assert prediction.decode_id == r["worker"] and observed_s == pytest.approx(r["mean_gap_s"], abs=1e-3)
