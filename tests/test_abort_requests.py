"""A client's abort (`/abort_request`) on the workers: whatever step a request is
at (waiting in D's line, prefilling and sending its KV, decoding, colocated), its
events end with finish_reason "abort" and no error, so the scheduler does not
retry it elsewhere; what it held is freed, and requests of other names go on."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import ray

from actors.config import EngineConfig
from actors.messages import ChunkMeta, GenerateRequest, RequestAborted, TransferFailed
from actors.sampling_params import SamplingParams
from actors.worker_base import WorkerOptions
from cluster.pd_request import DisaggregatedCall
from cluster.token_feeds import TokenFeeds, colocated_events
from cluster.workers import start_worker
from tests.conftest import wait_idle

# Small chunks make a long prompt's prefill and transfer last long enough to abort.
CONFIG = EngineConfig(block_size=16, prefill_chunk_size=16, max_num_batched_tokens=64, num_kv_blocks=400)
OPTIONS = WorkerOptions(transfer_timeout_s=5.0, reservation_ttl_s=30.0, watchdog_interval_s=0.2)
LONG_PROMPT = [random.Random(5).randrange(2000) for _ in range(1800)]
ENDLESS = SamplingParams(max_new_tokens=2000, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(ray_local, tiny_qwen2_dir):
    p = start_worker("prefill", "p-abort", tiny_qwen2_dir, CONFIG, OPTIONS)
    d = start_worker("decode", "d-abort", tiny_qwen2_dir, CONFIG, OPTIONS)
    ray.get([p.ping.remote(), d.ping.remote()])
    return p, d


def request(request_id: str, client_rid: str, prompt=None) -> GenerateRequest:
    return GenerateRequest(request_id, prompt or list(range(1, 40)), ENDLESS, client_rid)


async def events_of(call: DisaggregatedCall, seen: asyncio.Event | None = None, after_tokens: int = 1) -> list:
    """Every event of the call; `seen` is set once it has `after_tokens` tokens."""
    events = []
    async for event in call.events():
        events.append(event)
        if seen is not None and sum(len(e.token_ids) for e in events) >= after_tokens:
            seen.set()
    return events


async def abort(p, d, client_rid: str | None) -> set[str]:
    """As the scheduler's PoolView does: D's side first, then P's."""
    ended = set(await d.abort_named.remote(client_rid))
    return ended | set(await p.abort_named.remote(client_rid))


def assert_aborted(events: list) -> None:
    last = events[-1]
    assert last.finished and last.finish_reason == "abort" and last.error is None, last
    assert all(not e.finished for e in events[:-1])


def test_a_decoding_request_ends_as_aborted_and_another_name_goes_on(pair):
    p, d = pair

    async def scenario():
        decoding = asyncio.Event()
        target = asyncio.ensure_future(events_of(DisaggregatedCall(p, d, request("a-1", "mine"), "gloo"),
                                                 decoding, after_tokens=5))
        other_call = DisaggregatedCall(p, d, GenerateRequest("b-1", list(range(3, 50)), SamplingParams(
            max_new_tokens=40, temperature=0, ignore_eos=True), "theirs"), "gloo")
        other = asyncio.ensure_future(events_of(other_call))
        await asyncio.wait_for(decoding.wait(), 60)
        ended = await abort(p, d, "mine")
        return ended, await asyncio.wait_for(target, 30), await asyncio.wait_for(other, 60)

    ended, events, other = asyncio.run(scenario())
    assert ended == {"a-1"}
    assert_aborted(events)
    assert 5 <= sum(len(e.token_ids) for e in events) < ENDLESS.max_new_tokens  # what it had made, then no more
    assert other[-1].finish_reason == "length" and sum(len(e.token_ids) for e in other) == 40
    wait_idle(p)
    wait_idle(d)


@pytest.mark.parametrize("sides", ["both", "prefill only", "decode only"])
def test_a_request_aborted_mid_transfer_ends_as_aborted_and_frees_both_sides(pair, sides):
    """`prefill only`: the abort reached P but not D (it was reserved on D just
    after D's part of the abort ran): P's RequestAborted ends it on D too.
    `decode only`: P sent a chunk between D's part of the abort and its own (the
    scheduler asks D first): D refuses it as aborted, not as a failed transfer
    (which also made `both` fail now and then)."""
    p, d = pair
    rid = f"mid-{sides}"

    def chunks_landed(worker) -> int:  # (nested: Ray ships it by value to D)
        with worker._pending_lock:
            pending = worker._pending.get(f"{rid}-0")
        return 0 if pending is None else pending.next_chunk

    async def scenario():
        call = DisaggregatedCall(p, d, request(f"{rid}-0", rid, LONG_PROMPT), "gloo")
        task = asyncio.ensure_future(events_of(call))
        deadline = time.monotonic() + 60
        while not await d.__ray_call__.remote(chunks_landed):
            assert not task.done() and time.monotonic() < deadline, "the transfer ended before a chunk landed"
            await asyncio.sleep(0.005)
        side = {"prefill only": p, "decode only": d}.get(sides)
        ended = await (abort(p, d, rid) if side is None else side.abort_named.remote(rid))
        return call, set(ended), await asyncio.wait_for(task, 30)

    call, ended, events = asyncio.run(scenario())
    assert ended == {f"{rid}-0"}
    assert events == events[-1:] and not events[0].token_ids  # no token came before the abort
    assert_aborted(events)
    assert call.prefill_result is None and call.prefill_error is None  # not a failure
    wait_idle(p)
    wait_idle(d)


