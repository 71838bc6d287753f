"""The prefill worker (P): computes a prompt chunk by chunk and streams each chunk's
finished blocks into the blocks its decode worker reserved, while the next chunk
computes.

After every engine step (on the engine thread) the blocks a chunk completed are
pinned (`hold_blocks`) and queued to the pair's sender thread; the trailing partial
block goes with the last chunk, together with the first sampled token, its logprob
and the request's sampling seed, so D samples on exactly as P would have. Blocks
D already holds (`num_cached_blocks` from the handshake) are never sent. The sender
moves one chunk at a time per pair and waits for D's completion ref before the next;
pinned blocks are released once their chunk arrived (or failed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import ray
import torch

from actors.background import background_task, every
from actors.config import EngineConfig
from actors.engine import Engine, ExportedChunk
from actors.kv_channel import GlooPair, GlooSender, KVSender, NcclPair, NcclSender, ObjectStoreSender, StoreSender
from actors.messages import (ChunkMeta, ChunkTiming, GenerateRequest, PrefillResult, RequestAborted, ReservationInfo,
                             TransferFailed)
from actors.request import Request, RequestOutput
from actors.sampling_params import SamplingParams
from actors.worker_base import WorkerBase

log = logging.getLogger(__name__)

# How long, and how many, the ids of requests aborted before their prefill came are
# kept (`PrefillWorker.abort`): the two calls leave a scheduler a moment apart.
EARLY_ABORTS_KEPT_S = 60.0
MAX_EARLY_ABORTS = 10_000


def prefill_params(params: SamplingParams) -> SamplingParams:
    """What P samples a request's first token with: exactly one token, since stop
    conditions are D's business. The stop token ids stay: min_new_tokens bans them
    from the first token too."""
    return dataclasses.replace(params, max_new_tokens=1, stop=(), min_new_tokens=min(params.min_new_tokens, 1))


@dataclass
class _Job:
    """One request's transfer state on P."""

    request: GenerateRequest
    reservation: ReservationInfo
    future: asyncio.Future
    pair: "_PairSender | None" = None  # once the channel to its D is open
    engine_request: Request | None = None
    next_block: int = 0  # blocks before this index are sent (or were on D already)
    next_chunk: int = 0
    failed: bool = False
    started_s: float = field(default_factory=time.time)
    first_token_s: float = 0.0
    num_bytes_sent: int = 0
    num_blocks_sent: int = 0
    timings: list[ChunkTiming] = field(default_factory=list)


@dataclass
class _Transfer:
    job: _Job
    meta: ChunkMeta
    src_block_ids: list[int]
    compute_done_s: float
    computed: torch.cuda.Event | None = None  # CUDA: the runner's step_done of the step that computed them


class _PairSender:
    """A thread that moves chunks to one D, in order, one at a time."""

    def __init__(self, worker: "PrefillWorker", sender: KVSender, decode_handle) -> None:
        self.worker = worker
        self.sender = sender
        self.decode = decode_handle
        self.broken: str | None = None
        self.forgotten = False  # closed by `PrefillWorker.forget_pair` (under its `_pairs_lock`)
        self._closed = False
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"send-{sender.name}", daemon=True)
        self._thread.start()

    def submit(self, transfer: _Transfer) -> None:
        """Queue a chunk (engine thread). On a closed pair it fails at once."""
        with self._lock:
            if not self._closed:
                self._queue.put(transfer)
                return
        self._drop(transfer, self.broken or f"channel {self.sender.name} closed")

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._queue.put(None)
        self.sender.close()

    def _drop(self, transfer: _Transfer, reason: str) -> None:
        self.worker.fail_job(transfer.job, TransferFailed(reason))
        self.worker.release_later(transfer.src_block_ids)

    def _run(self) -> None:
        while (transfer := self._queue.get()) is not None:
            job = transfer.job
            try:
                if self.broken:
                    raise TransferFailed(self.broken)
                if job.failed:
                    continue
                self._send(transfer)
            except Exception as exc:  # D's refusal of this request's chunk leaves the channel in step
                one_request = isinstance(exc, (TransferFailed, RequestAborted))
                broken = isinstance(exc, ray.exceptions.RayActorError) or not one_request
                if broken:
                    self.broken = f"channel {self.sender.name} broken: {type(exc).__name__}: {exc}"
                self.worker.fail_job(job, exc)  # (before the close, which may fail too)
                if broken:
                    try:
                        self.worker.forget_pair(self)
                    except Exception:  # noqa: BLE001 - the thread goes on, to drop what is queued
                        log.exception("closing channel %s failed", self.sender.name)
            finally:
                self.worker.release_later(transfer.src_block_ids)
        # Closed: whatever is still queued will never be sent; unpin it.
        while True:
            try:
                leftover = self._queue.get_nowait()
            except queue.Empty:
                return
            if leftover is not None:
                self._drop(leftover, self.broken or f"channel {self.sender.name} closed")

    def _send(self, transfer: _Transfer) -> None:
        kv = self.worker.engine.runner.read_blocks(transfer.src_block_ids, after=transfer.computed)
        meta = dataclasses.replace(transfer.meta, sent_s=time.time())
        ref = self.decode.receive_chunk.remote(meta, self.sender.name, self.sender.payload(kv))
        self.sender.push(kv)
        arrived_s = ref.future().result(timeout=self.worker.options.transfer_timeout_s)
        acknowledged_s = time.time()
        job = transfer.job
        job.num_blocks_sent += len(transfer.src_block_ids)
        job.num_bytes_sent += kv.numel() * kv.element_size()
        job.timings.append(
            ChunkTiming(meta.chunk_index, len(transfer.src_block_ids), transfer.compute_done_s, meta.sent_s, arrived_s,
                        acknowledged_s))
        if meta.is_last:
            self.worker.complete_job(job)


