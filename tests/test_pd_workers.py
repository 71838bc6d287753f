"""Prefill and decode workers on a local Ray: parity with the colocated worker and
HF, bit-exact KV in D's blocks, delta transfer, and block accounting afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time

import pytest
import torch

from actors.config import EngineConfig
from actors.messages import ChunkMeta, GenerateRequest
from actors.sampling_params import SamplingParams
from cluster.pd_request import DisaggregatedCall
from cluster.token_feeds import TokenFeeds, colocated_events
from cluster.workers import start_worker
from tests.conftest import hf_greedy

CHUNK = 32
CONFIG = EngineConfig(block_size=16, prefill_chunk_size=CHUNK, max_num_batched_tokens=128, num_kv_blocks=512)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def workers(ray_local, tiny_qwen2_dir):
    p = start_worker("prefill", "p-main", tiny_qwen2_dir, CONFIG)
    d = start_worker("decode", "d-main", tiny_qwen2_dir, CONFIG)
    c = start_worker("colocated", "c-main", tiny_qwen2_dir, CONFIG)
    ray_local.get([p.ping.remote(), d.ping.remote(), c.ping.remote()])
    yield p, d, c
    for actor in (p, d, c):
        ray_local.kill(actor)


async def disaggregated(p, d, request, channel):
    call = DisaggregatedCall(p, d, request, channel)
    events = [event async for event in call.events()]
    return call, events


async def colocated(c, request):
    feeds = TokenFeeds()
    try:
        return [event async for event in colocated_events(feeds, c, request)]
    finally:
        await feeds.close()


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def assert_idle(ray, *actors):
    for actor in actors:
        stats = ray.get(actor.check_accounting.remote())
        assert stats.num_used_blocks == 0, stats
        assert stats.num_reserved == 0 and stats.num_running == 0, stats


@pytest.mark.parametrize("channel", ["gloo", "object_store"])
def test_concurrent_requests_match_colocated_and_hf(ray_local, workers, tiny_qwen2_dir, channel):
    p, d, c = workers
    rng = random.Random(channel)
    lengths = [1, 31, 32, 33, 64, 100, 128, 150, 192, 200, 224, 250, 255, 256, 17, 5]  # 1 to 8 chunks
    requests = [
        GenerateRequest(f"{channel}-{i}", [rng.randrange(2000) for _ in range(n)], GREEDY)
        for i, n in enumerate(lengths)
    ]

    async def run_all():
        pd = await asyncio.gather(*(disaggregated(p, d, r, channel) for r in requests))
        co = await asyncio.gather(*(colocated(c, r) for r in requests))
        return pd, co

    pd, co = asyncio.run(run_all())
    for request, (call, events), col_events in zip(requests, pd, co):
        assert events[-1].finished and events[-1].error is None, events[-1]
        assert tokens(events) == tokens(col_events)
        assert tokens(events) == hf_greedy(tiny_qwen2_dir, request.prompt_token_ids, GREEDY.max_new_tokens)
        result = call.prefill_result
        assert len(result.chunks) >= 1 and result.first_token_id == tokens(events)[0]
        assert all(t.send_start_s <= t.arrived_s <= t.acknowledged_s for t in result.chunks)  # one machine: one clock
    assert_idle(ray_local, p, d, c)


@pytest.mark.parametrize("channel", ["gloo", "object_store"])
def test_kv_in_decode_blocks_equals_prefill_bit_for_bit(ray_local, workers, channel):
    p, d, _ = workers
    prompt = [random.Random(f"{channel}-bits").randrange(2000) for _ in range(150)]  # 9 full blocks + 6 tokens
    request = GenerateRequest(f"bits-{channel}", prompt, SamplingParams(max_new_tokens=1, temperature=0))
    call, _ = asyncio.run(disaggregated(p, d, request, channel))
    p_blocks = ray_local.get(p.prefix_block_ids.remote(prompt))
    assert len(p_blocks) == 9
    d_blocks = call.reservation.block_ids[:9]
    p_kv = ray_local.get(p.read_blocks.remote(p_blocks))
    d_kv = ray_local.get(d.read_blocks.remote(d_blocks))
    assert p_kv.abs().sum() > 0
    assert torch.equal(p_kv, d_kv)
    assert call.prefill_result.num_bytes_sent == 10 * p_kv[0].numel() * p_kv.element_size()
    assert_idle(ray_local, p, d)


def test_delta_transfer_sends_only_missing_blocks(ray_local, workers):
    p, d, c = workers
    rng = random.Random(9)
    shared = [rng.randrange(2000) for _ in range(100)]  # 6 full blocks
    first = GenerateRequest("delta-a", shared, GREEDY)
    call_a, _ = asyncio.run(disaggregated(p, d, first, "gloo"))
    assert call_a.reservation.num_cached_blocks == 0
    assert call_a.prefill_result.num_blocks_sent == 7
    longer = shared + [rng.randrange(2000) for _ in range(60)]  # 160 tokens: 10 blocks
    second = GenerateRequest("delta-b", longer, GREEDY)
    call_b, events = asyncio.run(disaggregated(p, d, second, "gloo"))
    assert call_b.reservation.num_cached_blocks == 6
    assert call_b.prefill_result.num_blocks_sent == 10 - 6
    assert tokens(events) == tokens(asyncio.run(colocated(c, GenerateRequest("delta-c", longer, GREEDY))))
    assert_idle(ray_local, p, d)


def test_a_requests_cached_tokens_are_those_its_prefill_worker_did_not_compute(ray_local, workers):
    """Usage's `cached_tokens` was D's count of the blocks it was not sent: a prefix
    D held but P computed anew read as cached, one P had but D did not as computed
    (as vLLM's and SGLang's decode side once counted it). It is P's count now."""
    p, d, c = workers
    rng = random.Random(10)
    shared = [rng.randrange(2000) for _ in range(100)]  # 6 full blocks
    asyncio.run(disaggregated(p, d, GenerateRequest("usage-a", shared, GREEDY), "gloo"))
    ray_local.get(p.reset_prefix_cache.remote())  # D holds the prefix, P does not
    d_only = GenerateRequest("usage-b", shared + [rng.randrange(2000) for _ in range(60)], GREEDY)
    call, events = asyncio.run(disaggregated(p, d, d_only, "gloo"))
    assert call.reservation.num_cached_blocks == 6 and events[0].num_cached_tokens == 0
    ray_local.get(d.reset_prefix_cache.remote())  # P holds it (usage-b computed it), D does not
    p_only = GenerateRequest("usage-c", shared + [rng.randrange(2000) for _ in range(60)], GREEDY)
    call, events = asyncio.run(disaggregated(p, d, p_only, "gloo"))
    assert call.reservation.num_cached_blocks == 0 and events[0].num_cached_tokens == 6 * 16
    assert call.prefill_result.num_computed_tokens == len(p_only.prompt_token_ids) - 6 * 16
    assert_idle(ray_local, p, d)


