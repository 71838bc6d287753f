"""Faults between P and D: every request ends with a clear failure, nothing leaks,
and the survivors keep serving."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest
import ray

from actors.config import EngineConfig
from actors.messages import GenerateRequest, ReservationRefused, WorkerDied
from actors.sampling_params import SamplingParams
from actors.worker_base import WorkerOptions
from cluster.pd_request import DisaggregatedCall
from cluster.workers import start_worker
from tests.conftest import wait_idle

# Small chunks make a long prompt's transfer last long enough to interrupt.
CONFIG = EngineConfig(block_size=16, prefill_chunk_size=16, max_num_batched_tokens=64, num_kv_blocks=400)
OPTIONS = WorkerOptions(transfer_timeout_s=5.0, reservation_ttl_s=30.0, watchdog_interval_s=0.2)
LONG_PROMPT = [random.Random(3).randrange(2000) for _ in range(1800)]
SHORT = GenerateRequest("short", list(range(1, 40)), SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))


def start(kind, name, model_dir):
    """A worker, once its start-up profile (which steps its engine) is done: a
    fault a test then puts in the engine's next step meets the test's request."""
    actor = start_worker(kind, name, model_dir, CONFIG, OPTIONS)
    ray.get(actor.profile.remote())
    return actor


def start_pair(p_name: str, d_name: str, model_dir):
    """A P and a D as `start` gives them, started side by side (each start loads a
    model: one after the other, the file's tests waited twice as long for them;
    answering at `ping`, P's profile could take a step fault meant for a request)."""
    p, d = (start_worker(kind, name, model_dir, CONFIG, OPTIONS) for kind, name in (("prefill", p_name),
                                                                                   ("decode", d_name)))
    ray.get([p.profile.remote(), d.profile.remote()])
    return p, d


async def consume(call: DisaggregatedCall, stop_after: int | None = None):
    events = []
    async for event in call.events():
        events.append(event)
        if stop_after is not None and len(events) >= stop_after:
            break
    return events


async def mid_transfer(p, d, request: GenerateRequest):
    """Start a request and return once its transfer is under way, its first chunk
    landed in D's blocks and more to come: (call, task consuming its events). (A
    fixed wait after the reservation missed the transfer, when a quick moment of
    the machine had sent all of the prompt's chunks within it.)"""
    request_id = request.request_id

    def chunks_landed(worker) -> int | None:  # (nested: Ray ships it by value to D)
        with worker._pending_lock:
            pending = worker._pending.get(request_id)
        return None if pending is None else pending.next_chunk

    call = DisaggregatedCall(p, d, request, "gloo")
    task = asyncio.ensure_future(consume(call))
    deadline = time.monotonic() + 60
    while call.reservation is None or not await d.__ray_call__.remote(chunks_landed):
        assert not task.done() and time.monotonic() < deadline, "the transfer ended before the test saw a chunk land"
        await asyncio.sleep(0.005)
    return call, task


def serves(p, d, request_id: str) -> bool:
    request = GenerateRequest(request_id, SHORT.prompt_token_ids, SHORT.params)
    events = asyncio.run(consume(DisaggregatedCall(p, d, request, "gloo")))
    return events[-1].finished and events[-1].error is None and sum(len(e.token_ids) for e in events) == 4


def test_prefill_dies_mid_transfer(ray_local, tiny_qwen2_dir):
    p, d = start_pair("p-dies", "d-survives", tiny_qwen2_dir)
    request = GenerateRequest("p-dies-1", LONG_PROMPT, SamplingParams(max_new_tokens=8, temperature=0))

    async def scenario():
        call, task = await mid_transfer(p, d, request)
        ray.kill(p)
        return call, await asyncio.wait_for(task, timeout=30)

    call, events = asyncio.run(scenario())
    assert call.prefill_result is None
    assert events[-1].finished and events[-1].error
    wait_idle(d)
    deadline = time.monotonic() + 5
    while ray.get(d.stats.remote()).num_channels and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.get(d.stats.remote()).num_channels == 0  # the dead P's channel is closed
    assert serves(start("prefill", "p-new", tiny_qwen2_dir), d, "after-p-died")


def test_decode_frees_a_reservation_when_its_prefill_dies(ray_local, tiny_qwen2_dir):
    """No driver tells D: it notices P's death by itself, well before the TTL."""
    p, d = start_pair("p-gone", "d-watch", tiny_qwen2_dir)
    ray.get(d.reserve.remote(GenerateRequest("orphan", LONG_PROMPT[:300], SHORT.params), "unread", p))
    assert ray.get(d.stats.remote()).num_reserved == 1
    ray.kill(p)
    started = time.monotonic()
    wait_idle(d, within_s=5.0)
    assert time.monotonic() - started < OPTIONS.reservation_ttl_s / 3


def test_decode_dies_mid_transfer(ray_local, tiny_qwen2_dir):
    p, d = start_pair("p-survives", "d-dies-early", tiny_qwen2_dir)
    request = GenerateRequest("d-dies-1", LONG_PROMPT, SamplingParams(max_new_tokens=8, temperature=0))

    async def scenario():
        call, task = await mid_transfer(p, d, request)
        ray.kill(d)
        with pytest.raises(WorkerDied):
            await asyncio.wait_for(task, timeout=30)
        return call

    asyncio.run(scenario())
    wait_idle(p, within_s=OPTIONS.transfer_timeout_s * 2)
    assert serves(p, start("decode", "d-new", tiny_qwen2_dir), "after-d-died-early")


def test_decode_dies_mid_decode(ray_local, tiny_qwen2_dir):
    p, d = start_pair("p-ok", "d-dies-late", tiny_qwen2_dir)
    request = GenerateRequest("d-dies-2", list(range(1, 100)), SamplingParams(max_new_tokens=2000, ignore_eos=True))

    async def scenario():
        call = DisaggregatedCall(p, d, request, "gloo")
        seen = 0
        with pytest.raises(WorkerDied):
            async for event in call.events():
                seen += len(event.token_ids)
                if seen >= 3:
                    ray.kill(d)
        return seen

    assert asyncio.run(asyncio.wait_for(scenario(), timeout=60)) >= 3
    wait_idle(p)
    # P closes its channel to the dead D: no send fails on it any more (it kept one for every D it met).
    deadline = time.monotonic() + 10
    while ray.get(p.stats.remote()).num_channels and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.get(p.stats.remote()).num_channels == 0
    assert serves(p, start("decode", "d-new-2", tiny_qwen2_dir), "after-d-died-late")


def test_cancel_mid_stream_frees_both_sides(ray_local, tiny_qwen2_dir):
    p, d = start_pair("p-cancel", "d-cancel", tiny_qwen2_dir)
    request = GenerateRequest("cancel-1", list(range(1, 200)), SamplingParams(max_new_tokens=500, ignore_eos=True))

    async def scenario():
        call = DisaggregatedCall(p, d, request, "gloo")
        events = []
        stream = call.events()
        async for event in stream:
            events.append(event)
            if len(events) == 3:
                break
        await stream.aclose()
        return events

    events = asyncio.run(scenario())
    assert len(events) == 3 and not events[-1].finished
    wait_idle(p)
    wait_idle(d)
    assert serves(p, d, "after-cancel")


def test_a_full_decode_worker_keeps_handshakes_in_line_and_keeps_serving(ray_local, tiny_qwen2_dir):
    """D without room for a prompt now keeps its handshake waiting, first come first
    served, until requests free blocks or the wait is over; then it refuses saying
    why. An aborted handshake leaves the line (actors/reservation_queue.py)."""
    small = EngineConfig(block_size=16, prefill_chunk_size=16, num_kv_blocks=12)
    d = start_worker("decode", "d-full", tiny_qwen2_dir, small, OPTIONS)  # (starts while P does)
    p = start("prefill", "p-full", tiny_qwen2_dir)
    params = SamplingParams(max_new_tokens=4)
    for i in range(2):  # 69 prompt tokens and the first output token: 5 blocks each
        ray.get(d.reserve.remote(GenerateRequest(f"hold-{i}", list(range(1 + i, 70 + i)), params), "unread", p))
    # 4 blocks, none shared with those held (it would borrow them: actors/arriving_blocks.py)
    too_much = GenerateRequest("too-much", list(range(500, 559)), SHORT.params)
    with pytest.raises(ReservationRefused, match=r"no room for 59 prompt tokens within 0 s \(2 blocks free"):
        ray.get(d.reserve.remote(too_much, "unread", p))  # no wait asked for
    assert ray.get(d.stats.remote()).num_used_blocks == 10  # the refusal took nothing
    with pytest.raises(ReservationRefused, match=r"no room for 59 prompt tokens within 0.5 s"):
        asyncio.run(consume(DisaggregatedCall(p, d, too_much, "gloo", handshake_timeout_s=0.5)))

    async def line_holds(num_handshakes: int):
        """D's stats once that many handshakes wait in its line (or 10 s on)."""
        deadline = time.monotonic() + 10
        while (stats := await d.stats.remote()).num_waiting_handshakes < num_handshakes and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return stats

    async def in_line():
        long = asyncio.ensure_future(d.reserve.remote(GenerateRequest("long", list(range(1000, 1119)), params),
                                                      "unread", p, 30))  # 8 blocks (none of them hold-0's)
        await line_holds(1)  # the long prompt first in line
        short = asyncio.ensure_future(d.reserve.remote(GenerateRequest("short", list(range(200, 240)), params),
                                                       "unread", p, 30))  # 3 blocks
        aborted = asyncio.ensure_future(d.reserve.remote(GenerateRequest("aborted", list(range(300, 310)), params),
                                                         "unread", p, 30))
        stats = await line_holds(3)
        assert (stats.num_waiting_handshakes, stats.num_waiting_blocks) == (3, 8 + 3 + 1)
        await d.abort.remote("aborted")
        with pytest.raises(ReservationRefused, match="aborted while it waited"):
            await aborted
        await d.abort.remote("hold-0")  # 7 blocks free: the short prompt would fit, the long one is first
        await asyncio.sleep(0.5)
        assert not long.done() and not short.done()
        await d.abort.remote("hold-1")
        assert len((await long).block_ids) == 8 and len((await short).block_ids) == 3
        stats = await d.stats.remote()
        assert (stats.num_waiting_handshakes, stats.num_waiting_blocks) == (0, 0)
        for request_id in ("long", "short"):
            await d.abort.remote(request_id)
        await d.reserve.remote(GenerateRequest("hold", list(range(1, 150)), params), "unread", p)  # 10 blocks
        # A request waits in line through the scheduler's handshake, and is served
        # once an abort frees blocks.
        waiting = asyncio.ensure_future(consume(DisaggregatedCall(p, d, too_much, "gloo")))
        await asyncio.sleep(0.5)
        await d.abort.remote("hold")
        return await waiting

    events = asyncio.run(in_line())
    assert events[-1].error is None and sum(len(e.token_ids) for e in events) == 4
    wait_idle(d)
    assert serves(p, d, "after-full")


def test_a_line_of_handshakes_sharing_a_prompt_asks_for_its_blocks_once(ray_local, tiny_qwen2_dir):
    """Each handshake in D's line was counted its whole reservation: a burst sharing
    a system prompt, passing through the line, read as asking for the prompt once a
    request, and admission, seeing no room on D, answered 429 (actors/line_asks.py).
    A handshake's leading blocks that D holds (on their way here), or that one ahead
    of it will hold, are not counted again."""
    small = EngineConfig(block_size=16, prefill_chunk_size=16, num_kv_blocks=12)
    d = start_worker("decode", "d-line", tiny_qwen2_dir, small, OPTIONS)
    params = SamplingParams(max_new_tokens=4)
    system, other = list(range(1, 65)), list(range(500, 564))  # 4 blocks each
    # 84 prompt tokens and the first output token: 6 blocks each, 11 of the 12 held
    ray.get(d.reserve.remote(GenerateRequest("holder", system + list(range(100, 120)), params), "unread"))
    ray.get(d.reserve.remote(GenerateRequest("filler", list(range(800, 869)), params), "unread"))  # 5 blocks

    async def in_line():
        waiting = []
        for request_id, prefix, start in (("a", system, 200), ("b", other, 600), ("c", other, 700)):
            request = GenerateRequest(request_id, prefix + list(range(start, start + 20)), params)
            waiting.append(asyncio.ensure_future(d.reserve.remote(request, "unread", None, 30)))
            deadline = time.monotonic() + 10
            while (stats := await d.stats.remote()).num_waiting_handshakes < len(waiting):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        for request_id in ("a", "b", "c", "holder", "filler"):
            await d.abort.remote(request_id)
        await asyncio.gather(*waiting, return_exceptions=True)
        return stats

    stats = asyncio.run(in_line())
    # a: 6 less the holder's 4 system blocks; b: 6; c: 6 less the 4 it shares with b, ahead of it
    assert (stats.num_waiting_handshakes, stats.num_waiting_blocks) == (3, 2 + 6 + 2)
    wait_idle(d)
    ray.kill(d)


def test_a_transfer_stalled_past_its_timeout_fails_clearly_and_leaks_nothing(ray_local, tiny_qwen2_dir):
    """D freezes (SIGSTOP) mid-transfer for longer than the transfer timeout, then
    wakes up: the request ends with an error, nothing is decoded from the partial
    KV, both sides give back every block and serve the next request."""
    import os
    import signal

    p, d = start_pair("p-stall", "d-stall", tiny_qwen2_dir)
    d_pid = ray.get(d.__ray_call__.remote(lambda self: os.getpid()))
    request = GenerateRequest("stalled-1", LONG_PROMPT, SamplingParams(max_new_tokens=8, temperature=0))
    stall_s = OPTIONS.transfer_timeout_s + 3

    async def scenario():
        call, task = await mid_transfer(p, d, request)
        os.kill(d_pid, signal.SIGSTOP)
        try:
            await asyncio.wait({task}, timeout=stall_s)
        finally:
            os.kill(d_pid, signal.SIGCONT)
        return call, await asyncio.wait_for(task, timeout=30)

    started = time.monotonic()
    call, events = asyncio.run(scenario())
    assert events[-1].finished and events[-1].error, events[-1]
    assert not any(e.token_ids for e in events)  # no token from an incomplete transfer
    assert call.prefill_result is None
    assert time.monotonic() - started < stall_s + 30
    wait_idle(p, within_s=15)
    wait_idle(d, within_s=15)
    assert serves(p, d, "after-stall")
    assert ray.get(d.stats.remote()).num_channels == 1  # the new one: P closed D's end of the broken one


def test_prefill_dies_after_the_transfer_decode_goes_on(ray_local, tiny_qwen2_dir):
    """Once the KV is in D's blocks, P is no longer needed: its death costs nothing."""
    p, d = start_pair("p-after", "d-after", tiny_qwen2_dir)
    request = GenerateRequest("p-dies-after", list(range(1, 120)), SamplingParams(max_new_tokens=40, ignore_eos=True))

    async def scenario():
        events = []
        async for event in DisaggregatedCall(p, d, request, "gloo").events():
            events.append(event)
            if len(events) == 1:
                ray.kill(p)
                # P's failed prefill may reach the scheduler only now, after the
                # first token: D must not drop a request whose KV has all arrived.
                dropped.append(await d.abort_transfer.remote("p-dies-after", "prefill failed: killed"))
        return events

    dropped = []
    events = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert dropped == [False]
    assert events[-1].finished and events[-1].error is None
    assert sum(len(e.token_ids) for e in events) == 40
    wait_idle(d)


def test_a_death_seen_after_the_last_chunk_leaves_the_request_decoding(ray_local, tiny_qwen2_dir):
    """D's watchdog looks at its reservations, then pings their prefill workers; a
    transfer may finish while it waits. Here the ping answers "dead" only once the
    last chunk is in: the request, decoding by then, is not dropped. It was, from the
    watchdog's earlier look (a CI run of the test above saw it)."""
    p, d = start_pair("p-late-death", "d-late-death", tiny_qwen2_dir)

    def death_seen_late(worker):
        is_dead = worker._is_dead

        async def answer(ping) -> bool:
            if not worker._pending:
                return await is_dead(ping)
            worker.waited_for_transfer = True
            while worker._pending:
                await asyncio.sleep(0.01)
            return True

        worker.waited_for_transfer = False
        worker._is_dead = answer

    ray.get(d.__ray_call__.remote(death_seen_late))
    request = GenerateRequest("late-death", LONG_PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))
    events = asyncio.run(asyncio.wait_for(consume(DisaggregatedCall(p, d, request, "gloo")), timeout=60))
    assert ray.get(d.__ray_call__.remote(lambda worker: worker.waited_for_transfer))
    assert events[-1].finished and events[-1].error is None
    assert sum(len(e.token_ids) for e in events) == 8
    wait_idle(d)


