"""KV store tiers: where a full KV block lives outside a worker's device pool.

A stored block is keyed by its hash-chain value (`block_pool.block_hashes`), whose
seed is the KV namespace (model config, dtype, block size, layout version): a key
names one prefix of one compatible KV layout, so no tier needs to know the model.
Each block also carries its tokens (the reader verifies them, as the device prefix
cache does) and its KV, one `[num_layers, 2, block_size, num_kv_heads, head_dim]`
tensor (the page-first layout makes a block one contiguous span).

Two tier kinds, one policy shape (`TierPolicy`):
- `MemoryTier`: tensors in this process (the node's store actor makes it shared by
  every worker on the node). LRU.
- `DiskTier`: one file per block under `root/<namespace>/`, for a local disk or a
  shared mount (NFS, Ceph) that several nodes write. Files are written to a
  temporary name and renamed, so a reader never sees a partial file; each carries a
  header (namespace, key, tokens, dtype, shape) and a checksum of its bytes, checked
  on every read: a corrupt or foreign file is deleted and reported as a miss, as
  is one gone; a read the file system refuses for now (EACCES, ESTALE on NFS,
  EMFILE, EIO) is a miss that keeps the file and its entry, and is counted. On
  start the tier indexes what is already there (restart recovery); a key another
  writer added since is found by its path. A write the file system refuses (full,
  read-only, gone) stores nothing and is counted; it never fails the caller.

Eviction: when a put takes a tier above `high_watermark` of its capacity, least
recently used unpinned entries go until it is at `low_watermark`; `put` returns them
so the store can demote them to the next tier. An entry a disk tier indexes from
another writer (on start, or found by its path) can also take it over the high
mark: the least recently used go then, deleted. An entry older than `ttl_s` is
never served (its age is the block's in the store: a demotion or a promotion
moves it with its age, a file keeping it as its mtime); it is removed when met
and by the store's periodic `expire`, which on a disk tier also removes the
files past it that this tier never indexed (another node's, on a shared path).
Pinned keys (a set the store owns) are exempt from both.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from actors.event_log import CacheEvents, Cursor, EventLog

MAGIC = b"TANDEMKV1\n"
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16)}
# A temporary file older than this (by its mtime) was left by a writer that died
# mid-write; a younger one may be another node's, between its write and its rename.
ABANDONED_TMP_S = 600.0

log = logging.getLogger("tandem.kv_store")
# A read failing with one of these finds no file at the key's path: the entry goes.
# Any other OSError says nothing of the file's bytes, which stay (`Unreadable`).
_NO_FILE = (FileNotFoundError, IsADirectoryError, NotADirectoryError)


class Unreadable(Exception):
    """A tier's copy of a block that cannot be read now, though it may be whole."""


@dataclass(frozen=True)
class StoredBlock:
    key: bytes
    token_ids: tuple[int, ...]
    kv: torch.Tensor  # one block, CPU, contiguous
    stored_s: float | None = None  # when the store first took it (read from a tier); None: a new block

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass(frozen=True)
class TierPolicy:
    capacity_bytes: int | None  # None: unbounded (a shared mount bounded by TTL)
    high_watermark: float = 0.9
    low_watermark: float = 0.7
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError(
                f"need 0 < low_watermark <= high_watermark <= 1, got {self.low_watermark}, {self.high_watermark}"
            )
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {self.capacity_bytes}")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {self.ttl_s}")


@dataclass
class _Entry:
    num_bytes: int
    created_s: float
    block: StoredBlock | None = None  # memory tier only
    file_id: tuple[int, int] | None = None  # disk tiers: the file's (inode, mtime in ns) when indexed


