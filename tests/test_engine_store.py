"""The engine's side of the KV store: write-through of computed prompt blocks,
import of a stored prefix (keys and tokens verified), the hold on imported blocks,
and outputs identical to a recompute. No Ray: the store lives in-process."""

from __future__ import annotations

import random

import pytest
import torch

from actors.config import EngineConfig
from actors.engine import Engine
from actors.kv_store import KVStore, KVStoreSettings
from actors.kv_tiers import StoredBlock
from actors.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def make_engine(model_dir, store=None, num_blocks=64):
    engine = Engine(model_dir, EngineConfig(block_size=16, prefill_chunk_size=48, num_kv_blocks=num_blocks))
    if store is not None:
        engine.store_bridge.sink = store.save
    return engine


def run(engine, prompt, request_id, pinned=None):
    engine.add_request(prompt, GREEDY, request_id, pinned_block_ids=pinned)
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
    return outputs[request_id]


def import_from(engine, store, prompt):
    hashes, first, _ = engine.store_bridge.prefix_plan(prompt)
    return engine.store_bridge.import_prefix(prompt, first, store.load(hashes[first:]))


@pytest.fixture()
def prompt():
    rng = random.Random(3)
    return [rng.randrange(3, 2000) for _ in range(150)]  # 9 full blocks + 6 tokens


def test_write_through_then_import_gives_the_same_output(tiny_qwen2_dir, prompt):
    store = KVStore(b"unused", KVStoreSettings())
    writer = make_engine(tiny_qwen2_dir, store)
    original = run(writer, prompt, "a")
    assert store.stats().tiers["host"]["stored"] == 9  # full prompt blocks only

    reader = make_engine(tiny_qwen2_dir)  # an empty device pool, the same store
    held = import_from(reader, store, prompt)
    assert len(held) == 9 and reader.pool.num_used == 9  # held until admitted
    again = run(reader, prompt, "b", held)
    assert again.num_cached_tokens == 9 * 16
    assert again.token_ids == original.token_ids
    reader.pool.check()
    assert reader.pool.num_used == 0


def test_blocks_of_other_tokens_are_refused(tiny_qwen2_dir, prompt):
    store = KVStore(b"unused", KVStoreSettings())
    run(make_engine(tiny_qwen2_dir, store), prompt, "a")
    reader = make_engine(tiny_qwen2_dir)
    hashes = reader.store_bridge.prefix_plan(prompt).hashes
    blocks = store.load(hashes)
    forged = [blocks[0], StoredBlock(blocks[1].key, tuple(t + 1 for t in blocks[1].token_ids), blocks[1].kv)]
    held = reader.store_bridge.import_prefix(prompt, 0, forged + blocks[2:])
    assert len(held) == 1  # stops at the forged block
    reader.pool.release(held)
    assert reader.pool.num_used == 0
    reader.pool.check()


def test_blocks_of_another_shape_are_refused(tiny_qwen2_dir, prompt):
    """A stored block whose KV is not one block of this cache (a header damaged to
    another shape of the same size, which the payload's checksum does not cover)
    ends the prefix there, instead of failing the copy."""
    store = KVStore(b"unused", KVStoreSettings())
    run(make_engine(tiny_qwen2_dir, store), prompt, "a")
    reader = make_engine(tiny_qwen2_dir)
    blocks = store.load(reader.store_bridge.prefix_plan(prompt).hashes)
    permuted = StoredBlock(blocks[2].key, blocks[2].token_ids, blocks[2].kv.transpose(-1, -2).contiguous())
    held = reader.store_bridge.import_prefix(prompt, 0, blocks[:2] + [permuted] + blocks[3:])
    assert len(held) == 2
    reader.pool.release(held)
    assert reader.pool.num_used == 0
    reader.pool.check()


