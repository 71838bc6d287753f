"""Block pool and prefix cache invariants (plain Python, no model)."""

from __future__ import annotations

import random

import pytest

from actors.block_pool import BlockPool, NoFreeBlocks, block_hashes


def test_hash_chain_names_the_whole_prefix():
    a = block_hashes(list(range(40)), 16)
    b = block_hashes([99] + list(range(1, 40)), 16)
    assert len(a) == 2  # the trailing partial block is not hashed
    assert a[0] != b[0] and a[1] != b[1]  # a change in block 0 changes every later hash
    assert block_hashes(list(range(40)), 16, known=a[:1]) == a
    assert block_hashes(list(range(40)), 16, seed=b"other-model") != a


def test_allocate_release_and_accounting():
    pool = BlockPool(8, 16)
    table = pool.allocate(5)
    assert pool.num_used == 5 and pool.num_available == 3
    with pytest.raises(NoFreeBlocks):
        pool.allocate(4)
    pool.release(table)
    assert pool.num_used == 0 and pool.num_available == 8
    pool.check()


def test_freed_blocks_stay_findable_until_reused():
    pool = BlockPool(4, 2)
    tokens = [1, 2, 3, 4]
    hashes = block_hashes(tokens, 2)
    table = pool.allocate(2)
    for block_id, block_hash, start in zip(table, hashes, (0, 2)):
        pool.register(block_id, block_hash, tokens[start : start + 2])
    pool.release(table)
    assert pool.num_cached == 2
    assert pool.lookup(hashes, tokens) == table
    pool.take(table)  # a hit takes references
    assert pool.num_used == 2 and pool.num_cached == 0
    pool.release(table)
    pool.allocate(4)  # reuse evicts every cached block
    assert pool.lookup(hashes, tokens) == []
    pool.check()


def test_can_hold_counts_idle_hits_once():
    """A table whose prefix is cached: the hits are taken, not allocated, so an
    idle cached hit (free, evictable) is not also room for the rest."""
    pool = BlockPool(4, 2)
    tokens = [1, 2, 3, 4]
    hits = pool.allocate(2)
    for block_id, block_hash, start in zip(hits, block_hashes(tokens, 2), (0, 2)):
        pool.register(block_id, block_hash, tokens[start : start + 2])
    pool.release(hits)
    assert pool.num_available == 4  # two free, two idle cached
    assert pool.can_hold(8, hits) and not pool.can_hold(9, hits)  # 4 blocks: 2 hits + 2 free; 5: one short
    assert pool.can_hold(8, []) and not pool.can_hold(9, [])  # without the hits: all 4 evictable or free
    pool.take(hits)  # in use elsewhere now: the same answers
    assert pool.can_hold(8, hits) and not pool.can_hold(9, hits)
    pool.release(hits)
    pool.check()


def test_lookup_verifies_tokens_not_only_hashes():
    pool = BlockPool(2, 2)
    [block] = pool.allocate(1)
    forged = block_hashes([1, 2], 2)
    pool.register(block, forged[0], [7, 7])
    assert pool.lookup(forged, [1, 2]) == []


def test_tail_blocks_are_evicted_before_the_head():
    pool = BlockPool(3, 1)
    tokens = [5, 6, 7]
    hashes = block_hashes(tokens, 1)
    table = pool.allocate(3)
    for index, block_id in enumerate(table):
        pool.register(block_id, hashes[index], tokens[index : index + 1])
    pool.release(table)
    pool.allocate(1)
    assert pool.lookup(hashes, tokens) == table[:2]


def test_release_below_zero_is_an_error():
    pool = BlockPool(2, 16)
    table = pool.allocate(1)
    pool.release(table)
    with pytest.raises(AssertionError):
        pool.release(table)


