"""The KV store's tiers and policies, on real files: write-through, demotion,
watermarks, LRU, TTL, pinning, corrupt and foreign entries, restart recovery, and a
shared path written by one node's store and read by another's."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time

import pytest
import torch

from actors.block_pool import block_hashes
from actors.kv_store import KVStore, KVStoreSettings
from actors.kv_tiers import ABANDONED_TMP_S, MAGIC, StoredBlock, TierPolicy, encode_entry

BLOCK_SHAPE = (2, 2, 16, 2, 8)  # layers, K/V, block size, KV heads, head dim
BLOCK_BYTES = 2 * 2 * 16 * 2 * 8 * 4
NAMESPACE = hashlib.sha256(b"model-a|float32|16").digest()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_blocks(count: int, seed: int = 0, namespace: bytes = NAMESPACE) -> list[StoredBlock]:
    tokens = [(seed * 7919 + i) % 1000 for i in range(count * 16)]
    keys = block_hashes(tokens, 16, namespace)
    gen = torch.Generator().manual_seed(seed)
    return [StoredBlock(k, tuple(tokens[i * 16 : (i + 1) * 16]), torch.randn(BLOCK_SHAPE, generator=gen))
            for i, k in enumerate(keys)]


def keys_of(blocks):
    return [b.key for b in blocks]


def assert_same(loaded, blocks):
    assert [b.key for b in loaded] == [b.key for b in blocks]
    for got, want in zip(loaded, blocks):
        assert got.token_ids == want.token_ids
        assert torch.equal(got.kv, want.kv)


def test_write_through_and_longest_prefix(tmp_path):
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=100 * BLOCK_BYTES, disk_path=str(tmp_path)))
    blocks = make_blocks(6)
    store.save(blocks[:4])
    assert store.lookup(keys_of(blocks)) == 4
    assert_same(store.load(keys_of(blocks)), blocks[:4])  # stops at the first miss
    assert store.load(keys_of(blocks[4:])) == []
    stats = store.stats().tiers
    assert stats["host"]["entries"] == 4 and stats["disk"]["entries"] == 0  # disk only gets demotions


def test_watermarks_demote_lru_to_disk(tmp_path):
    settings = KVStoreSettings(host_bytes=10 * BLOCK_BYTES, disk_path=str(tmp_path), high_watermark=0.9,
                               low_watermark=0.5)
    store = KVStore(NAMESPACE, settings)
    blocks = make_blocks(10)
    store.save(blocks[:9])  # 9 blocks = 0.9 of capacity: not above the high mark
    assert store.stats().tiers["host"]["entries"] == 9
    store.load([blocks[0].key])  # block 0 becomes most recently used
    store.save(blocks[9:])  # 10 > 9: evict down to 5
    host, disk = store.host, store.disk
    assert host.num_entries == 5 and disk.num_entries == 5
    assert host.contains(blocks[0].key)  # touched, so kept
    assert all(disk.contains(b.key) for b in blocks[1:6])  # least recently used went down
    assert_same(store.load(keys_of(blocks)), blocks)  # every block still served
    assert store.stats().tiers["disk"]["hits"] >= 5  # promotions evict in turn: the set exceeds the host tier


def test_disk_watermarks_delete(tmp_path):
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, disk_path=str(tmp_path), disk_bytes=4 * 1024 * 10))
    store.save(make_blocks(12))
    disk = store.disk
    assert disk.num_bytes <= 0.9 * disk.policy.capacity_bytes
    assert len(list(disk.dir.glob("*/*.kv"))) == disk.num_entries


def test_ttl_and_pinning(tmp_path):
    clock = Clock()
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=4 * BLOCK_BYTES, disk_path=str(tmp_path), ttl_s=60,
                                               high_watermark=0.9, low_watermark=0.5), clock)
    blocks = make_blocks(6)
    store.pin([blocks[0].key])
    store.save(blocks[:4])  # 4 > 3.6: evict to 2, block 0 pinned stays
    assert store.host.contains(blocks[0].key)
    clock.now += 61
    assert store.lookup(keys_of(blocks)) == 1  # expired everywhere but the pinned block
    assert store.expire() == 2  # blocks 2 and 3 (block 1 went when the lookup met it)
    store.unpin([blocks[0].key])
    assert store.lookup(keys_of(blocks)) == 0
    assert list(tmp_path.rglob("*.kv")) == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "header", "negative shape", "huge token id",
                                    "nested header", "no tensor's shape"])
def test_corrupt_entry_is_skipped_and_removed(tmp_path, damage):
    """Damaged payloads, files and headers (one whose JSON still parses but
    lacks a field, or holds two negative sizes whose product is the payload's,
    or a number past any integer, or is nested past Python's recursion limit, or
    an empty payload's shape no tensor has: they raised from `load`, and the
    file stayed, and from saves whose evictions read it) alike: the entry is a
    miss, counted and removed."""
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, disk_path=str(tmp_path)))
    blocks = make_blocks(3)
    store.save(blocks)
    path = store.disk._path(blocks[1].key)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF
    elif damage == "truncate":
        data = data[:-7]
    elif damage == "header":  # `token_ids` renamed, the header's length unchanged
        at = data.index(b'"token_ids"')
        data[at : at + 11] = b'"token_idz"'
    elif damage == "negative shape":  # [2, 2, ...] as [-2, -2, ...]
        data = _with_header(data, lambda header: header.update(shape=[-2, -2, *header["shape"][2:]]))
    elif damage == "huge token id":  # (infinite as a float)
        data = _with_header(data, lambda header: header["token_ids"].__setitem__(0, 1e400))
    elif damage == "nested header":
        header = b"[" * 50_000 + b"]" * 50_000
        data = MAGIC + struct.pack("<I", len(header)) + header
    elif damage == "no tensor's shape":  # (its payload empty, and its checksum that of nothing)
        empty = hashlib.blake2b(b"", digest_size=16).hexdigest()
        data = _with_header(data, lambda header: header.update(shape=[0, 2**62, 2**62], checksum=empty))
        data = data[: len(data) - BLOCK_BYTES]
    else:
        data = bytearray(b"not a kv entry")
    path.write_bytes(bytes(data))
    assert_same(store.load(keys_of(blocks)), blocks[:1])
    assert not path.exists()
    assert store.stats().num_corrupt == 1


def _with_header(data: bytes, edit) -> bytes:
    """An entry's file with its JSON header edited (`edit(header)`), the payload as it was."""
    start = len(MAGIC) + 4
    (length,) = struct.unpack_from("<I", data, len(MAGIC))
    header = json.loads(bytes(data[start : start + length]))
    edit(header)
    written = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(written)) + written + bytes(data[start + length :])


