"""The KV store's upkeep of its disk tiers, on real files: the TTL sweep that
bounds a shared path (files of other nodes included), temporary files told
apart from another writer's write in flight, capacity kept when a tier indexes
another writer's files, and a file system that refuses writes (a full disk)
costing only what it could not store. Found by a review: each of these failed
on the code before."""

from __future__ import annotations

import errno
import os
import time

from actors import kv_tiers
from actors.kv_store import KVStore, KVStoreSettings
from tests.test_kv_store import BLOCK_BYTES, NAMESPACE, Clock, assert_same, keys_of, make_blocks

FILE_BYTES = 4436  # one encoded block of make_blocks' shape: its header and KV


def test_the_ttl_sweep_bounds_a_shared_path_and_other_nodes_files(tmp_path):
    """A shared path bounded by `ttl_s` alone: entries never met again went only
    when `expire` was called, which nothing did, so the path grew for ever. Now
    `save` and `load` sweep every `ttl_s / 10`, and a disk tier's sweep also
    removes the files past the TTL that it never indexed (written by a node
    since gone)."""
    shared = tmp_path / "shared"
    gone_node = KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, shared_path=str(shared), shared_bytes=None))
    old = make_blocks(3, seed=1)
    gone_node.save(old)
    hour_ago = time.time() - 3600
    for path in shared.rglob("*.kv"):
        os.utime(path, (hour_ago, hour_ago))
    later = [0.0]  # seconds this store's clock is ahead of the files' (a sweep comes due)
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=8 * BLOCK_BYTES, shared_path=str(shared),
                                               shared_bytes=None, ttl_s=60), lambda: time.time() + later[0])
    assert store.shared.num_entries == 3  # indexed on start (their age counts from their mtime)
    gone_node.save(make_blocks(2, seed=2))  # written since, never indexed by `store`, then left for an hour
    for path in shared.rglob("*.kv"):
        os.utime(path, (hour_ago, hour_ago))
    fresh = make_blocks(4, seed=3)
    later[0] = 7  # past ttl_s / 10
    store.save(fresh)  # the first sweep
    assert sorted(p.stem for p in shared.rglob("*.kv")) == sorted(b.key.hex() for b in fresh)
    assert store.shared.num_entries == 4
    assert_same(store.load(keys_of(fresh)), fresh)


def test_the_sweep_runs_every_tenth_of_the_ttl(tmp_path):
    clock = Clock()
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=8 * BLOCK_BYTES, disk_path=str(tmp_path), ttl_s=60),
                    clock)
    day_one = make_blocks(3, seed=1)
    store.save(day_one)
    clock.now += 61  # past the TTL, and a sweep is due
    store.load(keys_of(make_blocks(1, seed=9)))  # a miss: nothing of day one is met
    assert store.host.num_entries == 0 and store.disk.num_entries == 0
    store.save(make_blocks(2, seed=2))
    clock.now += 5  # not due: what expired meanwhile waits for its key or the next sweep
    store.save(make_blocks(1, seed=3))
    assert store.host.num_entries == 3


def test_only_abandoned_temporary_files_are_removed(tmp_path):
    """A store starting on a shared path removed every temporary file, another
    node's write in flight among them (its rename then failed). Only one older
    than `ABANDONED_TMP_S` is a dead writer's."""
    blocks = make_blocks(2)
    KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, disk_path=str(tmp_path))).save(blocks)
    folder = next(tmp_path.rglob("*.kv")).parent
    in_flight, abandoned = folder / ".a.kv.1111.tmp", folder / ".b.kv.2222.tmp"
    in_flight.write_bytes(b"being written")
    abandoned.write_bytes(b"partial")
    long_ago = time.time() - kv_tiers.ABANDONED_TMP_S - 60
    os.utime(abandoned, (long_ago, long_ago))
    restarted = KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, disk_path=str(tmp_path)))
    assert in_flight.exists() and not abandoned.exists()
    assert restarted.disk.num_entries == 2
    os.utime(in_flight, (long_ago, long_ago))  # its writer died after all
    restarted.expire()
    assert not in_flight.exists()


