"""How a worker reaches its node's KV store, and writes to it off the critical path.

Under Ray every worker on a node shares one store: a detached actor running
`KVStore`, pinned to the node and named after the node, the KV namespace and the
settings, so workers find it (or create it) by name and it outlives their restarts.
Its host tier is then memory shared by the node's workers. Without Ray (offline use,
unit tests) the store lives in the worker's own process.

`StoreWriter` is the write-through path: the engine hands it copies of the blocks a
step completed; a thread saves them. A full queue drops a batch (counted) rather
than stall the engine: write-through is an optimisation, never a dependency.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Protocol

from actors.kv_store import KVStore, KVStoreSettings, StoreStats
from actors.kv_tiers import StoredBlock

log = logging.getLogger(__name__)


class KVStoreClient(Protocol):
    """What a worker needs of a store. Blocking calls: use them off the event loop."""

    def load(self, keys: Sequence[bytes]) -> list[StoredBlock]: ...

    def save(self, blocks: Sequence[StoredBlock]) -> None: ...

    def stats(self) -> StoreStats: ...


# How long a load waits for the store before the request computes its prompt: the
# store is one serial actor doing file I/O, and a mount that hangs (NFS) held every
# request's import on the node, and a thread of the worker's pool each, for good.
LOAD_TIMEOUT_S = 10.0


class RemoteKVStore:
    """A `KVStoreClient` over the node store actor. Its calls block a thread of an
    async actor (workers call them through `in_thread`): they wait on the reply's
    future, not `ray.get`, which would log Ray's warning about a blocked event loop
    (it cannot tell the loop's thread from another). A load waits at most
    `load_timeout_s` (TimeoutError: the caller computes instead)."""

    def __init__(self, handle, load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
        self.handle = handle
        self.load_timeout_s = load_timeout_s

    def load(self, keys: Sequence[bytes]) -> list[StoredBlock]:
        return self.handle.load.remote(list(keys)).future().result(timeout=self.load_timeout_s)

    def save(self, blocks: Sequence[StoredBlock]) -> None:
        self.handle.save.remote(list(blocks)).future().result()

    def stats(self) -> StoreStats:
        return self.handle.stats.remote().future().result()


STORE_NAMESPACE = "tandem-kv"  # Ray namespace of the nodes' store actors


def node_store_name(node_id: str, namespace: bytes, settings: KVStoreSettings) -> str:
    fingerprint = hashlib.sha256(namespace + repr(settings).encode()).hexdigest()[:12]
    return f"tandem-kv-{node_id[:12]}-{fingerprint}"


def open_kv_store(namespace: bytes, settings: KVStoreSettings) -> KVStoreClient:
    """The node's shared store under Ray (created on first use), else a store in
    this process. A store whose process dies (out of memory, say) is started
    again by Ray on its node, under the same handle: its host tier starts empty,
    its disk and shared tiers are indexed again; calls made meanwhile fail, and the
    workers compute instead of loading (`WorkerBase`), as they do for any store
    error."""
    import ray

    if not ray.is_initialized():
        return KVStore(namespace, settings)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    handle = ray.remote(KVStore).options(
        name=node_store_name(node_id, namespace, settings),
        namespace=STORE_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(namespace, settings)
    return RemoteKVStore(handle)


# The host copies a worker's write-through may hold waiting for a slow store: by
# count alone (64 batches), a 7B model's 128-block steps could hold about 15 GB.
MAX_PENDING_BYTES = 1 << 30


class StoreWriter:
    """A thread saving batches of blocks to a store, in order; at most
    `max_pending_batches` and `max_pending_bytes` of KV wait (a batch past
    either is dropped, counted)."""

    def __init__(self, store: KVStoreClient, max_pending_batches: int = 64,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.store = store
        self.num_saved_blocks = 0
        self.num_dropped_blocks = 0
        self.num_failed_blocks = 0
        self.max_pending_bytes = max_pending_bytes
        self._queue: queue.Queue = queue.Queue(max_pending_batches)
        self._pending = 0  # batches queued or being saved
        self._pending_bytes = 0  # their KV's
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kv-store-writer", daemon=True)
        self._thread.start()

    def submit(self, blocks: list[StoredBlock]) -> None:
        """Queue a batch (engine thread); never blocks."""
        size = _kv_bytes(blocks)
        with self._done:
            if self._pending and self._pending_bytes + size > self.max_pending_bytes:
                self.num_dropped_blocks += len(blocks)
                return
            try:
                self._queue.put_nowait((blocks, size))
                self._pending += 1
                self._pending_bytes += size
            except queue.Full:
                self.num_dropped_blocks += len(blocks)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued batch is saved (tests, benchmarks)."""
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout_s)

    def _run(self) -> None:
        while True:
            blocks, size = self._queue.get()
            try:
                self.store.save(blocks)
                self.num_saved_blocks += len(blocks)
            except Exception as exc:  # a store error must not take the worker down
                self.num_failed_blocks += len(blocks)
                log.warning("KV store write-through failed: %s: %s", type(exc).__name__, exc)
            with self._done:
                self._pending -= 1
                self._pending_bytes -= size
                self._done.notify_all()


def _kv_bytes(blocks: Sequence[StoredBlock]) -> int:
    return sum(block.kv.numel() * block.kv.element_size() for block in blocks)