def test_prefill_dead_before_the_request_ends_it_clearly(ray_local, tiny_qwen2_dir):
    p, d = start_pair("p-before", "d-before", tiny_qwen2_dir)
    ray.kill(p)
    request = GenerateRequest("p-dead-before", list(range(1, 120)), SamplingParams(max_new_tokens=4))
    events = asyncio.run(asyncio.wait_for(consume(DisaggregatedCall(p, d, request, "gloo")), timeout=60))
    assert events[-1].finished and events[-1].error and not any(e.token_ids for e in events)
    wait_idle(d)
    assert serves(start("prefill", "p-instead", tiny_qwen2_dir), d, "after-p-dead-before")


def test_a_failed_prefill_step_ends_its_request_and_prefill_keeps_serving(ray_local, tiny_qwen2_dir):
    """P's engine step raises once (an injected fault, as a kernel bug or an OOM
    would): the request ends with an error naming it rather than waiting for a first
    token forever, D frees the reservation, and the next request is served."""
    p, d = start_pair("p-step-fails", "d-step-fails", tiny_qwen2_dir)

    def fail_next_step(worker):
        engine = worker.engine

        def run_step():
            del engine.run_step  # the next step is the engine's own again
            raise RuntimeError("injected step fault")

        engine.run_step = run_step

    ray.get(p.__ray_call__.remote(fail_next_step))
    request = GenerateRequest("p-step-fails-1", list(range(1, 120)), SamplingParams(max_new_tokens=4))
    call = DisaggregatedCall(p, d, request, "gloo")
    events = asyncio.run(asyncio.wait_for(consume(call), timeout=60))
    assert events[-1].finished and "injected step fault" in events[-1].error
    assert "ray::" not in events[-1].error and 'File "' not in events[-1].error  # the message, not P's traceback
    assert not any(e.token_ids for e in events)
    wait_idle(p)
    wait_idle(d, within_s=15)
    assert serves(p, d, "after-step-fault")


