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
from actors.messages import GenerateRequest, RequestAborted, ReservationInfo
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