def test_a_blocks_age_goes_with_it_between_tiers(tmp_path):
    """A block demoted to disk, then promoted by a hit, is as old as when the
    store first took it: each move wrote a copy aged from then, and a block in
    use was served long past `ttl_s`. A file's mtime is its age (a restart
    indexes it by that)."""
    clock = Clock()
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=2 * BLOCK_BYTES, disk_path=str(tmp_path), ttl_s=100),
                    clock)
    first, *others = make_blocks(3)
    store.save([first])
    clock.now += 50
    store.save(others)  # the first block demoted to disk
    assert not store.host.contains(first.key) and store.disk.contains(first.key)
    assert os.stat(store.disk._path(first.key)).st_mtime == 1000.0
    clock.now += 40
    assert_same(store.load([first.key]), [first])  # 90 s old: served, promoted
    assert store.host.contains(first.key)
    clock.now += 11
    assert store.load([first.key]) == [] and store.lookup([first.key]) == 0


def test_a_mount_that_cannot_set_a_files_time_still_stores_the_block(tmp_path, monkeypatch):
    """The age is set once the file is renamed in place: where the mount refuses
    (EPERM), the write stood counted as failed though the file was there, unindexed."""
    def refuses(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "utime", refuses)
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, disk_path=str(tmp_path)))
    blocks = make_blocks(3)
    store.save(blocks)
    assert_same(store.load(keys_of(blocks)), blocks)
    assert store.stats().num_write_errors == 0 and store.stats().tiers["disk"]["entries"] == 3