@pytest.fixture(scope="module")
def short_ttl_pair(ray_local, tiny_qwen2_dir):
    """A P and a D whose reservations expire after 0.5 s, shared by the tests that
    keep P busy (each leaves both idle: `wait_idle`)."""
    options = dataclasses.replace(OPTIONS, reservation_ttl_s=0.5, watchdog_interval_s=0.1)
    p = start_worker("prefill", "p-short-ttl", tiny_qwen2_dir, CONFIG, options)
    d = start_worker("decode", "d-short-ttl", tiny_qwen2_dir, CONFIG, options)
    ray.get([p.profile.remote(), d.profile.remote()])  # (the start-up profile steps the engine)
    yield p, d
    for worker in (p, d):
        ray.kill(worker)


def _busy_pair(short_ttl_pair, busy_s: float):
    """The short-TTL pair, P's engine busy for `busy_s` from now."""
    p, d = short_ttl_pair
    ray.get(p.__ray_call__.remote(lambda worker: worker.loop.call(lambda engine: time.sleep(busy_s)) and None))
    return p, d


def test_a_prefill_waiting_on_a_busy_prefill_worker_past_the_ttl_keeps_its_reservation(short_ttl_pair):
    """P's engine is busy six times `reservation_ttl_s` with the request waiting
    there: D keeps its reservation, as P says it holds the request
    (`PrefillWorker.holding`), and the request is served. D dropped it at the
    TTL: P computed the prompt for nobody, and the request failed."""
    p, d = _busy_pair(short_ttl_pair, busy_s=3.0)
    events = asyncio.run(consume(DisaggregatedCall(p, d, GenerateRequest("waits", LONG_PROMPT, SHORT.params), "gloo")))
    assert events[-1].finished and events[-1].error is None and events[-1].finish_reason == "length"
    assert sum(len(e.token_ids) for e in events) == 4
    wait_idle(p)
    wait_idle(d)