class Tier(ABC):
    """One tier. Not thread-safe: the store serialises calls."""

    name: str

    def __init__(self, policy: TierPolicy, pinned: set[bytes], clock: Callable[[], float]) -> None:
        self.policy = policy
        self.pinned = pinned
        self.clock = clock
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first
        self.num_bytes = 0
        # (True, key) when an entry appears, (False, key) when it goes: the global
        # scheduler's view of the tier, for routing; each scheduler replica reads
        # from its own cursor (actors/event_log.py).
        self.events = EventLog(capacity=1 << 16)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def events_since(self, cursor: Cursor | None) -> CacheEvents:
        """Entry events after `cursor`, or a snapshot of the keys held (see
        actors/event_log.py)."""
        return self.events.since(cursor, lambda: self._entries)

    def contains(self, key: bytes) -> bool:
        return self._live(key) is not None

    def get(self, key: bytes) -> StoredBlock | None:
        entry = self._live(key)
        if entry is None:
            return None
        try:
            block = self._read(key, entry)
        except Unreadable:  # a miss this time; the entry stays
            return None
        if block is None:
            self.remove(key)
            return None
        self._entries.move_to_end(key)
        return block

    def touch(self, key: bytes) -> None:
        """Mark as most recently used."""
        if key in self._entries:
            self._entries.move_to_end(key)

    def keeps(self, key: bytes) -> bool:
        """Whether the tier holds `key`, marked most recently used if so: a block
        stored (or demoted) again that it holds is not written again. An entry
        whose copy went behind its back (another node's eviction on a shared
        path) is dropped, so the caller writes it again."""
        if not self.contains(key):
            return False
        if not self._still_there(key):
            self.remove(key)
            return False
        self.touch(key)
        return True

    def _still_there(self, key: bytes) -> bool:
        return True

    def put(self, block: StoredBlock, keep_evicted: bool = True) -> list[StoredBlock]:
        """Store a block (a key already held is only touched). Returns the entries
        evicted to make room, for demotion (read back only if `keep_evicted`)."""
        if block.key in self._entries:
            self._entries.move_to_end(block.key)
            return []
        entry = self._write(block)
        if entry is None:  # another writer holds it already, or the write failed
            return []
        self._entries[block.key] = entry
        self.num_bytes += entry.num_bytes
        self.events.append(True, block.key)
        return self._evict(keep_evicted)

    def remove(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes
            self.events.append(False, key)
            self._delete(key)

    def expire(self) -> int:
        """Remove every entry past its TTL; how many went."""
        stale = [k for k, e in self._entries.items() if self._is_stale(k, e)]
        for key in stale:
            self.remove(key)
        return len(stale)

    # ---- policy ------------------------------------------------------------------
    def _is_stale(self, key: bytes, entry: _Entry) -> bool:
        ttl = self.policy.ttl_s
        return ttl is not None and key not in self.pinned and self.clock() - entry.created_s > ttl

    def _live(self, key: bytes) -> _Entry | None:
        entry = self._entries.get(key) or self._adopt(key)
        if entry is None:
            return None
        if self._is_stale(key, entry):
            self.remove(key)
            return None
        return entry

    def _evict(self, keep_evicted: bool) -> list[StoredBlock]:
        capacity = self.policy.capacity_bytes
        if capacity is None or self.num_bytes <= self.policy.high_watermark * capacity:
            return []
        target = self.policy.low_watermark * capacity
        evicted = []
        for key in list(self._entries):
            if self.num_bytes <= target:
                break
            if key in self.pinned:
                continue
            block = self._evicted_copy(key) if keep_evicted else None
            self.remove(key)
            if block is not None:
                evicted.append(block)
        return evicted

    def _evicted_copy(self, key: bytes) -> StoredBlock | None:
        """An entry on its way out, read for demotion; none if it cannot be read."""
        try:
            return self._read(key, self._entries[key])
        except Unreadable:
            return None

    # ---- storage ----------------------------------------------------------------
    @abstractmethod
    def _write(self, block: StoredBlock) -> _Entry | None:
        """Store `block`, aged from `_stored_s(block)`."""

    @abstractmethod
    def _read(self, key: bytes, entry: _Entry) -> StoredBlock | None:
        """The block; None if it is gone or corrupt (its entry is then removed).
        Raises `Unreadable` for a copy that cannot be read now."""

    def _delete(self, key: bytes) -> None:
        pass

    def _stored_s(self, block: StoredBlock) -> float:
        """When the store first took `block`: a tier's copy keeps the age of the one it came from."""
        return self.clock() if block.stored_s is None else block.stored_s

    def _adopt(self, key: bytes) -> _Entry | None:
        """An entry another writer added (disk tiers); None in memory."""
        return None


class MemoryTier(Tier):
    name = "host"

    def _write(self, block: StoredBlock) -> _Entry:
        return _Entry(block.num_bytes, self._stored_s(block), replace(block, stored_s=None))

    def _read(self, key: bytes, entry: _Entry) -> StoredBlock:
        return replace(entry.block, stored_s=entry.created_s)


class CorruptEntry(ValueError):
    """A stored file failed its checks (truncated, bit rot, another namespace)."""


class DiskTier(Tier):
    """Files under `root/<namespace hex>/<2 hex>/<key hex>.kv`."""

    def __init__(
        self, name: str, root: str | Path, namespace: bytes, policy: TierPolicy, pinned: set[bytes],
        clock: Callable[[], float],
    ) -> None:
        super().__init__(policy, pinned, clock)
        self.name = name
        self.namespace = namespace
        self.dir = Path(root) / namespace.hex()[:32]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # (a mount gone, a file in the way: the tier starts empty, as `_files` lists none)
            log.warning("KV store %s tier: cannot make %s: %s", self.name, self.dir, exc)
        self.num_corrupt = 0
        self.num_write_errors = 0
        self.num_read_errors = 0  # reads refused for now (`Unreadable`): each a miss, its file kept
        self._index_existing()

    def _path(self, key: bytes) -> Path:
        return self.dir / key.hex()[:2] / f"{key.hex()}.kv"

    def _still_there(self, key: bytes) -> bool:
        """(One stat a block stored again.) Each node indexes the shared path on its
        own: a file another node deleted stays in this node's index until it reads it.
        One the file system cannot stat for now (EIO, ESTALE) is kept, as a read it refuses."""
        try:
            self._path(key).stat()
        except FileNotFoundError:
            return False
        except OSError:
            pass
        return True

    def _is_stale(self, key: bytes, entry: _Entry) -> bool:
        """`Tier._is_stale`, unless the file at the key's path is no longer the one
        indexed: another writer wrote the key again since it expired (on a shared
        path), and this tier's old entry must not delete the new copy. The entry
        then describes the new file, aged by its mtime (stale again if that copy
        is)."""
        if not super()._is_stale(key, entry):
            return False
        now = _file_id(self._path(key))
        if now is None or now == entry.file_id:
            return True
        entry.created_s, entry.file_id = now[1] / 1e9, now
        return super()._is_stale(key, entry)

    def _files(self):
        """(path, key or None for a temporary file, stat) of each file here; a file
        gone meanwhile or not named by a key is skipped, and a folder that cannot
        be listed (the mount went) lists none."""
        try:
            paths = list(self.dir.glob("*/*"))
        except OSError as exc:
            log.warning("KV store %s tier: cannot list %s: %s", self.name, self.dir, exc)
            return
        for path in paths:
            try:
                stat = path.stat()
                key = None if path.name.endswith(".tmp") else bytes.fromhex(path.stem)
            except (ValueError, OSError):
                continue
            yield path, key, stat

    def _index_existing(self) -> None:
        """Restart recovery: index the files already here, oldest first, then trim
        to capacity. Temporary files left by a writer that died mid-write are
        removed (`ABANDONED_TMP_S`)."""
        found = []
        for path, key, stat in self._files():
            if key is None:
                _unlink_if_abandoned(path, stat)
                continue
            found.append((stat.st_mtime, key, stat))
        for mtime, key, stat in sorted(found, key=lambda f: f[:2]):
            self._entries[key] = _Entry(stat.st_size, mtime, file_id=(stat.st_ino, stat.st_mtime_ns))
            self.num_bytes += stat.st_size
            self.events.append(True, key)
        self._evict(keep_evicted=False)

    def _adopt(self, key: bytes) -> _Entry | None:
        try:
            stat = self._path(key).stat()
        except OSError:
            return None
        entry = self._entries[key] = _Entry(stat.st_size, stat.st_mtime, file_id=(stat.st_ino, stat.st_mtime_ns))
        self.num_bytes += entry.num_bytes
        self.events.append(True, key)
        self._evict(keep_evicted=False)  # (the adopted entry, the most recent, goes last)
        return self._entries.get(key)

    def _write(self, block: StoredBlock) -> _Entry | None:
        path = self._path(block.key)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            if path.exists():  # another writer's copy: index it, write nothing
                self._adopt(block.key)
                return None
            path.parent.mkdir(parents=True, exist_ok=True)  # (the tier's folder may have been removed)
            data = encode_entry(self.namespace, block)
            stored_s = self._stored_s(block)
            with open(tmp, "wb") as f:
                f.write(data)
            # Renamed once closed: on NFS a file's data reaches the server at its close, and a
            # reader on another node opening the name before then read it short (and removed it).
            os.replace(tmp, path)
            _age(path, stored_s)  # (once renamed: an old temporary file is an abandoned one)
            written = path.stat()
        except OSError as exc:  # full, read-only, or the mount went: this block is not stored here
            _unlink(tmp)
            self.num_write_errors += 1
            log.warning("KV store %s tier: could not write %s: %s", self.name, path.name, exc)
            return None
        return _Entry(len(data), stored_s, file_id=(written.st_ino, written.st_mtime_ns))

    def expire(self) -> int:
        """`Tier.expire`, and the files here past the TTL that this tier does not
        index (another writer's on a shared path, whose node may be gone), by
        their mtime; abandoned temporary files too. How many entries and files went."""
        removed = super().expire()
        ttl = self.policy.ttl_s
        for path, key, stat in self._files():
            if key is None:
                _unlink_if_abandoned(path, stat)
            elif (ttl is not None and key not in self._entries and key not in self.pinned
                  and self.clock() - stat.st_mtime > ttl):
                _unlink(path)
                removed += 1
        return removed

    def _read(self, key: bytes, entry: _Entry) -> StoredBlock | None:
        try:
            data = self._path(key).read_bytes()
        except _NO_FILE:
            return None
        except OSError as exc:
            self.num_read_errors += 1
            log.warning("KV store %s tier: cannot read %s now, kept: %s", self.name, key.hex(), exc)
            raise Unreadable(key.hex()) from exc
        try:
            return replace(decode_entry(data, self.namespace, key), stored_s=entry.created_s)
        except CorruptEntry:
            self.num_corrupt += 1
            return None

    def _delete(self, key: bytes) -> None:
        _unlink(self._path(key))


def _file_id(path: Path) -> tuple[int, int] | None:
    """The file's (inode, mtime in ns): a rename over it (a new write) changes it."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _age(path: Path, stored_s: float) -> None:
    """A written file's mtime set to its block's age in the store (what a restart
    indexes it by). A mount that refuses to set times (some FUSE, SMB) keeps the
    write's: the block is stored, aged from now after a restart."""
    try:
        os.utime(path, (stored_s, stored_s))
    except OSError as exc:
        log.debug("KV store: cannot set a file's time: %s", exc)


def _unlink_if_abandoned(path: Path, stat: os.stat_result) -> None:
    """Remove a temporary file a writer left behind (`ABANDONED_TMP_S`)."""
    if time.time() - stat.st_mtime > ABANDONED_TMP_S:
        _unlink(path)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


# ---- the file format ---------------------------------------------------------------
def _checksum(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def encode_entry(namespace: bytes, block: StoredBlock) -> bytes:
    """MAGIC, header length (u32 little endian), JSON header, raw KV bytes."""
    kv = block.kv.contiguous()
    payload = kv.view(torch.uint8).numpy().tobytes() if kv.numel() else b""
    header = json.dumps({
        "namespace": namespace.hex(), "key": block.key.hex(), "token_ids": list(block.token_ids),
        "dtype": str(kv.dtype), "shape": list(kv.shape), "checksum": _checksum(payload),
    }).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def decode_entry(data: bytes, namespace: bytes, key: bytes) -> StoredBlock:
    """The block in `data`, or CorruptEntry if anything about it is off."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise CorruptEntry("not a Tandem KV entry")
    (header_len,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:  # (every field read here: a header whose JSON parses may still be damaged)
        header = json.loads(data[start : start + header_len])
        dtype, shape = _DTYPES[header["dtype"]], tuple(int(dim) for dim in header["shape"])
        token_ids = tuple(int(token_id) for token_id in header["token_ids"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):  # (1e400: no int; [[[...]]]: too deep)
        raise CorruptEntry("unreadable header") from None
    if any(dim < 0 for dim in shape):  # (two negative sizes multiply to the payload's)
        raise CorruptEntry("negative size in the header's shape")
    if header.get("namespace") != namespace.hex() or header.get("key") != key.hex():
        raise CorruptEntry("entry of another namespace or key")
    payload = memoryview(data)[start + header_len :]
    expected = torch.empty((), dtype=dtype).element_size()
    for dim in shape:
        expected *= dim
    if len(payload) != expected or _checksum(payload) != header.get("checksum"):
        raise CorruptEntry("payload truncated or checksum mismatch")
    try:  # (an empty payload's shape may be no tensor's: a 0 beside 10**30, or beside 2**62s)
        kv = torch.frombuffer(bytearray(payload), dtype=dtype).view(shape) if expected else torch.empty(shape,
                                                                                                        dtype=dtype)
    except (RuntimeError, TypeError, OverflowError):
        raise CorruptEntry("no tensor has the header's shape") from None
    return StoredBlock(key, token_ids, kv)