@pytest.mark.parametrize("penalties", [{}, dict(repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.3)],
                         ids=["plain", "penalised"])
def test_seeded_sampling_continues_on_decode(ray_local, workers, penalties):
    """P samples the first token, D the rest, from the seed alone; penalties count
    the prompt on P and the prompt and output on D."""
    p, d, c = workers
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True, **penalties)
    request = GenerateRequest(f"seeded-{bool(penalties)}", list(range(40, 120)), params)
    _, events = asyncio.run(disaggregated(p, d, request, "gloo"))
    assert tokens(events) == tokens(asyncio.run(colocated(c, request)))


def test_min_new_tokens_bans_stop_tokens_from_the_prefill_workers_token_too(ray_local, workers):
    """A bias forces token 7 and 7 stops the request, but not before 3 tokens: P
    samples the first of them, so it must ban 7 too."""
    p, d, c = workers
    params = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(7,), min_new_tokens=3,
                            logit_bias={7: 100.0})
    request = GenerateRequest("min-tokens", list(range(40, 90)), params)
    _, events = asyncio.run(disaggregated(p, d, request, "gloo"))
    got = tokens(events)
    assert len(got) == 4 and 7 not in got[:3] and got[3] == 7 and events[-1].finish_reason == "stop"
    assert got == tokens(asyncio.run(colocated(c, request)))


def test_bad_words_are_banned_from_the_prefill_workers_token_too(ray_local, workers):
    """A bias forces "the" (1522, or 423 after a space), a bad word: P's first
    token is not it, nor are D's, and the tokens are the colocated worker's."""
    p, d, c = workers
    forced = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={423: 100.0, 1522: 100.0})
    assert tokens(asyncio.run(colocated(c, GenerateRequest("forced", list(range(40, 90)), forced))))[0] in (423, 1522)
    params = dataclasses.replace(forced, bad_words=("the",))
    request = GenerateRequest("bad-words", list(range(40, 90)), params)
    _, events = asyncio.run(disaggregated(p, d, request, "gloo"))
    got = tokens(events)
    assert len(got) == 8 and not {423, 1522} & set(got)
    assert got == tokens(asyncio.run(colocated(c, request)))


