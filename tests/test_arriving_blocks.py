"""A decode engine's reservation borrows the prompt blocks an earlier reservation
is still to receive (actors/arriving_blocks.py): the engine's part, without Ray.
The decode worker's part (holding a borrower until the blocks are written, ending
it when they never will be) is in tests/test_pd_workers.py."""

from __future__ import annotations

import dataclasses
import random

import pytest

from actors.arriving_blocks import ArrivingBlocks
from actors.block_pool import block_hashes
from actors.config import EngineConfig
from actors.engine import Engine
from actors.request import SampledToken
from actors.sampling_params import SamplingParams

CONFIG = EngineConfig(block_size=16, num_kv_blocks=64, prefill_chunk_size=64, decode_reserve_tokens=0)
PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
SYSTEM = [random.Random(1).randrange(3, 2000) for _ in range(96)]  # 6 full blocks


def _prompt(seed: int, extra: int = 20) -> list[int]:
    return SYSTEM + [random.Random(seed).randrange(3, 2000) for _ in range(extra)]


@pytest.fixture
def engine(tiny_qwen2_dir):
    return Engine(tiny_qwen2_dir, CONFIG)


def test_a_reservation_borrows_the_blocks_an_earlier_one_still_awaits(engine):
    first = engine.reserve(_prompt(1), PARAMS, "first")
    assert first.num_cached_blocks == 0 and first.borrowed_block_ids == []
    assert first.arriving_block_ids == first.block_ids[:7]  # 116 tokens: 7 full blocks lent
    second = engine.reserve(_prompt(2), PARAMS, "second")
    assert second.num_cached_blocks == 6 and second.borrowed_block_ids == first.block_ids[:6]
    assert second.block_ids[:6] == first.block_ids[:6]
    assert second.arriving_block_ids == second.block_ids[6:7]  # its own full block, from the 7th on
    assert all(engine.pool.blocks[b].ref_count == 2 for b in first.block_ids[:6])
    assert engine.pool.num_used == 8 + 2  # 116 tokens and the first output's slot: 8 blocks, 2 of them its own
    engine.pool.check()


def test_the_prompts_last_token_block_is_never_borrowed(engine):
    """As with cached hits: the block holding the last prompt token is sent."""
    first = engine.reserve(_prompt(1), PARAMS, "first")
    exact = engine.reserve(SYSTEM, PARAMS, "exact")  # 96 tokens: its 6th block holds the last one
    assert exact.num_cached_blocks == 5 and exact.borrowed_block_ids == first.block_ids[:5]


def test_borrowing_follows_cached_hits_and_stops_where_the_prompts_part(engine):
    first = engine.reserve(_prompt(1), PARAMS, "first")
    engine.activate("first", SampledToken(5, None), seed=1)  # its blocks are in the prefix cache now
    assert len(engine.arriving) == 0
    second = engine.reserve(_prompt(2, extra=60), PARAMS, "second")  # 156 tokens: 9 full blocks
    assert second.num_cached_blocks == 6 and second.borrowed_block_ids == []  # cached hits, not borrowed
    third = engine.reserve(_prompt(2, extra=60)[:150] + [7, 7, 7], PARAMS, "third")
    assert third.num_cached_blocks == 9 and third.borrowed_block_ids == second.block_ids[6:9]
    other = engine.reserve([5] + SYSTEM[1:] + [9] * 20, PARAMS, "other")  # differs in its first block
    assert other.num_cached_blocks == 0 and other.borrowed_block_ids == []
    assert first.block_ids[:6] == second.block_ids[:6] == third.block_ids[:6]


def test_a_cancelled_reservation_lends_nothing_more(engine):
    engine.reserve(_prompt(1), PARAMS, "first")
    second = engine.reserve(_prompt(2), PARAMS, "second")
    assert engine.cancel_reservation("first")
    later = engine.reserve(_prompt(3), PARAMS, "later")  # the chain's start is gone: none of it is lent
    assert later.num_cached_blocks == 0 and not set(later.block_ids) & set(second.block_ids)
    engine.cancel_reservation("second")
    engine.cancel_reservation("later")
    assert engine.pool.num_used == 0 and len(engine.arriving) == 0
    engine.pool.check()


def test_without_a_prefix_cache_nothing_is_lent(tiny_qwen2_dir):
    engine = Engine(tiny_qwen2_dir, dataclasses.replace(CONFIG, enable_prefix_cache=False))
    first = engine.reserve(_prompt(1), PARAMS, "first")
    second = engine.reserve(_prompt(2), PARAMS, "second")
    assert first.arriving_block_ids == [] and second.num_cached_blocks == 0
    assert not set(first.block_ids) & set(second.block_ids)


def test_a_match_checks_the_tokens_behind_the_hash():
    blocks = ArrivingBlocks(block_size=4)
    tokens = list(range(12))
    hashes = block_hashes(tokens, 4, b"seed")
    assert blocks.add("a", hashes, [10, 11, 12], tokens, first=1) == [11, 12]
    assert blocks.match(hashes, tokens, first=1) == [11, 12]
    assert blocks.match(hashes, tokens[:8] + [0, 0, 0, 0], first=1) == [11]  # (a colliding hash, tokens differ)
    assert blocks.add("b", hashes, [20, 21, 22], tokens, first=1) == []  # first owner kept
    blocks.forget("b")
    assert blocks.match(hashes, tokens, first=1) == [11, 12]
    blocks.forget("a")
    assert blocks.match(hashes, tokens, first=1) == [] and len(blocks) == 0