def test_randomized_workload_keeps_accounting():
    rng = random.Random(0)
    pool = BlockPool(64, 4)
    live: list[tuple[list[int], list[int]]] = []
    for _ in range(2000):
        action = rng.random()
        if action < 0.5 and pool.num_available:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 24))]
            hashes = block_hashes(tokens, 4)
            hits = pool.lookup(hashes, tokens)
            pool.take(hits)
            need = -(-len(tokens) // 4) - len(hits)
            if need > pool.num_available:
                pool.release(hits)
                continue
            table = hits + pool.allocate(need)
            for index in range(len(hits), len(hashes)):
                pool.register(table[index], hashes[index], tokens[index * 4 : index * 4 + 4])
            live.append((table, tokens))
        elif live:
            table, _ = live.pop(rng.randrange(len(live)))
            pool.release(table)
        pool.check()
        in_tables = [b for table, _ in live for b in table]
        assert pool.num_used == len(set(in_tables))
        for block_id in set(in_tables):
            assert pool.blocks[block_id].ref_count == in_tables.count(block_id)
    for table, _ in live:
        pool.release(table)
    pool.check()
    assert pool.num_used == 0


def test_cache_events_report_stores_and_evictions_to_every_reader():
    pool = BlockPool(2, 2)
    tokens = [1, 2, 3, 4]
    hashes = block_hashes(tokens, 2)
    first = pool.events_since(None)  # a new reader: a snapshot of an empty cache
    assert first.reset and first.events == []
    table = pool.allocate(2)
    pool.register(table[0], hashes[0], tokens[:2])
    pool.register(table[1], hashes[1], tokens[2:])
    a = pool.events_since(first.cursor)
    assert not a.reset and a.events == [(True, hashes[0]), (True, hashes[1])]
    assert pool.events_since(a.cursor).events == []
    late = pool.events_since(None)  # a reader that starts now gets what the cache holds
    assert late.reset and sorted(late.events) == sorted([(True, h) for h in hashes])
    pool.release(table)
    pool.allocate(1)  # evicts the tail block first
    for cursor in (a.cursor, late.cursor):  # each reader, at its own pace
        assert pool.events_since(cursor) == ((a.cursor[0], a.cursor[1] + 1), False, [(False, hashes[1])])
    assert pool.events_since(first.cursor).events == [(True, hashes[0]), (True, hashes[1]), (False, hashes[1])]


def test_a_reader_that_falls_behind_the_log_or_comes_from_another_pool_gets_a_snapshot():
    pool = BlockPool(1, 2)  # the log keeps 8 events a block
    cursor = pool.events_since(None).cursor
    for round_ in range(6):  # 12 events: a register and an eviction a round
        tokens = [round_, round_]
        (block,) = pool.allocate(1)
        pool.register(block, block_hashes(tokens, 2)[0], tokens)
        pool.release([block])
    behind = pool.events_since(cursor)
    assert behind.reset and behind.events == [(True, block_hashes([5, 5], 2)[0])]
    assert not pool.events_since(behind.cursor).reset
    assert pool.events_since(BlockPool(1, 2).events_since(None).cursor).reset  # another pool's cursor


def test_kv_namespace_depends_on_what_makes_kv_compatible(tmp_path):
    from actors.block_pool import kv_namespace

    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    base = kv_namespace(tmp_path, "float32", 16)
    assert base == kv_namespace(tmp_path, "float32", 16)
    assert base != kv_namespace(tmp_path, "bfloat16", 16)
    assert base != kv_namespace(tmp_path, "float32", 32)
    (tmp_path / "config.json").write_text('{"hidden_size": 16}')
    assert base != kv_namespace(tmp_path, "float32", 16)


def test_kv_namespace_tells_other_weights_under_the_same_config_apart(tmp_path):
    """A fine-tune saved with its base's config.json (or a preset built again by a
    newer builder) shared the base's namespace, so a KV store on disk or a shared
    path served it the base's KV for the same tokens."""
    import shutil

    import numpy as np
    from safetensors.numpy import save_file

    from actors.block_pool import kv_namespace

    rng = np.random.default_rng(0)
    weights = {"a.weight": rng.standard_normal((64, 64), dtype=np.float32),
               "b.weight": rng.standard_normal((3,), dtype=np.float32)}

    def checkpoint(name: str, tensors: dict):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text('{"hidden_size": 64}')
        save_file(tensors, str(folder / "model.safetensors"))
        return folder

    base = kv_namespace(checkpoint("base", weights), "float32", 16)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "base", copy)  # (another path, other file times: the same weights)
    assert kv_namespace(copy, "float32", 16) == base
    tuned = dict(weights, **{"a.weight": weights["a.weight"] + 1e-3})  # every entry of one matrix trained
    assert kv_namespace(checkpoint("tuned", tuned), "float32", 16) != base
    last_row = weights["a.weight"].copy()
    last_row[-1] += 1.0  # (only the tensor's end: a sample of its first bytes alone would miss it)
    assert kv_namespace(checkpoint("last-row", dict(weights, **{"a.weight": last_row})), "float32", 16) != base
    small = dict(weights, **{"b.weight": weights["b.weight"] * 2})
    assert kv_namespace(checkpoint("small", small), "float32", 16) != base
    broken = checkpoint("broken", weights)
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")  # (its first 8 bytes: a header of 8e18 bytes)
    assert kv_namespace(broken, "float32", 16) != base  # (loading it says what is wrong: not this)
