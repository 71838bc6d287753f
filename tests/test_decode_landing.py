"""A prompt's KV landing on D. A chunk must target the reservation's next
blocks: one aimed at a block D's prefix cache already held was written over it
in place (another request's prefix), and counted as a block come. A request
whose KV has all come but that the decode engine fails to start
(`Engine.activate` raising) was already out of `_pending`, so neither the
watchdog nor P's `abort_transfer` would ever free its blocks, and its stream
waited for a first token that never came: it is ended in the same engine call,
its blocks freed and its stream failed; requests parked on blocks its last
chunk wrote (they borrowed them) start all the same. The worker runs in this
process, without Ray; the engine's fault is injected into its first-token path."""

from __future__ import annotations

import asyncio

import pytest
import torch

from actors.config import EngineConfig
from actors.decode_worker import DecodeWorker
from actors.messages import ChunkMeta, GenerateRequest, TokenEvent, TransferFailed
from actors.sampling_params import SamplingParams

CONFIG = EngineConfig(block_size=16, num_kv_blocks=64, prefill_chunk_size=48)
PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0)


async def _send_all(worker: DecodeWorker, info, first_token_id: int = 7) -> float:
    """The chunk P would send for a reservation: every block after those D holds, with the first token."""
    cache = worker.engine.runner.kv_cache
    block_ids = info.block_ids[info.num_cached_blocks:]
    payload = torch.zeros((len(block_ids),) + tuple(cache.shape[1:]), dtype=cache.dtype)
    meta = ChunkMeta(info.request_id, 0, block_ids, True, first_token_id=first_token_id)
    return await worker.receive_chunk(meta, "pd", payload)


async def _ends(feed, request_ids: set[str]) -> dict[str, TokenEvent]:
    """The first event of each request, or its last if it ends in its first list
    (within 30 s: a request left parked never has one)."""
    seen: dict[str, TokenEvent] = {}
    while not request_ids <= set(seen):
        for event in map(TokenEvent._make, await asyncio.wait_for(anext(feed), 30)):
            seen.setdefault(event.request_id, event)
            if event.finished:
                seen[event.request_id] = event
    return seen


def test_a_chunk_aimed_at_blocks_d_holds_cached_is_refused_and_writes_nothing(tiny_qwen2_dir):
    prompt = list(range(3, 73))  # 4 full blocks and 6 tokens

    async def scenario():
        worker = DecodeWorker("d0", tiny_qwen2_dir, CONFIG)
        feed = worker.feed("feed")
        await worker.open_channel("pd", "object_store")
        first = await worker.reserve(GenerateRequest("first", prompt, PARAMS), "feed", None)
        await _send_all(worker, first)
        while not (await _ends(feed, {"first"}))["first"].finished:  # (its blocks cached once it ends)
            pass
        again = await worker.reserve(GenerateRequest("again", prompt, PARAMS), "feed", None)
        cache = worker.engine.runner.kv_cache
        cached_before = cache[again.block_ids[0]].clone()
        ones = torch.ones((1,) + tuple(cache.shape[1:]), dtype=cache.dtype)
        aimed = ChunkMeta("again", 0, again.block_ids[:1], False)
        outcome = await asyncio.gather(worker.receive_chunk(aimed, "pd", ones), return_exceptions=True)
        overwritten = not torch.equal(cached_before, cache[again.block_ids[0]])
        num_in = worker._pending["again"].num_in
        landed = await _send_all(worker, again)
        await feed.aclose()
        worker.loop.stop()
        return again.num_cached_blocks, outcome[0], overwritten, num_in, landed

    num_cached, outcome, overwritten, num_in, landed = asyncio.run(scenario())
    assert num_cached == 4 and num_in == 4
    assert isinstance(outcome, TransferFailed) and "expected" in str(outcome) and not overwritten
    assert isinstance(landed, float)  # (the right chunk, after: the reservation is in step still)


def _fail_first_token_of(worker: DecodeWorker, request_id: str) -> None:
    """`Engine.activate` raises for `request_id`, past the point where it took the reservation."""
    writer = worker.engine.writer
    take_drawn = writer.take_drawn

    def failing(request, *args, **kwargs):
        if request.request_id == request_id:
            raise RuntimeError("injected")
        return take_drawn(request, *args, **kwargs)

    writer.take_drawn = failing