@pytest.mark.parametrize("ending", ["error", "abort"])
def test_a_request_whose_reservation_d_drops_before_its_prefill_is_not_prefilled(short_ttl_pair, ending):
    """D ends a request while its prompt waits on a busy P: with an error
    (`abort_transfer`, as a failed transfer or an expired reservation does), or
    as aborted by its client (`end_aborted`, D's part of /abort_request). The
    call took that last event as the end and awaited P, which had not been
    told: it computed the prompt for nobody once free, and the call only
    returned when D refused its first chunk."""
    busy_s = 3.0
    name = f"dropped-{ending}"
    p, d = _busy_pair(short_ttl_pair, busy_s)
    steps = ray.get(p.__ray_call__.remote(lambda worker: worker.engine.num_steps))
    started = time.monotonic()

    async def scenario():
        call = DisaggregatedCall(p, d, GenerateRequest(name, LONG_PROMPT, SHORT.params), "gloo")
        task = asyncio.ensure_future(consume(call))
        while not await p.holding.remote([name]):
            await asyncio.sleep(0.05)
        if ending == "error":
            assert await d.abort_transfer.remote(name, "reservation dropped by D")
        else:
            await d.end_aborted.remote([name])
        return await task

    events = asyncio.run(scenario())
    if ending == "error":
        assert events[-1].finished and "dropped by D" in events[-1].error
    else:
        assert events[-1].finished and events[-1].finish_reason == "abort" and events[-1].error is None
    assert time.monotonic() - started < busy_s  # not waiting for P
    time.sleep(busy_s)
    assert ray.get(p.__ray_call__.remote(lambda worker: worker.engine.num_steps)) == steps  # nothing computed
    wait_idle(p)
    wait_idle(d)
