"""KV transfer channels between one prefill (P) and one decode (D) worker.

One interface, several backends. P holds a `KVSender` per D it has met (made lazily
on first use, closed when either side goes); D holds the matching receiving end.
A transfer is always driven from P's sender thread, one at a time per pair:

    ref = decode.receive_chunk.remote(meta, channel_name, payload)   # D starts receiving
    sender.push(kv)                                                   # bytes move
    ray.get(ref)                                                      # D's blocks hold them

`ref` is the completion signal: it resolves only once the bytes are in D's blocks.
Backends:
- `object_store`: the KV rides in `payload` through Ray's object store, as a host
  copy (a pickled CUDA tensor would come back on the sender's device index); no
  group; works across nodes. `push` is a no-op.
- `gloo`: one `ProcessGroupGloo` per P-D pair over its own TCPStore (Ray's gloo
  backend allows one torch.distributed world per process, so it cannot host a group
  per pair; see RAY_NOTES.md). `push` is a point-to-point send; D's `recv` fills a
  buffer of the shape the chunk metadata implies. Gloo moves host memory: from a GPU
  the chunk goes through a host copy on each side.
- `nccl`: a `ray.util.collective` NCCL group per pair (cupy.cuda.nccl), CUDA tensors.
  Needs two GPUs; never run on a GPU in this project yet. How it is ordered (read
  from Ray 2.60's `nccl_collective_group.py`): Ray runs each send/recv on a stream
  of its own pool, created *blocking*, after an event recorded on cupy's current
  stream, and `record_stream`s the tensor there so its memory outlives the
  transfer. Both ends call from transfer threads, whose current stream (torch's and
  cupy's) is the legacy default stream; a blocking stream synchronises implicitly
  with that one, and with no other. So on P the send starts after the block gather
  (`ModelRunner.read_blocks`, on the legacy stream, itself enqueued after the
  chunk's compute event); on D the block write that follows the receive on the
  legacy stream (`ModelRunner.write_blocks`) waits for it, and returns only once the
  blocks hold the bytes. The engines compute on non-blocking streams of their own
  (`ModelRunner.compute_stream`), which Ray's streams do not wait for nor hold up:
  the transfer of one chunk overlaps the compute of the next on P, and decode steps
  on D. (Before that stream existed the engines computed on the legacy stream too,
  and every step waited for the transfers in flight.) The overlap is built, not yet
  measured: that needs two GPUs (issue: GPU path).
- `store`: through the KV store's shared path (seed 002's store-based transfer): P
  writes each chunk as a checksummed file under `<shared>/transfer/<channel>/`, the
  payload is its name, D reads and deletes it. Needs a mount both nodes see; works
  with no group and across nodes. Files never read (a P that died) are swept when
  a channel opens, an hour old (`sweep_abandoned_chunks`).
"""

from __future__ import annotations

import datetime
import importlib
import re
import shutil
import threading
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from actors.kv_tiers import CorruptEntry, StoredBlock, decode_entry, encode_entry

CHANNEL_BACKENDS = ("gloo", "object_store", "nccl", "store")


class KVSender(ABC):
    """P's end of a channel. `push` runs on P's sender thread only."""

    name: str

    @abstractmethod
    def payload(self, kv: torch.Tensor):
        """What travels with the `receive_chunk` call (None when bytes go by `push`)."""

    @abstractmethod
    def push(self, kv: torch.Tensor) -> None:
        """Move the bytes (after `receive_chunk` was called on D)."""

    def close(self) -> None:
        pass


class KVReceiver(ABC):
    """D's end of a channel. `recv` may block; call it off the event loop."""

    @abstractmethod
    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, payload) -> torch.Tensor:
        ...

    def close(self) -> None:
        pass


# ---- object store -------------------------------------------------------------
class ObjectStoreSender(KVSender):
    def __init__(self, name: str) -> None:
        self.name = name

    def payload(self, kv: torch.Tensor):
        return kv.cpu()  # a CUDA tensor would be rebuilt on the sender's device index

    def push(self, kv: torch.Tensor) -> None:
        return None