def test_a_copy_that_fails_holds_no_block(tiny_qwen2_dir, prompt):
    """The copy onto the device failing (out of memory for its staging tensor, on a
    GPU the KV cache fills) imports nothing: the prompt is computed, and neither
    the prefix already in the pool nor the blocks allocated for the copy stay taken
    (they were, for good, on every request for that prompt)."""
    store = KVStore(b"unused", KVStoreSettings())
    run(make_engine(tiny_qwen2_dir, store), prompt, "a")
    reader = make_engine(tiny_qwen2_dir)
    hashes = reader.store_bridge.prefix_plan(prompt).hashes
    held = reader.store_bridge.import_prefix(prompt, 0, store.load(hashes[:3]))  # 3 blocks in the pool
    reader.pool.release(held)
    again = reader.store_bridge.import_prefix(prompt, 0, store.load(hashes[:3]))  # found in the pool meanwhile
    assert again == held and reader.store_bridge.num_imported == 3  # (counted once: copied once)
    reader.pool.release(again)

    def out_of_memory(block_ids, kv):
        raise torch.OutOfMemoryError("CUDA out of memory (as a test)")

    reader.runner.write_blocks = out_of_memory
    first = reader.store_bridge.prefix_plan(prompt).num_in_pool
    assert first == 3
    assert reader.store_bridge.import_prefix(prompt, first, store.load(hashes[first:])) == []
    assert reader.pool.num_used == 0 and reader.store_bridge.num_imported == 3
    reader.pool.check()


def test_imported_blocks_are_released_when_the_request_fails(tiny_qwen2_dir, prompt):
    store = KVStore(b"unused", KVStoreSettings())
    run(make_engine(tiny_qwen2_dir, store), prompt, "a")
    reader = make_engine(tiny_qwen2_dir)
    held = import_from(reader, store, prompt)
    with pytest.raises(Exception, match="outside the vocabulary"):
        reader.add_request(prompt + [10**6], GREEDY, "bad", pinned_block_ids=held)
    assert reader.pool.num_used == 0
    held = import_from(reader, store, prompt)
    reader.add_request(prompt, GREEDY, "aborted", pinned_block_ids=held)
    reader.abort("aborted")
    assert reader.pool.num_used == 0
    reader.pool.check()


def test_held_imports_never_starve_the_head_of_the_queue(tiny_qwen2_dir):
    """Requests holding imported prefixes wait behind one that needs their blocks."""
    rng = random.Random(4)
    store = KVStore(b"unused", KVStoreSettings())
    prompts = [[rng.randrange(3, 2000) for _ in range(100)] for _ in range(3)]  # 6 full blocks each
    writer = make_engine(tiny_qwen2_dir, store)
    for i, p in enumerate(prompts):
        run(writer, p, f"w{i}")
    engine = make_engine(tiny_qwen2_dir, num_blocks=16)
    big = [rng.randrange(3, 2000) for _ in range(200)]  # needs 13 blocks of the 16
    engine.add_request(big, GREEDY, "head")
    for i, p in enumerate(prompts[:2]):  # 12 blocks held by two requests behind it
        engine.add_request(p, GREEDY, f"held{i}", pinned_block_ids=import_from(engine, store, p))
    finished = set()
    for _ in range(500):
        finished |= {o.request_id for o in engine.step() if o.finished}
        if not engine.has_unfinished():
            break
    assert finished == {"head", "held0", "held1"}
    engine.pool.check()


def test_a_reservation_without_room_plans_no_import(tiny_qwen2_dir, prompt):
    """A decode worker asks, with its prefix plan, whether the reservation (the
    prompt and a token: 10 blocks) fits before it loads anything from the store:
    the loaded blocks need pool blocks as much as computed ones."""
    reader = make_engine(tiny_qwen2_dir, num_blocks=16)
    bridge = reader.store_bridge
    hold = reader.reserve(list(range(3, 3 + 16 * 7)), GREEDY, "hold")  # 112 tokens and a token: 8 of 16 blocks
    assert hold is not None and reader.pool.num_available == 8
    plan = bridge.prefix_plan(prompt, reader.reservation_room(len(prompt), GREEDY))
    assert (plan.num_in_pool, plan.has_room) == (0, False)
    assert reader.reserve(prompt, GREEDY, "b") is None  # as the plan said
    reader.cancel_reservation("hold")
    assert bridge.prefix_plan(prompt, reader.reservation_room(len(prompt), GREEDY)).has_room
    assert bridge.prefix_plan(prompt).has_room  # nothing asked: no room to miss
    assert reader.reserve(prompt, GREEDY, "b") is not None