def test_a_tier_whose_folder_cannot_be_made_starts_empty(tmp_path):
    """A shared mount gone or a file in the way at start: that tier stores nothing
    (its writes counted), the others serve (the store's constructor raised, and
    the node had no store at all)."""
    (tmp_path / "file").write_text("in the way")
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=8 * BLOCK_BYTES, shared_path=str(tmp_path / "file" / "kv"),
                                               ttl_s=60))
    blocks = make_blocks(2)
    store.save(blocks)
    assert_same(store.load(keys_of(blocks)), blocks)
    assert store.stats().tiers["shared"]["entries"] == 0 and store.stats().num_write_errors == 2


def test_restart_recovery_and_leftover_temporaries(tmp_path):
    blocks = make_blocks(5)
    KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, disk_path=str(tmp_path))).save(blocks)
    leftover = next(tmp_path.rglob("*.kv")).with_name(".half-written.kv.1234.tmp")
    leftover.write_bytes(b"partial")
    long_ago = time.time() - ABANDONED_TMP_S - 60  # (a younger one may be another writer's, in flight)
    os.utime(leftover, (long_ago, long_ago))
    restarted = KVStore(NAMESPACE, KVStoreSettings(host_bytes=10 * BLOCK_BYTES, disk_path=str(tmp_path)))
    assert restarted.disk.num_entries == 5
    assert not leftover.exists()
    assert_same(restarted.load(keys_of(blocks)), blocks)
    assert restarted.stats().tiers["host"]["entries"] == 5  # promoted on the way


def test_other_namespace_is_never_read(tmp_path):
    blocks = make_blocks(3)
    KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, disk_path=str(tmp_path))).save(blocks)
    other_ns = hashlib.sha256(b"model-a|float32|32").digest()  # another block size
    other = KVStore(other_ns, KVStoreSettings(host_bytes=0, disk_path=str(tmp_path)))
    assert other.disk.num_entries == 0
    assert other.load(keys_of(blocks)) == []
    # Even a file copied under the other namespace's directory is refused.
    source = KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, disk_path=str(tmp_path))).disk._path(blocks[0].key)
    target = other.disk._path(blocks[0].key)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source.read_bytes())
    assert other.load([blocks[0].key]) == []
    assert other.stats().num_corrupt == 1


def test_shared_path_between_two_nodes(tmp_path):
    shared = str(tmp_path / "shared")
    node_a = KVStore(NAMESPACE, KVStoreSettings(disk_path=str(tmp_path / "a"), shared_path=shared))
    node_b = KVStore(NAMESPACE, KVStoreSettings(disk_path=str(tmp_path / "b"), shared_path=shared))
    blocks = make_blocks(4)
    node_a.save(blocks)
    assert_same(node_b.load(keys_of(blocks)), blocks)  # found by path, written by A
    assert node_b.stats().tiers["shared"]["hits"] == 4


def test_settings_are_checked():
    with pytest.raises(ValueError, match="at least one tier"):
        KVStore(NAMESPACE, KVStoreSettings(host_bytes=0))
    with pytest.raises(ValueError, match="low_watermark"):
        TierPolicy(100, high_watermark=0.5, low_watermark=0.8)


def test_events_say_which_tier_holds_what(tmp_path):
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=4 * BLOCK_BYTES, disk_path=str(tmp_path),
                                               high_watermark=0.9, low_watermark=0.5))
    start = {tier: batch.cursor for tier, batch in store.events_since().items()}
    blocks = make_blocks(4)
    store.save(blocks)  # the 4th put evicts blocks 0 and 1 down to disk
    events = {tier: batch.events for tier, batch in store.events_since(start).items()}
    host_now = {k for stored, k in events["host"] if stored} - {k for stored, k in events["host"] if not stored}
    assert host_now == {b.key for b in blocks[2:]}
    assert [k for stored, k in events["disk"] if stored] == [b.key for b in blocks[:2]]
    cursors = {tier: batch.cursor for tier, batch in store.events_since(start).items()}
    assert {tier: batch.events for tier, batch in store.events_since(cursors).items()} == {"host": [], "disk": []}
    snapshot = store.events_since()  # a reader that starts now: what each tier holds
    assert all(batch.reset for batch in snapshot.values())
    assert {k for _, k in snapshot["host"].events} == host_now
    assert {k for _, k in snapshot["disk"].events} == {b.key for b in blocks[:2]}


