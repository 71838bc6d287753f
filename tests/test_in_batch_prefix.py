"""Requests that share a prefix another running request is computing wait for it
(`Scheduler._waits_for_prefix`), so it is computed once: the tiny model, no Ray."""

from __future__ import annotations

import dataclasses
import random

from actors.block_pool import BlockPool, block_hashes
from actors.config import EngineConfig
from actors.engine import Engine
from actors.request import Request, TokenLogprob
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


def _finished(scheduler: Scheduler, prompt: list[int]) -> None:
    """A request whose prompt is computed, then finished: its blocks stay cached, free."""
    request = Request(f"done-{len(prompt)}", prompt, GREEDY, seed=0)
    scheduler.add(request)
    while request.num_computed_tokens < len(prompt):
        scheduler.update(scheduler.schedule().chunks)
    scheduler.finish(request)


def _queue_behind_a_long_prefix(num_queued: int, cached_tokens: int = 0):
    """A scheduler (no model) whose first request computes a 320-token prefix in
    32-token chunks while `num_queued` others that share it wait; `pool.lookup`
    counted. With `cached_tokens`, an earlier prompt of that many tokens left its
    blocks cached, free, for the new ones to evict."""
    config = dataclasses.replace(CONFIG, num_kv_blocks=256)
    scheduler = Scheduler(config, BlockPool(config.num_kv_blocks, config.block_size))
    if cached_tokens:
        _finished(scheduler, _own(99, cached_tokens))
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
    _not_looked_up_again(scheduler, lookups)


def test_a_waiting_request_is_not_looked_up_again_while_other_prefixes_are_evicted():
    """In a full pool, each block the running request takes evicts one cached
    before: the waiting requests' own cached prefix is not among those."""
    scheduler, lookups = _queue_behind_a_long_prefix(num_queued=5, cached_tokens=256 * 16)
    assert scheduler.pool.num_cached == 256
    _not_looked_up_again(scheduler, lookups)
    assert scheduler.pool.num_cached < 256 - 20  # (the prefix's 20 blocks came from the cached ones)


def _not_looked_up_again(scheduler: Scheduler, lookups: list[int]) -> None:
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


def test_a_waiting_request_whose_prefix_was_forgotten_meanwhile_goes_in_at_once():
    """It would find none of the prefix once computed: it gains nothing by waiting."""
    scheduler, _ = _queue_behind_a_long_prefix(num_queued=1)
    scheduler.update(scheduler.schedule().chunks)
    scheduler.update(scheduler.schedule().chunks)
    assert [r.request_id for r in scheduler.waiting] == ["r1"]
    scheduler.pool.reset_cache()  # (the 64 tokens computed so far are no longer findable)
    admitted = scheduler.schedule()
    assert [(c.request.request_id, c.start) for c in admitted.chunks] == [("r0", 64), ("r1", 0)]
    scheduler.pool.check()


def test_a_waiting_request_whose_cached_prefix_is_evicted_meanwhile_goes_in_at_once():
    """W waits for R, which computes the rest of W's prompt. R recomputes the
    cached start of it too (for its prompt logprobs), so that cached copy is free,
    and the unrelated requests' blocks evict it: W then gains nothing by waiting."""
    config = dataclasses.replace(CONFIG, max_num_batched_tokens=256, num_kv_blocks=80)
    scheduler = Scheduler(config, BlockPool(config.num_kv_blocks, config.block_size))
    start, rest = _own(1, 64), _own(2, 1024)
    _finished(scheduler, start)
    start_tail = scheduler.pool.lookup(block_hashes(start, 16), start)[-1]
    logprobs = dataclasses.replace(GREEDY, prompt_logprobs=1)
    scheduler.add(Request("R", start + rest + [2] * 10, logprobs, seed=0, prompt_logprobs=[None] * 1098))
    waiter = Request("W", start + rest + [3] * 10, GREEDY, seed=0)
    scheduler.add(waiter)
    for index in range(6):
        scheduler.add(Request(f"X{index}", _own(20 + index, 160), GREEDY, seed=0))
    while scheduler.pool.blocks[start_tail].block_hash is not None:
        assert waiter in scheduler.waiting
        _step(scheduler)
    while waiter not in scheduler.running:  # (as soon as the full pool lets it: not once R is done)
        _step(scheduler)
    assert scheduler.running[0].request_id == "R" and scheduler.running[0].num_computed_tokens < len(start + rest)
    scheduler.pool.check()


def _step(scheduler: Scheduler) -> None:
    """A step as the engine runs it, a token drawn where a chunk samples (and a
    prompt's logprobs in once computed); each request ends at max_new_tokens."""
    chunks = scheduler.schedule().chunks
    scheduler.update(chunks)
    for chunk in chunks:
        request = chunk.request
        if request.prompt_logprobs is not None and chunk.known_end >= request.num_prompt_tokens:
            request.prompt_logprobs = [None] + [TokenLogprob(7, 0.0)] * (request.num_prompt_tokens - 1)
        if chunk.samples:
            request.output_token_ids.append(7)
            if len(request.output_token_ids) == request.params.max_new_tokens:
                scheduler.finish(request)
