"""The engine's own thread (actors/engine_loop.py): it waits for a call when its
requests wait for blocks held elsewhere, rather than asking the scheduler again
at once, and goes on as soon as a call frees them."""

from __future__ import annotations

import time

from actors.config import EngineConfig
from actors.engine import Engine
from actors.engine_loop import EngineLoop
from actors.sampling_params import SamplingParams


def test_a_request_waiting_for_held_blocks_waits_for_the_call_that_frees_them(tiny_qwen2_dir):
    engine = Engine(tiny_qwen2_dir, EngineConfig(block_size=16, num_kv_blocks=8, prefill_chunk_size=64))
    held = engine.pool.allocate(8)  # as a prefill worker's blocks while their KV is sent
    engine.add_request(list(range(100, 140)), SamplingParams(max_new_tokens=4, temperature=0), "waits")
    steps = []
    run_step = engine.run_step
    engine.run_step = lambda: (steps.append(None), run_step())[1]
    finished = []
    loop = EngineLoop(engine, lambda exported, outputs: finished.extend(o.request_id for o in outputs if o.finished))
    loop.start()
    try:
        time.sleep(0.5)
        assert engine.stalled and 1 <= len(steps) <= 50  # (spinning, it made some 100000 empty steps)
        loop.call(lambda e: e.pool.release(held)).result(timeout=5)
        deadline = time.monotonic() + 30
        while not finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finished == ["waits"] and not engine.stalled
    finally:
        loop.stop()


def test_a_hook_that_raises_fails_the_requests_and_the_thread_serves_on(tiny_qwen2_dir):
    engine = Engine(tiny_qwen2_dir, EngineConfig(block_size=16, num_kv_blocks=32))
    failures, finished = [], []

    def on_step(exported, outputs):
        finished.extend(o.request_id for o in outputs if o.finished)
        if any(o.request_id == "breaks" for o in outputs):
            raise RuntimeError("a bug in the hook")

    def on_error(exc):
        failures.append(str(exc))
        for request_id in list(engine.requests):
            engine.abort(request_id)

    loop = EngineLoop(engine, on_step, on_error=on_error)
    loop.start()
    try:
        params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
        loop.call(lambda e: e.add_request([5, 6, 7], params, "breaks")).result(timeout=5)
        deadline = time.monotonic() + 30
        while not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failures == ["a bug in the hook"] and not engine.has_unfinished()
        loop.call(lambda e: e.add_request([5, 6, 7], params, "after")).result(timeout=5)
        while "after" not in finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "after" in finished  # the thread is alive
    finally:
        loop.stop()