def test_indexing_another_writers_files_keeps_the_capacity(tmp_path):
    """A tier found another writer's files by their path (a load, a lookup) or
    indexed them on start, and held them all over its capacity until its own
    next put: a decode-only node, which never saves, without bound."""
    shared = str(tmp_path / "shared")
    capacity = 10 * FILE_BYTES
    bounded = KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, shared_path=shared, shared_bytes=capacity))
    writer = KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, shared_path=shared, shared_bytes=100 * FILE_BYTES))
    blocks = make_blocks(30)
    writer.save(blocks)
    assert bounded.lookup(keys_of(blocks)) > 0
    assert bounded.shared.num_bytes <= 0.9 * capacity
    loaded = bounded.load(keys_of(blocks[-5:]))
    assert_same(loaded, blocks[-5:])
    assert bounded.shared.num_bytes <= 0.9 * capacity
    restarted = KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, shared_path=shared, shared_bytes=capacity))
    assert restarted.shared.num_bytes <= 0.9 * capacity


class _FullDisk:
    """`open` of a file system that takes half of a write, then says it is full."""

    def __init__(self, path, mode="r", *args, **kwargs) -> None:
        self.file = open(path, mode, *args, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def write(self, data) -> None:
        self.file.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_stores_nothing_more_and_fails_no_call(tmp_path, monkeypatch):
    """Writes a disk tier could not make (full, read-only) raised out of `save`
    (the rest of its batch and the blocks being demoted were lost) and out of a
    `load` whose promotion demoted (its hits thrown away: the prompt recomputed),
    and left their partial temporary files. Now such a block is not stored there,
    counted, and nothing else changes."""
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=4 * BLOCK_BYTES, disk_path=str(tmp_path / "disk"),
                                               high_watermark=0.9, low_watermark=0.5))
    blocks = make_blocks(6)
    store.save(blocks[:4])  # the 4th put demotes blocks 0 and 1 to disk
    monkeypatch.setattr(kv_tiers, "open", _FullDisk, raising=False)  # (the module's name shadows the builtin)
    store.save(blocks[4:])  # demotes blocks 2 and 3: the disk is full, they are not stored
    assert_same(store.load(keys_of(blocks[:2])), blocks[:2])  # promoted, demoting 4 and 5: not stored either
    monkeypatch.delattr(kv_tiers, "open")
    assert list(tmp_path.rglob("*.tmp")) == []
    assert store.stats().num_write_errors == 4
    assert store.host.num_entries == 2 and store.lookup(keys_of(blocks[:2])) == 2
    store.save(blocks[2:4])  # the disk works again
    assert store.lookup(keys_of(blocks[:4])) == 4


def test_an_expired_entry_rewritten_by_another_node_is_kept(tmp_path):
    """Node B indexed X; X expired and node A wrote it again. B's old entry was
    stale by its own age, and B deleted A's new copy when it met X (now also in
    every sweep). B now sees the file is not the one it indexed, and keeps it."""
    shared = str(tmp_path / "shared")
    later = [0.0]  # (wall time, shifted: B ages what it finds by its path from the file's mtime)

    def clock() -> float:
        return time.time() + later[0]

    node_a = KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, shared_path=shared, ttl_s=60), clock)
    node_b = KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, shared_path=shared, ttl_s=60), clock)
    x = make_blocks(1)
    node_a.save(x)
    assert node_b.lookup(keys_of(x)) == 1  # B indexes it, found by its path
    later[0] += 61
    assert node_a.load(keys_of(x)) == []  # expired: A deletes it, computes it again, and writes it
    node_a.save(x)
    assert node_b.lookup(keys_of(x)) == 1
    assert node_b.expire() == 0
    assert_same(node_b.load(keys_of(x)), x)
    later[0] += 61  # and B's entry ages from when it saw the new file
    assert node_b.lookup(keys_of(x)) == 0 and not node_a.shared._path(x[0].key).exists()