def test_a_request_the_engine_fails_to_start_is_ended_and_frees_its_blocks(tiny_qwen2_dir):
    async def scenario():
        worker = DecodeWorker("d0", tiny_qwen2_dir, CONFIG)
        feed = worker.feed("feed")
        await worker.open_channel("pd", "object_store")
        info = await worker.reserve(GenerateRequest("r1", list(range(3, 40)), PARAMS), "feed", None)
        _fail_first_token_of(worker, "r1")
        outcome = await asyncio.gather(_send_all(worker, info), return_exceptions=True)
        ended = await _ends(feed, {"r1"})
        await feed.aclose()
        engine = worker.engine
        held = dict(engine.requests), dict(engine.reservations), engine.pool.num_used
        worker.loop.stop()
        return outcome[0], ended["r1"], held

    outcome, event, (requests, reservations, used) = asyncio.run(scenario())
    assert isinstance(outcome, TransferFailed) and "injected" in str(outcome)
    assert event.finished and "could not start decoding" in event.error
    assert requests == {} and reservations == {} and used == 0


@pytest.mark.parametrize("lender_fails", [False, True])
def test_a_borrower_parked_on_a_lenders_blocks_starts_once_they_are_written(tiny_qwen2_dir, lender_fails):
    """B borrows the 4 blocks L's KV is still to fill; B's own chunk comes first,
    and B waits, parked. L's chunk writes them: B starts, whether L does or not."""
    shared = list(range(3, 67))

    async def scenario():
        worker = DecodeWorker("d0", tiny_qwen2_dir, CONFIG)
        feed = worker.feed("feed")
        await worker.open_channel("pd", "object_store")
        lender = await worker.reserve(GenerateRequest("L", shared + [500], PARAMS), "feed", None)
        borrower = await worker.reserve(GenerateRequest("B", shared + list(range(100, 120)), PARAMS), "feed", None)
        await _send_all(worker, borrower)
        parked = set(worker._parked)
        if lender_fails:
            _fail_first_token_of(worker, "L")
        outcome = await asyncio.gather(_send_all(worker, lender), return_exceptions=True)
        firsts = await _ends(feed, {"L", "B"})
        await feed.aclose()
        engine = worker.engine
        state = set(worker._parked), set(engine.requests)
        worker.loop.stop()
        return len(borrower.block_ids) - borrower.num_cached_blocks, parked, outcome[0], firsts, state

    own_blocks, parked, outcome, firsts, (still_parked, decoding) = asyncio.run(scenario())
    assert own_blocks == 2 and parked == {"B"}
    assert firsts["B"].error is None and firsts["B"].token_ids == [7]
    assert still_parked == set()
    if lender_fails:
        assert isinstance(outcome, TransferFailed)
        assert firsts["L"].finished and "could not start decoding" in firsts["L"].error
        assert "L" not in decoding
    else:
        assert isinstance(outcome, float) and firsts["L"].error is None


def test_borrowers_parked_on_a_lenders_blocks_start_together_when_its_chunk_lands(tiny_qwen2_dir):
    """Eight requests parked on the lender's blocks started one engine call, so
    one engine step, each: the lender's last chunk, whose answer P's sender waits
    for before the pair's next chunk, was answered 9 steps after it landed (1 with
    none parked). With requests decoding, so that the engine steps between calls:
    started in one call, the borrowers decode in step, each as many tokens in."""
    shared = list(range(3, 67))
    long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)

    async def scenario():
        worker = DecodeWorker("d0", tiny_qwen2_dir, EngineConfig(block_size=16, num_kv_blocks=256,
                                                                 prefill_chunk_size=48))
        feed = worker.feed("feed")
        await worker.open_channel("pd", "object_store")
        drained = asyncio.ensure_future(_drain(feed))
        for k in range(4):
            await _send_all(worker, await worker.reserve(GenerateRequest(f"run{k}", list(range(500 + k, 540 + k)),
                                                                         long), "feed", None))
        lender = await worker.reserve(GenerateRequest("L", shared + [900], long), "feed", None)
        for i in range(8):
            prompt = shared + list(range(1000 + 10 * i, 1005 + 10 * i))
            await _send_all(worker, await worker.reserve(GenerateRequest(f"B{i}", prompt, long), "feed", None))
        parked = set(worker._parked)
        before = worker.engine.num_steps
        await _send_all(worker, lender)
        steps = worker.engine.num_steps - before
        drained.cancel()
        worker.loop.stop()
        requests = worker.engine.requests
        return parked, steps, {len(requests[f"B{i}"].output_token_ids) for i in range(8)}, set(worker._parked)

    parked, steps, num_generated, still_parked = asyncio.run(scenario())
    assert parked == {f"B{i}" for i in range(8)} and still_parked == set()
    assert len(num_generated) == 1, num_generated  # (one apart at each step before: 8 counts)
    assert steps < 8, steps  # (2 here, 9 before)


async def _drain(feed) -> None:
    async for _ in feed:
        pass