class ObjectStoreReceiver(KVReceiver):
    def recv(self, shape, dtype, payload) -> torch.Tensor:
        if not isinstance(payload, torch.Tensor) or tuple(payload.shape) != tuple(shape) or payload.dtype != dtype:
            got = getattr(payload, "shape", type(payload).__name__)
            raise ValueError(f"object_store chunk has shape {got}, expected {tuple(shape)} {dtype}")
        return payload


# ---- the store's shared path ----------------------------------------------------
_TRANSFER_NAMESPACE = b"transfer"
_CHUNK_FILE = re.compile(r"[0-9a-f]{32}\.kv")


# A chunk file this old was never read: D reads each within the transfer's timeout
# (30 s by default), or its request ended. The channels' own `close` removes theirs;
# a P that died (or a D that never read) left them, under no tier's sweep.
ABANDONED_CHUNK_S = 3600.0


def transfer_dir(shared_path: str | Path, channel_name: str) -> Path:
    if not re.fullmatch(r"[\w.-]+", channel_name):
        raise ValueError(f"bad channel name {channel_name!r}")
    return Path(shared_path) / "transfer" / channel_name


def sweep_abandoned_chunks(shared_path: str | Path, older_than_s: float = ABANDONED_CHUNK_S) -> int:
    """Remove every channel's chunk files (and temporaries) older than
    `older_than_s` under the shared path's `transfer/`, and the channel folders
    left empty; how many files went. Errors (another node sweeping too, a mount
    gone) skip what they touch."""
    removed, now = 0, time.time()
    try:
        folders = [f for f in (Path(shared_path) / "transfer").iterdir() if f.is_dir()]
    except OSError:
        return 0
    for folder in folders:
        try:
            idle = now - folder.stat().st_mtime > older_than_s  # (no chunk written or read there since)
            for path in folder.iterdir():
                if now - path.stat().st_mtime > older_than_s:
                    path.unlink(missing_ok=True)
                    removed += 1
            if idle and not any(folder.iterdir()):
                folder.rmdir()
        except OSError:
            continue
    return removed


class StoreSender(KVSender):
    def __init__(self, name: str, shared_path: str | Path) -> None:
        self.name = name
        self.dir = transfer_dir(shared_path, name)
        sweep_abandoned_chunks(shared_path)  # (once a channel: a pair's first meeting)
        self.dir.mkdir(parents=True, exist_ok=True)

    def payload(self, kv: torch.Tensor) -> str:
        key = uuid.uuid4().bytes
        path = self.dir / f"{key.hex()}.kv"
        tmp = path.with_suffix(".tmp")
        self.dir.mkdir(parents=True, exist_ok=True)  # (an idle channel's folder may have been swept)
        tmp.write_bytes(encode_entry(_TRANSFER_NAMESPACE, StoredBlock(key, (), kv.cpu())))
        tmp.replace(path)
        return path.name

    def push(self, kv: torch.Tensor) -> None:
        return None

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)  # chunks never read


class StoreReceiver(KVReceiver):
    def __init__(self, name: str, shared_path: str | Path) -> None:
        self.dir = transfer_dir(shared_path, name)

    def recv(self, shape, dtype, payload) -> torch.Tensor:
        if not isinstance(payload, str) or not _CHUNK_FILE.fullmatch(payload):
            raise ValueError(f"store chunk name {payload!r} is not one this channel writes")
        path = self.dir / payload
        try:
            block = decode_entry(path.read_bytes(), _TRANSFER_NAMESPACE, bytes.fromhex(payload[:-3]))
        except (OSError, CorruptEntry) as exc:
            raise ValueError(f"store chunk {payload}: {exc}") from None
        finally:
            path.unlink(missing_ok=True)
        if tuple(block.kv.shape) != tuple(shape) or block.kv.dtype != dtype:
            raise ValueError(f"store chunk has shape {tuple(block.kv.shape)} {block.kv.dtype}, expected {tuple(shape)} {dtype}")
        return block.kv


