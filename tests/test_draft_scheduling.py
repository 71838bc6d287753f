"""How a step shares its token budget and the pool's blocks between running
requests' known tokens, waiting prompts and speculative drafts
(actors/scheduler.py `schedule`): every running request's known tokens first, then
the waiting, drafts from what is left, so no one is preempted, or left out of the
step, for a guess."""

from __future__ import annotations

from actors.config import EngineConfig
from actors.engine import Engine
from actors.sampling_params import SamplingParams

PARAMS = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)


def _decoding(tiny_qwen2_dir, prompts: dict[str, list[int]], **config) -> Engine:
    """An engine whose requests have each drawn their first token."""
    engine = Engine(tiny_qwen2_dir, EngineConfig(block_size=16, prefill_chunk_size=64, **config))
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, PARAMS, request_id)
    while not all(engine.requests[r].output_token_ids for r in prompts):
        engine.step()
    return engine


def _planned(engine: Engine) -> list[tuple[str, int, tuple]]:
    plan = engine.scheduler.schedule()
    assert not plan.preempted
    return [(c.request.request_id, c.num_new_tokens, c.draft_token_ids) for c in plan.chunks]


def test_drafts_take_no_block_another_running_request_needs(tiny_qwen2_dir):
    """One block free: B's next token needs it, A's drafts would. B gets it; A
    decodes its one token in the block it has."""
    engine = _decoding(tiny_qwen2_dir, {"A": list(range(100, 115)), "B": list(range(200, 216))},
                       num_kv_blocks=8, num_speculative_tokens=2)
    engine.pool.allocate(engine.pool.num_available - 1)
    engine.requests["A"].draft_token_ids = [7, 8]
    assert _planned(engine) == [("A", 1, ()), ("B", 1, ())]


def test_drafts_take_what_is_left_of_the_budget_after_every_known_token(tiny_qwen2_dir):
    engine = _decoding(tiny_qwen2_dir, {"A": list(range(100, 103)), "B": [200]},
                       num_kv_blocks=32, num_speculative_tokens=3, max_num_batched_tokens=4)
    engine.requests["A"].draft_token_ids, engine.requests["B"].draft_token_ids = [7, 8, 9], []
    assert _planned(engine) == [("A", 3, (7, 8)), ("B", 1, ())]


def test_drafts_fill_the_room_there_is_rather_than_none(tiny_qwen2_dir):
    """A's next token at position 20, in the second of its two blocks, and no
    block free: of 16 drafts, the 11 that fit in that block, not all or none."""
    engine = _decoding(tiny_qwen2_dir, {"A": list(range(100, 120))}, num_kv_blocks=8, num_speculative_tokens=16)
    engine.pool.allocate(engine.pool.num_available)
    engine.requests["A"].draft_token_ids = list(range(7, 23))
    assert _planned(engine) == [("A", 12, tuple(range(7, 18)))]


def test_a_waiting_prompt_is_admitted_before_drafts_take_the_budget(tiny_qwen2_dir):
    """Found by a review: drafts took the budget first, and a new prompt waited as
    long as the running requests drafted (60 drafting 16 tokens took 1020 of
    1024). The prompt's chunk comes first, the drafts have what is left."""
    engine = _decoding(tiny_qwen2_dir, {"A": list(range(100, 103)), "B": [200]},
                       num_kv_blocks=32, num_speculative_tokens=4, max_num_batched_tokens=8)
    engine.requests["A"].draft_token_ids, engine.requests["B"].draft_token_ids = [7, 8, 9, 10], [5, 6, 7, 8]
    engine.add_request(list(range(300, 305)), PARAMS, "new")
    assert _planned(engine) == [("A", 2, (7,)), ("B", 1, ()), ("new", 5, ())]