def test_a_load_keeps_the_prefix_it_reads(tmp_path):
    """A hit on disk promoted to host as it was read pushed host blocks down to
    disk, whose watermark then deleted the prompt's blocks not read yet: an old
    prefix of 6 blocks loaded 2 and lost the rest. Promoted after the reads, all
    6 load and stay in some tier."""
    file_bytes = len(encode_entry(NAMESPACE, make_blocks(1)[0]))
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=4 * BLOCK_BYTES, disk_path=str(tmp_path),
                                               disk_bytes=20 * file_bytes))
    prompt = make_blocks(6, seed=1)
    store.save(prompt)
    store.save(make_blocks(12, seed=2))  # (the prompt all on disk now, the disk near its watermark)
    assert all(store.disk.contains(k) for k in keys_of(prompt))
    assert_same(store.load(keys_of(prompt)), prompt)
    assert all(any(t.contains(k) for t in store.tiers) for k in keys_of(prompt))


def test_a_file_system_that_fails_stores_nothing_there_and_the_call_goes_on(tmp_path, monkeypatch):
    """A mount gone (stat answers EIO, which `Path.exists` passes on): a save
    raised from its first write there, and a load whose promotion demoted onto
    it raised with its hits; a tier's folder removed (a tmp cleaner) failed
    every write after it until a restart."""
    import errno
    import pathlib
    import shutil

    gone = []
    real_stat = pathlib.Path.stat

    def stat(path, *args, **kwargs):
        if gone and str(path).startswith(gone[0]):
            raise OSError(errno.EIO, "Input/output error")
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "stat", stat)
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=2 * BLOCK_BYTES, disk_path=str(tmp_path / "disk"),
                                               shared_path=str(tmp_path / "shared")))
    blocks = make_blocks(8)
    store.save(blocks[:6])  # (each in shared too: write-through)
    gone.append(str(tmp_path / "disk"))
    store.save(blocks[6:])
    assert store.disk.num_write_errors > 0
    assert_same(store.load(keys_of(blocks)), blocks)  # (the hits from shared; their demotions fail)
    gone.clear()
    shutil.rmtree(store.disk.dir)
    errors = store.disk.num_write_errors
    store.save(make_blocks(4, seed=3))
    assert store.disk.num_write_errors == errors and store.disk.dir.is_dir()


@pytest.mark.parametrize("code", ["EACCES", "ESTALE", "EMFILE", "EIO"])
def test_a_read_the_file_system_refuses_for_now_is_a_miss_that_keeps_the_file(tmp_path, monkeypatch, code):
    """A read refused by the file system (permissions, a stale NFS handle, no file
    descriptors left, an I/O error) says nothing of the file's bytes: before,
    any OSError deleted the file as if corrupt. Now the load misses there and
    counts it, the file and its entry stay, and the next load reads them. A file
    gone is forgotten, and counts as no error."""
    import errno
    import pathlib

    refused = set()
    real_read = pathlib.Path.read_bytes

    def read_bytes(path):
        if path in refused:
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        return real_read(path)

    monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=0, disk_path=str(tmp_path)))
    blocks = make_blocks(3)
    store.save(blocks)
    path = store.disk._path(blocks[1].key)
    refused.add(path)
    assert_same(store.load(keys_of(blocks)), blocks[:1])
    assert path.exists() and store.lookup(keys_of(blocks)) == 3
    assert store.stats().num_read_errors == 1 and store.stats().num_corrupt == 0
    refused.clear()
    assert_same(store.load(keys_of(blocks)), blocks)
    store.disk._path(blocks[2].key).unlink()
    assert_same(store.load(keys_of(blocks)), blocks[:2])
    assert store.lookup(keys_of(blocks)) == 2 and store.stats().num_read_errors == 1


def test_a_load_from_a_store_that_does_not_answer_gives_up():
    """The node's store is one serial actor doing file I/O: on a mount that hangs,
    a load waited for good, holding the request's import and a thread of the
    worker's pool. It gives up after `load_timeout_s` (the request computes)."""
    from concurrent.futures import Future

    from actors.kv_store_client import RemoteKVStore

    never = Future()
    call = type("Call", (), {"future": lambda self: never})()
    handle = type("Handle", (), {"load": type("Method", (), {"remote": lambda self, keys: call})()})()
    store = RemoteKVStore(handle, load_timeout_s=0.05)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        store.load([b"k"])
    assert time.monotonic() - started < 5