def test_prompt_logprobs_come_from_the_prefill_worker(ray_local, workers):
    p, d, c = workers
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    request = GenerateRequest("prompt-logprobs", list(range(100, 170)), params)  # 70 tokens: three chunks on P
    _, events = asyncio.run(disaggregated(p, d, request, "gloo"))
    colocated_events_ = asyncio.run(colocated(c, request))
    pd_logprobs, co_logprobs = events[0].prompt_logprobs, colocated_events_[0].prompt_logprobs
    assert len(pd_logprobs) == 70 and pd_logprobs[0] is None and all(lp is not None for lp in pd_logprobs[1:])
    assert [lp.token_id for lp in pd_logprobs[1:]] == request.prompt_token_ids[1:]
    assert [lp.logprob for lp in pd_logprobs[1:]] == pytest.approx([lp.logprob for lp in co_logprobs[1:]], abs=1e-5)
    assert all(e.prompt_logprobs is None for e in events[1:])
    # Again: P computes the whole prompt for its logprobs, D reuses the blocks it holds.
    again = GenerateRequest("prompt-logprobs-again", request.prompt_token_ids, params)
    call, events = asyncio.run(disaggregated(p, d, again, "gloo"))
    assert call.reservation.num_cached_blocks == 4 and call.prefill_result.num_computed_tokens == 70
    assert [lp.logprob for lp in events[0].prompt_logprobs[1:]] == [lp.logprob for lp in pd_logprobs[1:]]
    assert_idle(ray_local, p, d, c)


def test_a_speculating_decode_worker_streams_the_colocated_tokens(ray_local, workers, tiny_qwen2_dir):
    """D drafts by prompt lookup (actors/speculation.py) and streams several tokens
    a step where drafts stand: the colocated worker's tokens, greedy and seeded."""
    p, _, c = workers
    d = start_worker("decode", "d-speculating", tiny_qwen2_dir,
                     dataclasses.replace(CONFIG, num_speculative_tokens=4, prompt_lookup_min=1))
    try:
        requests = [GenerateRequest(f"spec-{i}", [7, 8, 9] * (6 + i), SamplingParams(
            max_new_tokens=40, temperature=t, seed=i, ignore_eos=True)) for i, t in enumerate([0.0, 0.0, 0.9])]

        async def run_all():
            return await asyncio.gather(*(disaggregated(p, d, r, "gloo") for r in requests))

        for request, (_, events) in zip(requests, asyncio.run(run_all())):
            assert events[-1].finished and events[-1].error is None, events[-1]
            assert tokens(events) == tokens(asyncio.run(colocated(c, request)))
        stats = ray_local.get(d.stats.remote())
        assert 0 < stats.num_accepted_draft_tokens <= stats.num_draft_tokens
        assert_idle(ray_local, p, d)
    finally:
        ray_local.kill(d)


def _sharing_a_system_prompt(tag: str, count: int) -> list[GenerateRequest]:
    """Prompts that begin with the same 96 tokens (6 blocks), then 20 of their own."""
    rng = random.Random(tag)
    system = [rng.randrange(2000) for _ in range(96)]
    return [GenerateRequest(f"{tag}-{i}", system + [rng.randrange(2000) for _ in range(20)], GREEDY)
            for i in range(count)]