def test_a_last_chunk_that_lands_as_its_request_is_aborted_activates_nothing(pair):
    """The abort freed the reservation between the last chunk's write and its
    activation: the activation does nothing, instead of failing (a KeyError that
    failed the chunk's transfer, and so every request on the P-D channel)."""
    p, d = pair
    ray.get(d.reserve.remote(request("late-0", "late"), "unread", p))
    assert ray.get(d.abort_named.remote("late")) == ["late-0"]
    last = ChunkMeta("late-0", 0, [], is_last=True, first_token_id=5)

    def activate_now(worker) -> None:  # (the engine loop is idle: nothing else touches the engine)
        worker._activate_on_engine(worker.engine, last)

    ray.get(d.__ray_call__.remote(activate_now))
    wait_idle(d)


def test_a_request_still_on_its_way_when_its_abort_came_does_not_start(pair):
    """The abort reached D before the request's handshake did (the scheduler had
    taken the request earlier): D ends it at the handshake (actors/abort_marks.py).
    A request of the same name taken after the abort is served."""
    p, d = pair
    asked_s = time.time()
    assert ray.get(d.abort_named.remote("on-its-way", asked_s)) == []  # nothing of that name here yet
    short = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    before = GenerateRequest("way-0", list(range(1, 40)), short, "on-its-way", asked_s - 1)
    after = GenerateRequest("way-1", list(range(1, 40)), short, "on-its-way", asked_s + 1)
    events = asyncio.run(events_of(DisaggregatedCall(p, d, before, "gloo")))
    assert len(events) == 1
    assert_aborted(events)
    served = asyncio.run(events_of(DisaggregatedCall(p, d, after, "gloo")))
    assert served[-1].finish_reason == "length" and sum(len(e.token_ids) for e in served) == 4
    wait_idle(p)
    wait_idle(d)


def test_a_prefill_that_comes_after_its_clients_abort_is_turned_away(pair):
    """D reserved a request, then the abort came (D's part ended the reservation,
    P held nothing of it yet); its prefill, coming after, computed the whole
    prompt for nobody, and the call waited for it. A request of that name taken
    after the abort is prefilled."""
    p, d = pair
    late = GenerateRequest("late-0", LONG_PROMPT, ENDLESS, "late", time.time())
    reservation = ray.get(d.reserve.remote(late, "unread", p))
    steps = ray.get(p.__ray_call__.remote(lambda worker: worker.engine.num_steps))
    assert asyncio.run(abort(p, d, "late")) == {"late-0"}
    with pytest.raises(RequestAborted, match="before its prefill came"):
        ray.get(p.prefill.remote(late, reservation, d, "gloo"))
    assert ray.get(p.__ray_call__.remote(lambda worker: worker.engine.num_steps)) == steps
    short = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    served = asyncio.run(events_of(DisaggregatedCall(p, d, GenerateRequest("late-1", list(range(1, 40)), short,
                                                                           "late", time.time() + 1), "gloo")))
    assert served[-1].finish_reason == "length" and sum(len(e.token_ids) for e in served) == 4
    wait_idle(p)
    wait_idle(d)


def test_a_handshake_waiting_in_line_ends_as_aborted(ray_local, tiny_qwen2_dir):
    small = EngineConfig(block_size=16, prefill_chunk_size=16, num_kv_blocks=12)
    p = start_worker("prefill", "p-abort-line", tiny_qwen2_dir, CONFIG, OPTIONS)
    d = start_worker("decode", "d-abort-line", tiny_qwen2_dir, small, OPTIONS)
    params = SamplingParams(max_new_tokens=4)
    ray.get(d.reserve.remote(GenerateRequest("hold", list(range(1, 150)), params), "unread", p))  # 10 blocks

    async def scenario():
        waits = GenerateRequest("waits-0", list(range(500, 559)), params, "waits")  # 4 blocks, none held's
        call = DisaggregatedCall(p, d, waits, "gloo")
        task = asyncio.ensure_future(events_of(call))
        deadline = time.monotonic() + 10
        while (await d.stats.remote()).num_waiting_handshakes < 1:
            assert time.monotonic() < deadline, "the handshake never waited in line"
            await asyncio.sleep(0.05)
        ended = await abort(p, d, "waits")
        return ended, await asyncio.wait_for(task, 10)

    ended, events = asyncio.run(scenario())
    assert ended == {"waits-0"}
    assert len(events) == 1
    assert_aborted(events)
    ray.get(d.abort.remote("hold"))
    wait_idle(d)


