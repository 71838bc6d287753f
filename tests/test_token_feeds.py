"""Token events from workers to consumers: a worker's per-subscription batches
(`actors/token_streams.py`) and a consumer's feed routing them to requests
(`cluster/token_feeds.py`), alone and against a real colocated worker."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
import ray

from actors.config import EngineConfig
from actors.messages import GenerateRequest, TokenEvent, WorkerDied
from actors.request import FinishReason, RequestOutput
from actors.sampling_params import SamplingParams
from actors.token_streams import SubscriptionClosed, TokenStreams
from cluster.token_feeds import FeedLost, RequestEvents, TokenFeed, TokenFeeds, _ENDED, colocated_events
from cluster.workers import start_worker
from tests.conftest import wait_idle


def output(request_id: str, token_ids: list[int], text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id=request_id, prompt_token_ids=[1], num_tokens=len(token_ids), num_chars=len(text),
        finished=finished, finish_reason=FinishReason.LENGTH if finished else None, num_cached_tokens=0,
        arrival_s=0.0, first_token_s=None, _token_ids=token_ids, _logprobs=None, _token_times_s=[],
        _text_pieces=[text], _piece_ends=[len(text)], _final_text=text if finished else None,
    )


async def next_batch(batches) -> list[TokenEvent]:
    return [TokenEvent._make(row) for row in await asyncio.wait_for(batches.__anext__(), 5)]  # tuples on the wire


def test_a_step_reaches_each_subscription_as_one_batch_of_deltas():
    async def run():
        streams = TokenStreams(asyncio.get_running_loop())
        for rid, sub in (("a", "s1"), ("b", "s1"), ("c", "s2")):
            streams.open(rid, sub)
        s1, s2 = streams.batches("s1"), streams.batches("s2")

        def engine_thread():  # two steps, published from another thread as the engine's are
            streams.publish([output("a", [5], "x"), output("b", [6], "y"), output("c", [7], "z")])
            streams.publish([output("a", [5, 8], "xw", finished=True), output("unknown", [1], "q")])

        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        first = await next_batch(s1)
        assert [(e.request_id, e.token_ids, e.text, e.finished) for e in first] == [
            ("a", [5], "x", False), ("b", [6], "y", False), ("a", [8], "w", True)]  # gathered, deltas only
        assert [(e.request_id, e.token_ids) for e in await next_batch(s2)] == [("c", [7])]
        assert "a" not in streams and "b" in streams  # a finished stream is forgotten once read
        streams.fail("b", "boom")
        (failed,) = await next_batch(s1)
        assert failed.finished and failed.error == "boom" and failed.finish_reason == "error"
        streams.publish([output("b", [6, 9], "yv")])  # after its last event: nothing more
        assert streams.close("s2") == ["c"]  # the unfinished request of a consumer that went away
        with pytest.raises(SubscriptionClosed):
            streams.open("d", "s2")
        pending = asyncio.ensure_future(s1.__anext__())
        await asyncio.sleep(0.05)
        assert not pending.done()
        pending.cancel()

    asyncio.run(run())


def test_a_closed_subscription_forgets_the_streams_whose_last_event_it_never_read():
    async def run():
        streams = TokenStreams(asyncio.get_running_loop())
        streams.open("done", "s")
        streams.open("running", "s")
        streams.publish([output("done", [5], "x", finished=True), output("running", [6], "y")])
        await asyncio.sleep(0)  # delivered, not read: its consumer went away
        assert streams.close("s") == ["running"]  # only the unfinished one is the caller's to abort
        return "done" in streams or "running" in streams

    assert not asyncio.run(run())  # the ended stream was kept for good


def test_streams_found_by_their_clients_name_end_as_aborted():
    """`/abort_request`'s way in (`named`), and its way out: the aborted output's
    last tokens with finish_reason abort, or an empty abort event for a request
    that had none; an ended stream is not open (a request about to start skips)."""
    async def run():
        streams = TokenStreams(asyncio.get_running_loop())
        for rid, name in (("a", "x"), ("b", "x"), ("c", "y"), ("d", "")):
            streams.open(rid, "s", name)
        batches = streams.batches("s")
        assert streams.named("x") == ["a", "b"] and streams.named(None) == ["a", "b", "c", "d"]
        assert streams.named("") == ["d"] and streams.named("z") == []
        aborted = dataclasses.replace(output("a", [5, 6], "xy", finished=True), finish_reason=FinishReason.ABORT)
        streams.publish([output("a", [5], "x")])
        streams.end_aborted("a", aborted)
        streams.end_aborted("b", None)
        events = await next_batch(batches)
        assert [(e.request_id, e.token_ids, e.text, e.finished, e.finish_reason, e.error) for e in events] == [
            ("a", [5], "x", False, None, None), ("a", [6], "y", True, "abort", None),
            ("b", [], "", True, "abort", None)]
        assert not streams.is_open("a") and not streams.is_open("b") and streams.is_open("c")
        assert streams.named("x") == []

    asyncio.run(run())


def test_a_stream_interval_gathers_tokens_but_sends_the_first_and_last_at_once():
    async def run():
        streams = TokenStreams(asyncio.get_running_loop(), stream_interval=3)
        streams.open("r", "s")
        batches = streams.batches("s")
        for n in range(1, 8):  # tokens 1..7, the 7th the last
            streams.publish([output("r", list(range(n)), "x" * n, finished=n == 7)])
        await asyncio.sleep(0)
        events = await next_batch(batches)
        return [(len(e.token_ids), e.finished) for e in events]

    assert asyncio.run(run()) == [(1, False), (3, False), (3, True)]


class _Feed:  # what RequestEvents needs of its feed
    error = "worker died (test)"
    worker_died = True
    _queues: dict = {}
    lost = TokenFeed.lost


def test_a_reader_that_fell_behind_gets_the_queued_events_as_one():
    async def run():
        events = RequestEvents(_Feed(), "r")
        for i, (ids, text) in enumerate([([1], "a"), ([2, 3], "bc"), ([4], "d")]):
            events.queue.put_nowait(TokenEvent("r", ids, text, None, False, None, float(i)))
        merged = await events.__anext__()
        assert (merged.token_ids, merged.text, merged.time_s, merged.finished) == ([1, 2, 3, 4], "abcd", 2.0, False)
        events.queue.put_nowait(TokenEvent("r", [5], "e", None, False, None, 3.0))
        events.queue.put_nowait(_ENDED)
        assert (await events.__anext__()).token_ids == [5]  # what came before the feed ended still arrives
        with pytest.raises(WorkerDied, match="worker died"):
            await events.__anext__()
        done = RequestEvents(_Feed(), "s")
        done.queue.put_nowait(TokenEvent("s", [1], "a", None, True, "stop", 0.0))
        done.queue.put_nowait(TokenEvent("s", [2], "b", None, False, None, 1.0))  # never read past the end
        assert [e.token_ids async for e in done] == [[1]]

    asyncio.run(run())


@pytest.fixture(scope="module")
def colocated(ray_local, tiny_qwen2_dir):
    worker = start_worker("colocated", "feeds-c", tiny_qwen2_dir, EngineConfig(block_size=16, num_kv_blocks=256))
    ray_local.get(worker.ping.remote())
    yield worker
    ray_local.kill(worker)


def test_many_requests_share_one_feed_and_each_gets_all_its_tokens(ray_local, colocated):
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)

    async def run():
        feeds = TokenFeeds()
        try:
            async def one(i):
                request = GenerateRequest(f"many-{i}", [3 + i, 4, 5, 6], params)
                return [e async for e in colocated_events(feeds, colocated, request)]

            results = await asyncio.gather(*(one(i) for i in range(12)))
            assert len(feeds._feeds) == 1
            return results
        finally:
            await feeds.close()

    for events in asyncio.run(run()):
        assert sum(len(e.token_ids) for e in events) == 20
        assert events[-1].finished and events[-1].finish_reason == "length"
        assert not any(e.finished for e in events[:-1])


def test_a_closed_feed_aborts_what_its_worker_still_runs_for_it(ray_local, colocated):
    long = SamplingParams(max_new_tokens=5000, temperature=0.0, ignore_eos=True)

    async def run():
        feeds = TokenFeeds()
        feed = feeds.of(colocated)
        with feed.expect("orphan") as events:
            await colocated.submit.remote(GenerateRequest("orphan", [5, 6, 7], long), feed.subscription)
            first = await asyncio.wait_for(events.__anext__(), 30)
            assert first.token_ids
        await feeds.close()  # the consumer goes away without aborting
        with pytest.raises(FeedLost, match="the feed was closed"):  # not WorkerDied: the worker lives
            feed.expect("late")

    asyncio.run(run())
    wait_idle(colocated)  # the worker aborted it by itself


def test_a_request_on_a_feed_its_worker_has_closed_is_a_lost_feed(ray_local, colocated):
    """The worker closed a subscription (its feed's stream ended there) before
    this process's feed saw it end: a request sent on it failed with the worker's
    SubscriptionClosed, an error nothing caught (a 500, not a retry on another
    worker); it is a lost feed, as when this side saw the end first."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)

    async def run():
        feeds = TokenFeeds()
        feed = feeds.of(colocated)
        try:
            # Waited for without yielding to this loop, whose feed task would see the stream end
            # (it did on a quiet machine): the request goes out on the feed this side holds open
            ray.get(colocated.__ray_call__.remote(lambda worker, name: worker.streams.close(name), feed.subscription))
            assert feed.alive  # (nothing reached this side)
            with pytest.raises(FeedLost, match="is closed: its consumer went away"):
                async for _ in colocated_events(feeds, colocated, GenerateRequest("closed-0", [5, 6, 7], params)):
                    pass
        finally:
            await feeds.close()

    asyncio.run(run())
    wait_idle(colocated)


@ray.remote
class _Consumer:
    """A consumer actor, as a scheduler replica is."""

    async def start(self, worker, num_requests: int) -> None:
        self.feeds = TokenFeeds()
        params = SamplingParams(max_new_tokens=2000, temperature=0.0, ignore_eos=True)

        async def one(i):
            async for _ in colocated_events(self.feeds, worker, GenerateRequest(f"owned-{i}", [5, i + 3], params)):
                pass

        self.tasks = [asyncio.ensure_future(one(i)) for i in range(num_requests)]


def test_a_killed_consumer_actor_has_its_requests_aborted(ray_local, colocated):
    """Ray does not cancel a stream whose caller was killed: the worker notices
    the feed's owner is dead by itself."""
    consumer = _Consumer.remote()
    ray_local.get(consumer.start.remote(colocated, 16))
    deadline = time.monotonic() + 30
    while ray_local.get(colocated.stats.remote()).num_running < 16:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ray_local.kill(consumer)
    wait_idle(colocated, within_s=5.0)  # 16 x 2000 tokens would take far longer


@ray.remote
class _Replica:
    """A consumer actor whose requests run as actor tasks of their own, as a Serve
    replica's do."""

    def __init__(self) -> None:
        self.feeds = TokenFeeds()
        self.num_tokens: dict[str, int] = {}

    async def generate(self, worker, request_id: str, max_new_tokens: int) -> tuple[int, str | None]:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        error = None
        async for event in colocated_events(self.feeds, worker, GenerateRequest(request_id, [5, 6, 7], params)):
            self.num_tokens[request_id] = self.num_tokens.get(request_id, 0) + len(event.token_ids)
            error = event.error or error
        return self.num_tokens[request_id], error

    async def progress(self, request_id: str) -> int:
        return self.num_tokens.get(request_id, 0)


def test_a_cancelled_request_leaves_the_feed_it_subscribed_to_the_others(ray_local, colocated):
    """Serve cancels a request's task when its client leaves, and Ray then cancels
    the Ray calls that task made: the feed the first request subscribed is not one
    of them (actors/background.py). It was: the other request failed with "the
    worker's feed failed: TaskCancelledError"."""
    replica = _Replica.remote()

    def until_tokens(request_id: str) -> None:
        deadline = time.monotonic() + 30
        while ray_local.get(replica.progress.remote(request_id)) == 0:
            assert time.monotonic() < deadline, request_id
            time.sleep(0.05)

    first = replica.generate.remote(colocated, "first", 5000)  # subscribes the feed
    until_tokens("first")
    second = replica.generate.remote(colocated, "second", 200)
    until_tokens("second")
    ray_local.cancel(first)
    assert ray_local.get(second) == (200, None)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray_local.get(first)
    wait_idle(colocated)  # the cancelled request was aborted on the worker
    ray_local.kill(replica)


def test_a_dead_worker_ends_every_request_waiting_on_its_feed(ray_local, tiny_qwen2_dir):
    worker = start_worker("colocated", "feeds-dies", tiny_qwen2_dir, EngineConfig(block_size=16, num_kv_blocks=256))
    ray_local.get(worker.ping.remote())
    long = SamplingParams(max_new_tokens=5000, temperature=0.0, ignore_eos=True)

    async def run():
        feeds = TokenFeeds()
        got = []

        async def one(i):
            async for event in colocated_events(feeds, worker, GenerateRequest(f"dies-{i}", [5, i + 3], long)):
                got.append(event)

        tasks = [asyncio.ensure_future(one(i)) for i in range(3)]
        while len(got) < 3:
            await asyncio.sleep(0.05)
        ray_local.kill(worker)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        await feeds.close()
        return results

    results = asyncio.run(run())
    assert all(isinstance(r, WorkerDied) for r in results), results


def test_a_row_from_a_worker_of_an_earlier_version_takes_the_new_fields_defaults():
    """A worker started before a redeploy sends its events a field short (here
    without `stop_matched`): rebuilt with `_make`, every event failed the feed."""
    from cluster.token_feeds import TokenFeed

    async def scenario():
        feed = object.__new__(TokenFeed)
        feed.error, feed._queues = None, {}
        short = tuple(TokenEvent("r1", [5], "x", None, True, "stop", 0.0))[:-1]

        async def answered():
            return [short]

        async def stream():
            yield answered()

        feed._stream = stream()
        events = feed.expect("r1")
        await feed._route()
        return await events.__anext__(), feed.error

    event, error = asyncio.run(scenario())
    assert event.token_ids == [5] and event.finish_reason == "stop" and event.stop_matched is None
    assert error == "the worker's feed ended"