async def _until(predicate, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_prompt_borrowing_blocks_still_on_their_way_decodes_once_they_land(ray_local, workers):
    """The second request reserves while the first's KV has not come: it borrows
    the first's six system-prompt blocks (actors/arriving_blocks.py), its P sends
    only its own two, and D holds it, its KV otherwise whole, until the first's
    chunks wrote them; then it decodes the colocated tokens."""
    p, d, c = workers
    first, second = _sharing_a_system_prompt("borrow", 2)

    async def scenario():
        feeds = TokenFeeds()
        feed = feeds.of(d)
        try:
            with feed.expect(first.request_id) as first_events:
                reservation = await d.reserve.remote(first, feed.subscription, p)
                call = DisaggregatedCall(p, d, second, "gloo", feeds=feeds)
                seen = []
                reading = asyncio.ensure_future(_collect(call, seen))
                await _until(lambda: call.prefill_result is not None)  # its own chunks are all in on D
                held = (list(seen), await d.stats.remote())
                first_result = await p.prefill.remote(first, reservation, d, "gloo")
                await asyncio.wait_for(reading, 30)
                return reservation, call, held, seen, first_result, [e async for e in first_events]
        finally:
            await feeds.close()

    reservation, call, (seen_then, stats_then), events, first_result, first_events = asyncio.run(scenario())
    assert call.reservation.num_cached_blocks == 6 and call.reservation.block_ids[:6] == reservation.block_ids[:6]
    assert call.prefill_result.num_blocks_sent == 8 - 6 and first_result.num_blocks_sent == 8
    assert seen_then == [] and stats_then.num_reserved == 2  # held: no token before the borrowed blocks came
    assert events[0].time_s >= max(t.arrived_s for t in first_result.chunks)
    assert tokens(events) == tokens(asyncio.run(colocated(c, second)))
    assert tokens(first_events) == tokens(asyncio.run(colocated(c, first)))
    assert_idle(ray_local, p, d, c)


async def _collect(call: DisaggregatedCall, into: list) -> None:
    async for event in call.events():
        into.append(event)


@pytest.mark.parametrize("when", ["awaiting its own KV", "its own KV in"])
def test_a_lender_ended_before_its_blocks_came_ends_its_borrowers_which_are_served_again(ray_local, workers, when):
    """The first request is aborted before any of its KV came. The second borrowed
    its blocks, so its KV can never be whole: D ends it too, saying why and whose
    fault it was, before or after its own chunks came; D holds nothing after; sent
    again, it is served."""
    p, d, c = workers
    first, second = _sharing_a_system_prompt(f"lender-{when}", 2)

    async def scenario():
        feeds = TokenFeeds()
        feed = feeds.of(d)
        try:
            with feed.expect(first.request_id) as first_events:
                await d.reserve.remote(first, feed.subscription, p)
                if when == "awaiting its own KV":
                    with feed.expect(second.request_id) as second_events:
                        await d.reserve.remote(second, feed.subscription, p)
                        await d.abort.remote(first.request_id, "its client left")
                        events = [e async for e in second_events]
                else:
                    call = DisaggregatedCall(p, d, second, "gloo", feeds=feeds)
                    events = []
                    reading = asyncio.ensure_future(_collect(call, events))
                    await _until(lambda: call.prefill_result is not None)
                    await d.abort.remote(first.request_id, "its client left")
                    await asyncio.wait_for(reading, 30)
                return events, [e async for e in first_events]
        finally:
            await feeds.close()

    events, first_events = asyncio.run(scenario())
    assert first_events[-1].error == "its client left"
    assert len(events) == 1 and events[0].token_ids == []
    assert events[0].error == f"request {first.request_id}, whose KV blocks it shared, ended before they came"
    assert events[0].borrowed_kv_lost  # (the fault was its lender's: its scheduler tries it again on this pair)
    assert_idle(ray_local, p, d)
    again = dataclasses.replace(second, request_id=f"{second.request_id}-again")
    call, events = asyncio.run(disaggregated(p, d, again, "gloo"))
    assert call.reservation.num_cached_blocks == 0 and call.prefill_result.num_blocks_sent == 8
    assert tokens(events) == tokens(asyncio.run(colocated(c, again)))
    assert_idle(ray_local, p, d, c)


def test_requests_aborted_together_end_aborted_though_one_borrowed_the_others_blocks(ray_local, workers):
    """An n=2 call's choices share its rid, and the second borrows the first's
    blocks on D. `/abort_request` for the rid ended the first, and with it the
    second as a borrower whose lender failed: an error its scheduler answered by
    trying it again on another pair, where an abort was asked."""
    p, d = workers[:2]
    first, second = (dataclasses.replace(r, client_rid="call-n2") for r in _sharing_a_system_prompt("n-abort", 2))

    async def scenario():
        feeds = TokenFeeds()
        feed = feeds.of(d)
        try:
            with feed.expect(first.request_id) as first_events, feed.expect(second.request_id) as second_events:
                await d.reserve.remote(first, feed.subscription, p)
                borrower = await d.reserve.remote(second, feed.subscription, p)
                aborted = await d.abort_named.remote("call-n2")
                return borrower, aborted, [e async for e in first_events], [e async for e in second_events]
        finally:
            await feeds.close()

    borrower, aborted, first_events, second_events = asyncio.run(scenario())
    assert borrower.num_cached_blocks == 6 and sorted(aborted) == sorted([first.request_id, second.request_id])
    for events in (first_events, second_events):
        assert [(e.finish_reason, e.error, e.borrowed_kv_lost) for e in events] == [("abort", None, False)]
    assert_idle(ray_local, p, d)


def _real_kv(ray, c, request: GenerateRequest, num_blocks: int) -> torch.Tensor:
    """The KV of a prompt's first blocks, as the colocated worker computes them."""
    asyncio.run(colocated(c, dataclasses.replace(request, request_id=f"{request.request_id}-kv")))
    return ray.get(c.read_blocks.remote(ray.get(c.prefix_block_ids.remote(request.prompt_token_ids))[:num_blocks]))


async def _send_by_hand(d, request_id: str, block_ids: list[int], kv: torch.Tensor, blocks_a_chunk: int = 2) -> None:
    """Send `kv` into D's `block_ids` as P would, a chunk at a time, never the last."""
    await d.open_channel.remote("by-hand", "object_store")
    for index, start in enumerate(range(0, len(block_ids), blocks_a_chunk)):
        meta = ChunkMeta(request_id, index, block_ids[start:start + blocks_a_chunk], is_last=False)
        await d.receive_chunk.remote(meta, "by-hand", kv[start:start + blocks_a_chunk])


def _ended_midway(p, d, first: GenerateRequest, kv: torch.Tensor, borrower: GenerateRequest | None = None):
    """Reserve `first` on D (then `borrower`, which borrows its blocks), send `kv`
    into its first blocks by hand, and abort it as its client would: the last
    reservation made, and its request's events."""
    requests = [first] + ([borrower] if borrower else [])

    async def scenario():
        feeds = TokenFeeds()
        feed = feeds.of(d)
        try:
            with contextlib.ExitStack() as stack:
                streams = [stack.enter_context(feed.expect(r.request_id)) for r in requests]
                reservations = [await d.reserve.remote(r, feed.subscription, p) for r in requests]
                await _send_by_hand(d, first.request_id, reservations[0].block_ids[:len(kv)], kv)
                await d.abort.remote(first.request_id, "its client left")
                return reservations[-1], [e async for e in streams[-1]]
        finally:
            await d.close_channel.remote("by-hand")
            await feeds.close()

    return asyncio.run(scenario())


def test_a_reservation_ended_midway_keeps_the_blocks_whose_kv_came(ray_local, workers):
    """A request whose client left after 4 of its 8 blocks came: D freed them
    unfindable, and the same prompt sent again (the scheduler's retry, the
    client's next try) was sent whole. They are in D's prefix cache now: it is
    sent the other 4, and its tokens are the colocated ones."""
    p, d, c = workers
    (first,) = _sharing_a_system_prompt("midway", 1)
    reservation, events = _ended_midway(p, d, first, _real_kv(ray_local, c, first, 4))
    assert events[-1].error == "its client left"
    again = dataclasses.replace(first, request_id="midway-again")
    call, events = asyncio.run(disaggregated(p, d, again, "gloo"))
    assert call.reservation.num_cached_blocks == 4 and call.reservation.block_ids[:4] == reservation.block_ids[:4]
    assert call.prefill_result.num_blocks_sent == 8 - 4
    assert tokens(events) == tokens(asyncio.run(colocated(c, again)))
    assert_idle(ray_local, p, d, c)


def test_a_lender_ended_midway_keeps_what_came_and_its_borrowers_no_more(ray_local, workers):
    """The first request lends its 6 system-prompt blocks to the second; only 2
    came before its client left. The second ends (its blocks 3 to 6 never will
    come); the 2 that came are kept, not the 4 that did not, which the second
    also held: the third request shares 2, and decodes the colocated tokens."""
    p, d, c = workers
    first, second, third = _sharing_a_system_prompt("lent-midway", 3)
    borrower, events = _ended_midway(p, d, first, _real_kv(ray_local, c, first, 2), borrower=second)
    assert borrower.num_cached_blocks == 6 and events[-1].borrowed_kv_lost
    call, events = asyncio.run(disaggregated(p, d, third, "gloo"))
    assert call.reservation.num_cached_blocks == 2 and call.prefill_result.num_blocks_sent == 8 - 2
    assert tokens(events) == tokens(asyncio.run(colocated(c, third)))
    assert_idle(ray_local, p, d, c)