def test_a_colocated_request_ends_as_aborted_and_abort_all_ends_every_one(ray_local, tiny_qwen2_dir):
    c = start_worker("colocated", "c-abort", tiny_qwen2_dir, CONFIG)
    ray.get(c.ping.remote())

    async def scenario():
        feeds = TokenFeeds()
        decoding = [asyncio.Event(), asyncio.Event()]

        async def run(k: int) -> list:
            events = []
            async for event in colocated_events(feeds, c, request(f"c-{k}", f"name-{k}")):
                events.append(event)
                if sum(len(e.token_ids) for e in events) >= 3:
                    decoding[k].set()
            return events

        tasks = [asyncio.ensure_future(run(k)) for k in range(2)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in decoding)), 60)
        assert await c.abort_named.remote("nobody's") == []
        ended = await c.abort_named.remote(None)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await feeds.close()
        return set(ended), results

    ended, results = asyncio.run(scenario())
    assert ended == {"c-0", "c-1"}
    for events in results:
        assert_aborted(events)

    async def on_its_way():  # abort_all asked before the worker saw a request taken earlier
        feeds = TokenFeeds()
        late = GenerateRequest("c-late", list(range(1, 40)), ENDLESS, "", time.time() - 1)
        events = [event async for event in colocated_events(feeds, c, late)]
        await feeds.close()
        return events

    ray.get(c.abort_named.remote(None, time.time()))
    events = asyncio.run(on_its_way())
    assert len(events) == 1
    assert_aborted(events)
    wait_idle(c)


def test_a_prefill_that_comes_after_its_abort_is_turned_away(pair):
    """A scheduler whose client left sends P `prefill` and then `abort` a moment
    apart, and an async actor may run them in either order: an abort of a
    request P did not hold was forgotten, and its prompt computed for nobody."""
    p, d = pair
    early = request("early-0", "early", LONG_PROMPT)
    reservation = ray.get(d.reserve.remote(early, "unread", p))
    steps = ray.get(p.__ray_call__.remote(lambda worker: worker.engine.num_steps))
    assert ray.get(p.abort.remote("early-0", "its client left")) is False  # (nothing of it here yet)
    with pytest.raises(TransferFailed, match="its client left"):
        ray.get(p.prefill.remote(early, reservation, d, "gloo"))
    assert ray.get(p.__ray_call__.remote(lambda worker: worker.engine.num_steps)) == steps
    ray.get(d.abort.remote("early-0"))
    wait_idle(p)
    wait_idle(d)


def test_an_abort_that_reaches_prefill_while_its_channel_opens_ends_it(ray_local, tiny_qwen2_dir):
    """P's first request to a D waits for their channel to open (a round trip to D,
    the gloo rendezvous). An abort arriving then found no job on P (it was made
    after the opening), and P computed the prompt anyway, for nobody."""
    p = start_worker("prefill", "p-abort-open", tiny_qwen2_dir, CONFIG, OPTIONS)
    d = start_worker("decode", "d-abort-open", tiny_qwen2_dir, CONFIG, OPTIONS)
    ray.get([p.profile.remote(), d.profile.remote()])  # (the start-up profile steps the engine)
    waiting = request("opening-0", "opening", LONG_PROMPT)
    reservation = ray.get(d.reserve.remote(waiting, "unread", p))
    steps = ray.get(p.__ray_call__.remote(lambda worker: worker.engine.num_steps))
    prefilled = p.prefill.remote(waiting, reservation, d, "gloo")
    # An async actor need not run two calls in the order they were sent (a clean-clone run ran the abort
    # first, and its mark turned the prefill away: tested above): the abort goes once P holds the job.
    deadline = time.monotonic() + 10
    while not ray.get(p.__ray_call__.remote(lambda worker: "opening-0" in worker._jobs)):
        assert time.monotonic() < deadline, "P never took the prefill"
        time.sleep(0.005)
    assert ray.get(p.abort_named.remote("opening")) == ["opening-0"]
    with pytest.raises(RequestAborted):
        ray.get(prefilled)
    ray.get(d.end_aborted.remote(["opening-0"]))  # (as the scheduler's call does on RequestAborted)
    time.sleep(0.5)
    assert ray.get(p.__ray_call__.remote(lambda worker: worker.engine.num_steps)) == steps
    wait_idle(p)
    wait_idle(d)
