"""Requests that share a prefix another running request is computing wait for it
(`Scheduler._waits_for_prefix`), so it is computed once: the tiny model, no Ray."""

from __future__ import annotations

import dataclasses
import random

from actors.block_pool import BlockPool
from actors.config import EngineConfig
from actors.engine import Engine
from actors.request import Request
from actors.sampling_params import SamplingParams
from actors.scheduler import Scheduler

CONFIG = EngineConfig(block_size=16, prefill_chunk_size=32, max_num_batched_tokens=128, num_kv_blocks=128)
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
SYSTEM = [random.Random(3).randrange(3, 2000) for _ in range(96)]  # 6 full blocks


def _own(seed: int, count: int = 20) -> list[int]:
    return [random.Random(seed).randrange(3, 2000) for _ in range(count)]


def _run(engine: Engine, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], int]]:
    """Each request's tokens and prompt tokens served by the prefix cache, all added at once."""
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, GREEDY, request_id)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.num_cached_tokens)
        engine.pool.check()
    return done


def test_a_burst_sharing_a_new_prefix_computes_it_once_with_the_same_tokens(tiny_qwen2_dir):
    """A step's budget admits four 32-token chunks: the three behind the first
    computed the same 96 tokens beside it. Now they wait a step or two and find
    them cached."""
    prompts = {f"r{i}": SYSTEM + _own(i) for i in range(8)}
    served = _run(Engine(tiny_qwen2_dir, CONFIG), prompts)
    assert [served[f"r{i}"][1] for i in range(8)] == [0] + [96] * 7
    alone = _run(Engine(tiny_qwen2_dir, dataclasses.replace(CONFIG, enable_prefix_cache=False)), prompts)
    assert {rid: tokens for rid, (tokens, _) in served.items()} == {rid: t for rid, (t, _) in alone.items()}


def test_a_request_behind_one_that_waits_takes_the_budget_and_the_waiting_keep_their_order(tiny_qwen2_dir):
    engine = Engine(tiny_qwen2_dir, CONFIG)
    for request_id, prompt in (("a1", SYSTEM + _own(1)), ("a2", SYSTEM + _own(2)), ("a3", SYSTEM + _own(3)),
                               ("b", _own(9, 116))):
        engine.add_request(prompt, GREEDY, request_id)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["a1", "b"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["a2", "a3"]


def test_a_request_computing_its_whole_prompt_for_its_logprobs_does_not_wait(tiny_qwen2_dir):
    """It would find nothing cached it could use (`Scheduler.cached_prefix`)."""
    engine = Engine(tiny_qwen2_dir, CONFIG)
    engine.add_request(SYSTEM + _own(1), GREEDY, "a1")
    engine.add_request(SYSTEM + _own(2), dataclasses.replace(GREEDY, prompt_logprobs=1), "a2")
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["a1", "a2"]


def _queue_behind_a_long_prefix(num_queued: int):
    """A scheduler (no model) whose first request computes a 320-token prefix in
    32-token chunks while `num_queued` others that share it wait; `pool.lookup`
    counted."""
    config = dataclasses.replace(CONFIG, num_kv_blocks=256)
    scheduler = Scheduler(config, BlockPool(config.num_kv_blocks, config.block_size))
    prefix = _own(5, 320)
    for index in range(num_queued + 1):
        scheduler.add(Request(f"r{index}", prefix + _own(10 + index), GREEDY, seed=index))
    lookups = []
    lookup = scheduler.pool.lookup
    scheduler.pool.lookup = lambda hashes, token_ids: lookups.append(len(hashes)) or lookup(hashes, token_ids)
    return scheduler, lookups


def test_a_waiting_request_is_not_looked_up_again_while_the_block_it_waits_for_is_in_compute():
    """Each lookup walks the cached prefix: done for every waiting request every
    step, a thousand requests behind an 8k-token prompt took 120 ms a step."""
    scheduler, lookups = _queue_behind_a_long_prefix(num_queued=5)
    first = scheduler.schedule()
    assert [c.request.request_id for c in first.chunks] == ["r0"] and len(scheduler.waiting) == 5
    assert len(lookups) == 6  # each request once
    scheduler.update(first.chunks)
    steps = 1
    while scheduler.running[0].num_computed_tokens + 32 < 320:  # the prefix's last chunk not yet run
        scheduler.update(scheduler.schedule().chunks)
        steps += 1
        assert len(lookups) == 6 and len(scheduler.waiting) == 5
    scheduler.update(scheduler.schedule().chunks)
    admitted = scheduler.schedule()  # the prefix cached: the queue goes in, each finding all of it
    assert steps == 9 and [(c.request.request_id, c.start) for c in admitted.chunks] == [("r0", 320)] + [
        (f"r{index}", 320) for index in range(1, 6)]
    scheduler.pool.check()


def test_a_waiting_request_whose_prefix_was_forgotten_meanwhile_finds_what_is_left():
    scheduler, _ = _queue_behind_a_long_prefix(num_queued=1)
    scheduler.update(scheduler.schedule().chunks)
    scheduler.update(scheduler.schedule().chunks)
    scheduler.pool.reset_cache()  # (the 64 tokens computed so far are no longer findable)
    while scheduler.running[0].num_computed_tokens < 320:
        scheduler.update(scheduler.schedule().chunks)
    assert [r.request_id for r in scheduler.waiting] == ["r1"]
    admitted = scheduler.schedule()
    assert [(c.request.request_id, c.start) for c in admitted.chunks] == [("r0", 320), ("r1", 0)]
    scheduler.pool.check()