def test_write_through_waiting_for_a_slow_store_is_bounded_by_bytes():
    """The write-through held up to 64 batches whatever their size (a 7B model's
    steps: about 15 GB of host copies behind a slow store); past
    `max_pending_bytes` a batch is dropped, counted, and the rest are saved."""
    import threading

    from actors.kv_store_client import StoreWriter

    release, saved = threading.Event(), []

    class SlowStore:
        def save(self, blocks):
            release.wait(10)
            saved.extend(blocks)

    writer = StoreWriter(SlowStore(), max_pending_bytes=3 * BLOCK_BYTES)
    batches = [make_blocks(1, seed=i) for i in range(5)]
    for batch in batches:
        writer.submit(batch)
    assert writer.num_dropped_blocks == 2  # (three blocks' bytes wait: the first, being saved, and two)
    release.set()
    assert writer.flush(10) and keys_of(saved) == keys_of([b for batch in batches[:3] for b in batch])
    writer.submit(batches[4])
    assert writer.flush(10) and len(saved) == 4


def test_a_load_leaves_the_prompts_first_blocks_the_most_recent(tmp_path):
    """Its host hits were touched as they were read, before the disk hits were
    promoted: with the host tight, the promotions pushed the prompt's own first
    blocks (its host hits) down to disk. The first blocks are the most recent now."""
    file_bytes = len(encode_entry(NAMESPACE, make_blocks(1)[0]))
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=7 * BLOCK_BYTES, disk_path=str(tmp_path),
                                               disk_bytes=100 * file_bytes, high_watermark=1.0))
    prompt = make_blocks(8, seed=4)
    store.save(prompt[3:])
    store.save(prompt[:3])  # (the host: 5, 6, 7 then 0, 1, 2; 3 and 4 pushed down to disk)
    assert_same(store.load(keys_of(prompt)), prompt)
    assert all(store.host.contains(block.key) for block in prompt[:3])


def test_a_block_another_node_deleted_from_the_shared_path_is_written_back(tmp_path):
    """B's index of the shared path still names a file A's bound deleted: B
    storing that block again wrote nothing (a key held is only touched), and
    every node then missed it. It is written back."""
    shared = str(tmp_path / "shared")
    node_a = KVStore(NAMESPACE, KVStoreSettings(shared_path=shared))
    node_b = KVStore(NAMESPACE, KVStoreSettings(host_bytes=100 * BLOCK_BYTES, shared_path=shared))
    blocks = make_blocks(2)
    node_b.save(blocks)  # (written through to the shared path)
    assert node_a.lookup(keys_of(blocks)) == 2
    node_a.shared.remove(blocks[1].key)  # (as A's eviction would: the file goes)
    node_b.save(blocks)
    assert node_b.stats().num_write_errors == 0
    assert_same(KVStore(NAMESPACE, KVStoreSettings(shared_path=shared)).load(keys_of(blocks)), blocks)


def test_a_demotion_to_a_copy_the_tier_holds_makes_it_the_most_recent(tmp_path):
    """X, promoted from disk and used since, leaves the host again: its old copy
    on disk stayed least recently used, and the disk's next eviction deleted it
    before colder blocks. It is touched as it comes down."""
    blocks = make_blocks(5)
    file_bytes = max(len(encode_entry(NAMESPACE, block)) for block in blocks)  # (the token ids' digits vary)
    store = KVStore(NAMESPACE, KVStoreSettings(host_bytes=2 * BLOCK_BYTES, disk_path=str(tmp_path),
                                               disk_bytes=3 * file_bytes, high_watermark=1.0, low_watermark=1.0))
    x, a, b, c, d = blocks
    store.save([x, a, b])  # (x down to disk)
    assert store.load([x.key]) and store.disk.contains(x.key)  # (promoted, a down; x's disk copy kept)
    store.save([c])  # (b down)
    store.save([d])  # (x down again: its copy there made the most recent)
    assert list(store.disk._entries) == [a.key, b.key, x.key]
    store.save(make_blocks(2, seed=9))  # (c and d down: a and b are deleted, not x)
    assert list(store.disk._entries) == [x.key, c.key, d.key]
