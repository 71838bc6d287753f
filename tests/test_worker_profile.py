"""A worker's start-up profile (actors/profiler.py, `WorkerBase.profile`): run
once, before the worker's first request, and the same one answered to every
scheduler replica that asks, whenever it asks. Asked for while a request ran,
it used to step the engine under that request and keep its tokens: the request
waited for the rest until its timeout (a fresh app's first requests, when its
second scheduler replica profiled the worker after the first had sent them)."""

from __future__ import annotations

import asyncio

import pytest

from actors.config import EngineConfig
from actors.engine import Engine
from actors.messages import GenerateRequest
from actors.profiler import profile_engine
from actors.sampling_params import SamplingParams
from cluster.token_feeds import TokenFeeds, colocated_events
from cluster.workers import start_worker

NUM_TOKENS = 300


@pytest.fixture
def worker(ray_local, tiny_qwen2_dir):
    handle = start_worker("colocated", "profile-c", tiny_qwen2_dir, EngineConfig(block_size=16, num_kv_blocks=256))
    yield handle
    ray_local.kill(handle)


def test_a_profile_asked_for_while_a_request_runs_takes_none_of_its_tokens(ray_local, worker):
    params = SamplingParams(max_new_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)

    async def run():
        feeds = TokenFeeds()
        try:
            events = colocated_events(feeds, worker, GenerateRequest("live-1", [3, 4, 5, 6], params))
            got = [await events.__anext__()]  # (its first token: it runs)
            profiles = [await worker.profile.remote(), await worker.profile.remote()]  # (two replicas ask)
            stats = await worker.stats.remote()
            got += [event async for event in events]
            return got, profiles, stats
        finally:
            await feeds.close()

    events, (first, second), stats = asyncio.run(asyncio.wait_for(run(), 60))
    assert sum(len(event.token_ids) for event in events) == NUM_TOKENS
    assert events[-1].finished and events[-1].finish_reason == "length"
    assert first.prefill_steps and first.decode and first == second, "run once, the same answer to each"
    assert all(step.seq > first.num_steps for step in stats.prefill_steps), "the stats carry live steps only"


def test_the_profile_refuses_an_engine_that_has_a_request(tiny_qwen2_dir):
    engine = Engine(tiny_qwen2_dir, EngineConfig(block_size=16, num_kv_blocks=256))
    engine.add_request([3, 4, 5], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="before its first request"):
        profile_engine(engine)


def test_a_caller_that_gives_up_on_the_profile_leaves_it_to_the_others(ray_local, worker):
    """The window is the engine thread's pick-up of its first call: a caller
    cancelled before then cancelled the shared future, and every later
    `profile` and `stats` raised. A pending future the engine thread never
    takes holds that window open."""
    ray_local.get(worker.profile.remote())

    def hold_the_window_and_call(self):
        from concurrent.futures import Future

        self.test_profile = self._profiled
        self._profiled = Future()  # (pending, as before the engine thread takes it)
        self.test_caller = asyncio.run_coroutine_threadsafe(self.profile(), self.aio)  # (a task on the actor's loop)

    async def a_few_turns():
        for _ in range(5):
            await asyncio.sleep(0)

    def cancel_the_caller(self):
        self.test_caller.cancel()

    def close_the_window(self):
        asyncio.run_coroutine_threadsafe(a_few_turns(), self.aio).result()  # (the cancel reaches the task)
        cancelled = self._profiled.cancelled(), self.test_caller.cancelled()
        if not cancelled[0]:
            self._profiled.set_result(self.test_profile.result())
        return cancelled

    ray_local.get(worker.__ray_call__.remote(hold_the_window_and_call))
    ray_local.get(worker.__ray_call__.remote(cancel_the_caller))
    shared_cancelled, caller_cancelled = ray_local.get(worker.__ray_call__.remote(close_the_window))
    assert caller_cancelled and not shared_cancelled
    assert ray_local.get(worker.profile.remote()).prefill_steps
    assert ray_local.get(worker.stats.remote()).profile_error is None


def test_the_profile_saves_nothing_to_the_kv_store_and_live_prompts_still_go(tiny_qwen2_dir):
    """The profile's random prompts went to the node's store: about a hundred
    blocks a worker start, pushing out real prefixes (and into a store restarted
    just then: test_kv_store_workers' crash test, once in a clean-clone run)."""
    engine = Engine(tiny_qwen2_dir, EngineConfig(block_size=16, num_kv_blocks=256))
    saved = []
    engine.store_bridge.sink = saved.extend
    profile_engine(engine)
    assert saved == []
    engine.add_request(list(range(3, 3 + 40)), SamplingParams(max_new_tokens=1))
    while engine.has_unfinished():
        engine.step()
    assert len(saved) == 2, "a live prompt's two full blocks are saved, as before"