# ---- gloo, one process group per pair ------------------------------------------
class GlooPair:
    """A two-rank gloo group of its own: rank 0 is P (hosts the TCPStore), rank 1 D.
    Construction blocks until both ranks joined."""

    def __init__(self, name: str, host: str, port: int, rank: int, timeout_s: float, store=None) -> None:
        from torch._C._distributed_c10d import ProcessGroupGloo
        from torch.distributed import PrefixStore, TCPStore

        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = TCPStore(host, port, 2, False, timeout=timeout)
        self._store = store
        self.rank = rank
        self.group = ProcessGroupGloo(PrefixStore(name, store), rank, 2, timeout)
        self._lock = threading.Lock()

    @staticmethod
    def host_store(host: str, timeout_s: float):
        """P's side: a TCPStore server on a free port; returns (store, port)."""
        from torch.distributed import TCPStore

        store = TCPStore(host, 0, 2, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        return store, store.port

    def send(self, tensor: torch.Tensor) -> None:
        """Gloo moves host memory only: a chunk gathered on a GPU goes through a host
        copy (which also waits for the gather)."""
        with self._lock:
            self.group.send([tensor.cpu().contiguous()], 1 - self.rank, 0).wait()

    def recv(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self.group.recv([tensor], 1 - self.rank, 0).wait()


class GlooSender(KVSender):
    def __init__(self, name: str, pair: GlooPair) -> None:
        self.name = name
        self.pair = pair

    def payload(self, kv: torch.Tensor):
        return None

    def push(self, kv: torch.Tensor) -> None:
        self.pair.send(kv)

    def close(self) -> None:
        self.pair = None


class GlooReceiver(KVReceiver):
    def __init__(self, pair: GlooPair) -> None:
        self.pair = pair

    def recv(self, shape, dtype, payload) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype)
        self.pair.recv(buffer)
        return buffer

    def close(self) -> None:
        self.pair = None


# ---- nccl ------------------------------------------------------------------------
def nccl_available() -> bool:
    try:
        importlib.import_module("cupy")  # importable: its CUDA libraries load
    except ImportError:
        return False
    return torch.cuda.is_available()


class NcclPair:
    """A two-rank `ray.util.collective` NCCL group; call from inside each actor."""

    def __init__(self, name: str, rank: int) -> None:
        if not nccl_available():
            raise RuntimeError("the nccl channel needs CUDA and cupy (pip install 'tandem[gpu]')")
        from ray.util import collective

        self.name = name
        self.rank = rank
        self._collective = collective
        collective.init_collective_group(2, rank, backend="nccl", group_name=name)

    def send(self, tensor: torch.Tensor) -> None:
        """Enqueue the send after the current stream's work (see the module
        docstring); returns before it completes."""
        self._collective.send(tensor.contiguous(), 1 - self.rank, self.name)

    def recv(self, tensor: torch.Tensor) -> None:
        """Enqueue the receive; work enqueued after it on the legacy default stream
        sees the bytes."""
        self._collective.recv(tensor, 1 - self.rank, self.name)

    def close(self) -> None:
        self._collective.destroy_collective_group(self.name)


class NcclSender(GlooSender):
    """Same flow as gloo; the pair is an `NcclPair`, whose group is destroyed on close."""

    def close(self) -> None:
        if self.pair is not None:
            self.pair.close()
        self.pair = None


class NcclReceiver(KVReceiver):
    def __init__(self, pair: NcclPair) -> None:
        self.pair = pair

    def recv(self, shape, dtype, payload) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device="cuda")
        self.pair.recv(buffer)
        return buffer

    def close(self) -> None:
        if self.pair is not None:
            self.pair.close()
        self.pair = None
