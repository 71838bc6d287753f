"""A decode engine keeps room for its requests' next tokens when it grants a
reservation (actors/decode_room.py), so the requests it runs do not outgrow its pool."""

from __future__ import annotations

import dataclasses

import pytest

from actors.config import EngineConfig
from actors.decode_room import growth_blocks, reservation_tokens
from actors.engine import Engine
from actors.request import SampledToken
from actors.sampling_params import SamplingParams

CONFIG = EngineConfig(block_size=16, num_kv_blocks=16, prefill_chunk_size=64)
PROMPT = list(range(3, 43))  # 40 tokens: 3 blocks with the first output token's slot
EIGHTY = SamplingParams(max_new_tokens=80, temperature=0.0, ignore_eos=True)  # 120 tokens in all: 8 blocks


def test_growth_counts_the_next_tokens_up_to_the_budget_max_new_tokens_and_the_context():
    room = dict(reserve_tokens=512, block_size=16, max_model_len=2048)
    assert growth_blocks(40, 0, 80, 3, **room) == 8 - 3
    assert growth_blocks(40, 0, 80, 3, **{**room, "reserve_tokens": 24}) == 4 - 3  # 64 tokens: 4 blocks
    assert growth_blocks(110, 70, 80, 7, **room) == 1  # 10 to come: its 8th block
    assert growth_blocks(110, 70, 80, 8, **room) == 0  # already held
    assert growth_blocks(100, 60, 80, 0, **room) == 8  # preempted: all back
    assert growth_blocks(2000, 0, 512, 126, **room) == 2  # ends at the context: 128 blocks, not 157
    assert reservation_tokens(40, 80, 512, 2048) == 120 and reservation_tokens(40, 80, 0, 2048) == 41
    assert reservation_tokens(2000, 512, 512, 2048) == 2048 and reservation_tokens(2047, 512, 0, 2048) == 2048


def test_a_prompt_near_the_context_is_reserved_in_a_pool_of_the_context(tiny_qwen2_dir):
    """The tiny model's context is 2048 tokens, 128 blocks: a pool of 128 blocks
    serves a 2000-token prompt with max_new_tokens 512 (the engine ends it at the
    context); D's reservation asked for 157 blocks, so it never fit and the
    handshake waited out its time."""
    engine = Engine(tiny_qwen2_dir, dataclasses.replace(CONFIG, num_kv_blocks=128))
    params = SamplingParams(max_new_tokens=512, ignore_eos=True)
    reservation = engine.reserve(list(range(1, 2001)), params, "near")
    assert reservation is not None and len(reservation.block_ids) == 126  # 2000 tokens and the first's slot


def _reserve_all(engine: Engine, count: int) -> list[str]:
    """Prompts of PROMPT's length that share no block (a later one would borrow an
    earlier one's blocks: actors/arriving_blocks.py)."""
    granted = []
    for index in range(count):
        if engine.reserve([token + 100 * index for token in PROMPT], EIGHTY, f"r{index}") is not None:
            granted.append(f"r{index}")
    return granted


def _decode_to_the_end(engine: Engine, request_ids: list[str]) -> None:
    for request_id in request_ids:  # the KV did not come from a P: decoding goes on over whatever the blocks hold
        engine.activate(request_id, SampledToken(5, None), seed=1)
    while engine.has_unfinished():
        engine.step()
        engine.pool.check()


def test_a_reservation_waits_until_the_running_requests_can_grow(tiny_qwen2_dir):
    """16 blocks, requests of 8 blocks at their end: two fit. The third prompt's
    3 blocks are free, but granting it would leave the first two no room to grow."""
    engine = Engine(tiny_qwen2_dir, CONFIG)
    assert _reserve_all(engine, 3) == ["r0", "r1"]
    _decode_to_the_end(engine, ["r0", "r1"])
    assert engine.scheduler.num_preemptions == 0
    assert engine.reserve(PROMPT, EIGHTY, "r2") is not None  # room again once they ended


def test_without_the_room_kept_the_pool_is_overcommitted_and_requests_are_preempted(tiny_qwen2_dir):
    """The same pool granting the prompts alone (decode_reserve_tokens 0, the old
    rule): five reservations of 3 blocks, then five requests that need 8 each, and
    the engine preempts to go on (the thrash the budget prevents)."""
    engine = Engine(tiny_qwen2_dir, dataclasses.replace(CONFIG, decode_reserve_tokens=0))
    granted = _reserve_all(engine, 6)
    assert granted == [f"r{i}" for i in range(5)]
    _decode_to_the_end(engine, granted)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("reserve", [0, 512])
def test_the_decode_worker_and_its_store_import_ask_the_same_room(tiny_qwen2_dir, reserve):
    """`reservation_room` is what `reserve` checks and what the KV store import plans with."""
    engine = Engine(tiny_qwen2_dir, dataclasses.replace(CONFIG, decode_reserve_tokens=reserve))
    assert engine.reservation_room(40, EIGHTY) == (120 if reserve else 41, 0)
    engine.reserve(PROMPT, EIGHTY, "r0")
    assert engine.reservation_room(40, EIGHTY) == (120 if reserve else 41, 5 if reserve else 0)


def test_a_decode_batch_holds_at_most_max_num_seqs(tiny_qwen2_dir):
    """Reservations were granted past max_num_seqs: a D ran 4 requests with a
    budget of 2 tokens a step, and the two at the back got no token until the
    two ahead had ended. The third reservation now waits for a request to end."""
    engine = Engine(tiny_qwen2_dir, dataclasses.replace(CONFIG, num_kv_blocks=64, max_num_seqs=2))
    assert _reserve_all(engine, 3) == ["r0", "r1"] and engine.batch_full and engine.num_free_seqs == 0
    engine.activate("r0", SampledToken(5, None), seed=1)
    assert engine.reserve(PROMPT, EIGHTY, "r2") is None  # (running or reserved alike)
    engine.abort("r0")
    assert not engine.batch_full and engine.num_free_seqs == 1  # (the scheduler's routing reads it)
    assert engine.reserve(PROMPT, EIGHTY, "r2") is not None
