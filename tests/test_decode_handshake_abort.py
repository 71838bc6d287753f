"""A decode worker's handshake aborted before it has started: the scheduler's
cleanup `abort` can reach D while `reserve` is still making the request's
structured-output automaton (off the event loop), before the request had a stream
there. The abort found nothing to end, and the reservation granted afterwards
held its blocks until `reservation_ttl_s`. Now the stream opens before the
first await, and the abort frees the request and ends its stream in one call
on the engine thread, where the reservation is made: whichever comes first,
nothing is left held. The worker runs in this process, without Ray."""

from __future__ import annotations

import asyncio

from actors.config import EngineConfig
from actors.decode_worker import DecodeWorker
from actors.messages import GenerateRequest, RequestAborted, ReservationInfo, TokenEvent
from actors.sampling_params import SamplingParams

CONFIG = EngineConfig(block_size=16, num_kv_blocks=64, prefill_chunk_size=48)


def test_an_abort_that_arrives_while_the_handshake_prepares_its_pattern_ends_it(tiny_qwen2_dir):
    params = SamplingParams(max_new_tokens=4, temperature=0.0, regex="[a-z]{3}[0-9]{2}")

    async def scenario():
        worker = DecodeWorker("d0", tiny_qwen2_dir, CONFIG)
        request = GenerateRequest("r1", list(range(3, 40)), params)
        reserving = asyncio.ensure_future(worker.reserve(request, "feed", None, wait_s=0.0))
        await asyncio.sleep(0)  # reserve runs to its first await: the pattern, in a thread
        await worker.abort("r1")
        outcome = await asyncio.gather(reserving, return_exceptions=True)
        engine = worker.engine
        pending = dict(worker._pending)
        worker.loop.stop()
        return outcome[0], pending, engine.pool.num_used

    outcome, pending, used = asyncio.run(scenario())
    assert isinstance(outcome, (RequestAborted, ReservationInfo)), outcome  # (granted, then cancelled)
    assert pending == {} and used == 0


def test_a_handshake_cancelled_as_its_reservation_is_granted_frees_it(tiny_qwen2_dir):
    """The scheduler's call cancelled (its client left) just as the engine thread
    granted the reservation (that call runs to its end): nobody waited for the
    blocks, which were held until `reservation_ttl_s`. They are freed."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0)

    async def scenario():
        worker = DecodeWorker("d0", tiny_qwen2_dir, CONFIG)
        granted = worker._try_reserve

        async def cancelled_as_granted(request, prefill_handle):
            assert await granted(request, prefill_handle) is not None
            raise asyncio.CancelledError  # (as the cancellation reaches the waiting call)

        worker._try_reserve = cancelled_as_granted
        outcome = await asyncio.gather(worker.reserve(GenerateRequest("r1", list(range(3, 40)), params), "feed"),
                                       return_exceptions=True)
        await worker.call(lambda engine: None)  # (the engine calls queued before it have run)
        engine = worker.engine
        held = dict(worker._pending), dict(engine.reservations), engine.pool.num_used
        worker.loop.stop()
        return outcome[0], held

    outcome, (pending, reservations, used) = asyncio.run(scenario())
    assert isinstance(outcome, asyncio.CancelledError)
    assert pending == {} and reservations == {} and used == 0


def test_one_abort_of_a_lender_and_its_borrowers_ends_each_as_aborted(tiny_qwen2_dir):
    """L's prompt blocks are still to come when B borrows them, and C borrows both
    L's and B's own: one `/abort_request` naming all three ends each as aborted.
    C, ended within B's release as a borrower of a lost block, ended as an error
    the scheduler retries (`borrowed_kv_lost`), another pair then serving it."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    shared, more = list(range(3, 67)), list(range(100, 132))  # 4 blocks, then 2 more

    async def scenario():
        worker = DecodeWorker("d0", tiny_qwen2_dir, CONFIG)
        feed = worker.feed("feed")
        for request_id, prompt in (("L", shared + [500]), ("B", shared + more + [501]), ("C", shared + more + [502])):
            await worker.reserve(GenerateRequest(request_id, prompt, params, request_id), "feed", None, wait_s=0.0)
        borrowed = {rid: len(worker._pending[rid].borrowed) for rid in ("B", "C")}
        await worker.end_aborted(["L", "B", "C"])
        ended = {}
        while len(ended) < 3:
            for event in map(TokenEvent._make, await anext(feed)):
                if event.finished:
                    ended[event.request_id] = (event.finish_reason, event.error, event.borrowed_kv_lost)
        await feed.aclose()
        pending = dict(worker._pending)
        worker.loop.stop()
        return borrowed, ended, pending, worker.engine.pool.num_used

    borrowed, ended, pending, used = asyncio.run(scenario())
    assert borrowed == {"B": 4, "C": 6}
    assert ended == {rid: ("abort", None, False) for rid in ("L", "B", "C")}
    assert pending == {} and used == 0