class PrefillWorker(WorkerBase):
    def _engine_config(self, config: EngineConfig) -> EngineConfig:
        # P samples one token a request and never decodes: no decode graphs to capture, no drafts.
        return dataclasses.replace(config, cuda_graphs=False, num_speculative_tokens=0)

    def _on_started(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._early_aborts: dict[str, tuple[float, str]] = {}  # request id -> (when, why): `abort` before `prefill`
        # (decode id, backend) -> its open channel: a request asking another backend gets its
        # own (the first backend's was used for any, so a benchmark's object_store row ran on gloo)
        self._pairs: dict[tuple[str, str], _PairSender] = {}
        self._pairs_lock = threading.Lock()  # `forget_pair` runs on the sender threads and the watchdog's
        self._opening: dict[tuple[str, str], asyncio.Task] = {}  # the channels being opened, until they are
        background_task(every(self.options.watchdog_interval_s, self._watch_pairs, f"{self.worker_id}'s pair watch"))

    # ---- channels -------------------------------------------------------------
    async def _pair_for(self, reservation: ReservationInfo, decode_handle, backend: str) -> _PairSender:
        """The open channel to the reservation's D, opened on first use. Requests
        that need it meanwhile wait for the same opening, which is no request's
        (`actors.background`): one cancelled midway could leave P and D each half a
        pair."""
        key = (reservation.decode_worker_id, backend)
        pair = self._pairs.get(key)
        if pair is not None and not pair.broken:
            return pair
        opening = self._opening.get(key)
        if opening is None or opening.done():
            opening = self._opening[key] = background_task(self._open_pair(key, decode_handle))
            opening.add_done_callback(  # (kept, it held every pair it opened, and a failed one's frames)
                lambda task: self._opening.pop(key) if self._opening.get(key) is task else None)
        return await asyncio.shield(opening)

    async def _open_pair(self, key: tuple[str, str], decode_handle) -> _PairSender:
        decode_id, backend = key
        name = f"kv-{self.worker_id}-{decode_id}-{uuid.uuid4().hex[:8]}"
        timeout = self.options.transfer_timeout_s
        me = ray.get_runtime_context().current_actor
        if backend == "object_store":
            await decode_handle.open_channel.remote(name, backend, prefill_handle=me)
            sender: KVSender = ObjectStoreSender(name)
        elif backend == "gloo":
            host = ray.util.get_node_ip_address()
            store, port = GlooPair.host_store(host, timeout)
            joined = decode_handle.open_channel.remote(name, backend, host, port, prefill_handle=me)
            link = await self.in_thread(lambda: GlooPair(name, host, port, 0, timeout, store))
            await joined
            sender = GlooSender(name, link)
        elif backend == "store":
            shared = self._shared_path()
            await decode_handle.open_channel.remote(name, backend, prefill_handle=me, shared_path=shared)
            sender = await self.in_thread(lambda: StoreSender(name, shared))  # (file I/O: off the event loop)
        elif backend == "nccl":
            joined = decode_handle.open_channel.remote(name, backend, prefill_handle=me)
            link = await self.in_thread(lambda: NcclPair(name, 0))
            await joined
            sender = NcclSender(name, link)
        else:
            raise ValueError(f"unknown channel backend {backend!r}")
        pair = _PairSender(self, sender, decode_handle)
        self._pairs[key] = pair
        return pair

    def _num_channels(self) -> int:
        return len(self._pairs)

    def _shared_path(self) -> str:
        store = self.options.kv_store
        if store is None or store.shared_path is None:
            raise ValueError("the store channel needs kv_store.shared_path on the prefill worker")
        return store.shared_path

    async def _watch_pairs(self) -> None:
        """Close the channels to Ds that died (drained and gone, say). Only a failed
        send closed one, and a D that got no more sends never failed one: P kept a
        sender thread and, over gloo, a group and its store's sockets for every D it
        had met, growing with the decode pool's churn (a review found it). One
        round (`every` watchdog_interval_s)."""
        for pair in list(self._pairs.values()):
            if await self._is_dead(pair.decode.ping.remote()):
                await self.in_thread(lambda pair=pair: self.forget_pair(pair))

    def forget_pair(self, pair: _PairSender) -> None:
        """Close a pair, broken (from its sender thread) or whose D died (from
        `_watch_pairs`), and D's end of it, which D would otherwise keep (its gloo
        group, its sockets) until P dies. Once: the sender thread and the
        watchdog could both come (a D that died mid-send), and the second's
        KeyError killed the sender thread before it failed its job and unpinned
        what was queued (a review found it). Whether or not a new pair has taken
        its place already: a prefill that found it broken opens one at once, and
        a pair looked up by its place was then never closed, its thread and D's
        end kept (a review found it)."""
        with self._pairs_lock:
            if pair.forgotten:
                return
            pair.forgotten = True
            for key, known in list(self._pairs.items()):
                if known is pair:
                    del self._pairs[key]
        pair.close()
        pair.decode.close_channel.remote(pair.sender.name)  # (a D gone with the pair: its error unread)

    # ---- requests ---------------------------------------------------------------
    async def prefill(
        self, request: GenerateRequest, reservation: ReservationInfo, decode_handle, channel: str = "gloo"
    ) -> PrefillResult:
        """Compute the prompt and move its KV into the reservation. Resolves once the
        last chunk (with the first token) is in D's blocks."""
        self._ensure_started()
        early = self._early_aborts.pop(request.request_id, None)
        if early is not None:
            raise TransferFailed(f"request {request.request_id}: {early[1]} (before its prefill came)")
        if self.abort_marks.ends(request):
            raise RequestAborted(f"request {request.request_id} was aborted by its client before its prefill came")
        job = _Job(request, reservation, self.aio.create_future(), next_block=reservation.num_cached_blocks)
        self._jobs[request.request_id] = job  # before any await: an abort meanwhile finds it, and `add` turns it away
        try:
            job.pair = await self._pair_for(reservation, decode_handle, channel)
            await self.prepare_pattern(request)  # before the params are made again: they compile their pattern
            params = prefill_params(request.params)

            def add(engine: Engine, held: list[int]) -> None:
                if self._jobs.get(request.request_id) is not job or job.failed:  # its caller left, or aborted
                    engine.pool.release(held)
                    return
                engine.add_request(request.prompt_token_ids, params, request.request_id, exports_kv=True,
                                   pinned_block_ids=held)
                job.engine_request = engine.requests[request.request_id]

            await self.import_then(request, add)
            return await job.future
        finally:
            self._jobs.pop(request.request_id, None)

    async def measure_send(
        self, reservation: ReservationInfo, decode_handle, channel: str, blocks_per_chunk: int
    ) -> list[float]:
        """Benchmark hook: send the reservation's blocks (whatever P's cache holds)
        in chunks of `blocks_per_chunk` through the pair's channel; seconds per chunk,
        from the send to D's completion signal. Uses D's real receive path."""
        self._ensure_started()
        pair = await self._pair_for(reservation, decode_handle, channel)
        runner = self.engine.runner

        def send_all() -> list[float]:
            seconds = []
            dst = reservation.block_ids[reservation.num_cached_blocks:]  # (D refuses a chunk onto blocks it holds)
            for index, start in enumerate(range(0, len(dst), blocks_per_chunk)):
                ids = dst[start : start + blocks_per_chunk]
                kv = runner.read_blocks(ids)
                meta = ChunkMeta(reservation.request_id, index, ids, is_last=False)
                began = time.perf_counter()
                ref = decode_handle.receive_chunk.remote(meta, pair.sender.name, pair.sender.payload(kv))
                pair.sender.push(kv)
                ref.future().result(timeout=self.options.transfer_timeout_s)
                seconds.append(time.perf_counter() - began)
            return seconds

        return await self.in_thread(send_all)

    async def holding(self, request_ids: list[str]) -> list[str]:
        """Those of `request_ids` whose prefill P holds (waiting, computing or
        sending): their D keeps their reservations past its TTL."""
        self._ensure_started()
        return [request_id for request_id in request_ids if request_id in self._jobs]

    async def abort_named(self, client_rid: str | None, asked_s: float | None = None) -> list[str]:
        """`/abort_request` on P: stop the named prefills (every one for None);
        each one's caller gets RequestAborted, and ends the request on D as
        aborted too (cluster/pd_request.py). A prefill that comes later, of a
        request that arrived before the abort (`abort_marks`), is turned away so:
        D had reserved it before its part of the abort ended it, and P computed
        the prompt for nobody, the call waiting for it."""
        self._ensure_started()
        self.abort_marks.mark(client_rid, asked_s or time.time())
        jobs = [job for job in self._jobs.values() if client_rid is None or job.request.client_rid == client_rid]
        for job in jobs:
            self.fail_job(job, RequestAborted(f"request {job.request.request_id} was aborted by its client"))
        return [job.request.request_id for job in jobs]

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Stop a request's prefill and transfer. One whose prefill has not come
        yet is kept, and turned away when it does: a scheduler whose client left
        sends both calls a moment apart, and an async actor need not run them in
        the order they were sent (the prompt was computed for nobody, its chunks
        refused by D)."""
        self._ensure_started()
        job = self._jobs.get(request_id)
        if job is not None:
            self.fail_job(job, TransferFailed(f"request {request_id}: {reason}"))
        else:
            now = time.monotonic()
            self._early_aborts[request_id] = (now, reason)
            while self._early_aborts and (len(self._early_aborts) > MAX_EARLY_ABORTS or
                                          next(iter(self._early_aborts.values()))[0] < now - EARLY_ABORTS_KEPT_S):
                del self._early_aborts[next(iter(self._early_aborts))]
        return await super().abort(request_id, reason)

    # ---- engine thread ------------------------------------------------------------
    def _on_step(self, exported: list[ExportedChunk], outputs: list[RequestOutput]) -> None:
        now = time.time()
        firsts = {o.request_id: o for o in outputs}
        for chunk in exported:
            job = self._jobs.get(chunk.request_id)
            if job is None or job.failed:
                continue
            is_last = chunk.end == len(job.request.prompt_token_ids)
            if not is_last and not self.options.pipelined_transfer:
                continue
            block_size = self.engine.pool.block_size
            send_upto = len(chunk.block_ids) if is_last else chunk.end // block_size
            src = chunk.block_ids[job.next_block : send_upto]
            if not src and not is_last:
                continue
            dst = job.reservation.block_ids[job.next_block : send_upto]
            meta = ChunkMeta(job.request.request_id, job.next_chunk, dst, is_last)
            if is_last:
                first = firsts[chunk.request_id]
                meta = dataclasses.replace(
                    meta,
                    first_token_id=first.token_ids[0],
                    first_logprob=first.logprobs[0] if first.logprobs else None,
                    seed=job.engine_request.seed,
                    prompt_logprobs=first.prompt_logprobs,
                    num_cached_tokens=job.engine_request.num_cached_tokens,
                )
                job.first_token_s = now
            self.engine.hold_blocks(src)
            job.next_block = send_upto
            job.next_chunk += 1
            job.pair.submit(_Transfer(job, meta, src, now, self.engine.runner.step_done))

    def _on_engine_error(self, exc: BaseException) -> None:
        """A step failed: besides the engine's requests, every prefill job ends, so
        its caller hears of it instead of waiting for a first token forever."""
        super()._on_engine_error(exc)
        for job in list(self._jobs.values()):
            self.fail_job(job, TransferFailed(
                f"request {job.request.request_id}: prefill on worker {self.worker_id} failed: "
                f"{type(exc).__name__}: {exc}"))

    def release_later(self, block_ids: list[int]) -> None:
        """Unpin blocks once sent (any thread)."""
        if block_ids:
            self.loop.call(lambda e: e.release_blocks(block_ids))

    def complete_job(self, job: _Job) -> None:
        engine_request = job.engine_request
        result = PrefillResult(
            request_id=job.request.request_id,
            first_token_id=engine_request.output_token_ids[0],
            num_prompt_tokens=len(job.request.prompt_token_ids),
            num_computed_tokens=len(job.request.prompt_token_ids) - engine_request.num_cached_tokens,
            num_blocks_sent=job.num_blocks_sent,
            num_bytes_sent=job.num_bytes_sent,
            prefill_start_s=job.started_s,
            first_token_s=job.first_token_s,
            chunks=list(job.timings),
        )
        self.aio.call_soon_threadsafe(_resolve, job.future, result, None)

    def fail_job(self, job: _Job, exc: BaseException) -> None:
        """Stop a request's transfer (any thread): the caller gets TransferFailed,
        or RequestAborted where its client aborted it."""
        if job.failed:
            return
        job.failed = True
        request_id = job.request.request_id
        self.loop.call(lambda e: e.abort(request_id))
        error = exc if isinstance(exc, (TransferFailed, RequestAborted)) else TransferFailed(
            f"request {request_id}: transfer to {job.reservation.decode_worker_id} failed: {type(exc).__name__}: {exc}"
        )
        self.aio.call_soon_threadsafe(_resolve, job.future, None, error)


def _resolve(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
