"""Requests that share a prefix another running request is computing wait for it
(`Scheduler._waits_for_prefix`), so it is computed once: the tiny model, no Ray."""

from __future__ import annotations

import dataclasses
import random

from actors.config import EngineConfig
from actors.engine import Engine
from actors.sampling_params import SamplingParams

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
