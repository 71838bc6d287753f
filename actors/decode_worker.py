"""The decode worker (D): reserves blocks in a handshake, receives a prompt's KV
chunk by chunk into them, then decodes it in its continuous batch and streams tokens.

Handshake: `reserve` holds blocks for the prompt plus the first output token and
answers with their ids and how many leading ones the prefix cache already filled, or
another reservation is still to fill (P skips those: delta transfer). A request that
borrowed blocks so (actors/arriving_blocks.py) starts decoding once they are written,
its own KV whole: until then it is parked; it is ended, its stream told, if their
owner ends first (`_release_aborted`). While the pool has no room for them, the handshake
waits in line (`actors.reservation_queue`, first come first served) for running
requests to free blocks, up to the caller's `wait_s`; then it raises
`ReservationRefused` so the caller can pick another D. Each `receive_chunk` checks
the chunk's sequence (request id, chunk index, block count, target blocks) and
resolves only once the bytes are in the blocks; the last chunk activates the
request. A reservation is freed when it expires (no chunk for it within
`reservation_ttl_s` of the handshake or of its latest chunk, nor P saying it
still holds the request), when the request is aborted, or soon after its prefill
worker dies (a watchdog pings the P named in the handshake); its leading blocks
whose KV came stay in the prefix cache, for the prompt sent again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

import torch

from actors.background import background_task, every
from actors.block_pool import block_hashes, blocks_to_reserve, num_usable_blocks
from actors.deadlines import within
from actors.engine import Engine
from actors.kv_channel import (
    GlooPair,
    GlooReceiver,
    KVReceiver,
    NcclPair,
    NcclReceiver,
    ObjectStoreReceiver,
    StoreReceiver,
)
from actors.line_asks import LineAsks
from actors.messages import (ChunkMeta, GenerateRequest, RequestAborted, ReservationInfo, ReservationRefused,
                             TransferFailed)
from actors.request import SampledToken
from actors.reservation_queue import ReservationQueue, Withdrawn
from actors.worker_base import WorkerBase


log = logging.getLogger(__name__)

ENDED_ABORTED_KEPT = 4096  # request ids remembered as aborted, for their chunks still on their way


@dataclass
class _Pending:
    """A reservation awaiting its KV."""

    block_ids: list[int]
    prefill_handle: object
    heard_s: float  # made, its latest chunk came, or P said it holds it (time.monotonic): its TTL counts from here
    borrowed: frozenset[int] = frozenset()  # blocks of other reservations it shares (actors/arriving_blocks.py)
    next_chunk: int = 0
    num_in: int = 0  # leading blocks holding their KV, cached or written (but a borrowed one may be in `_unwritten`)


class DecodeWorker(WorkerBase):
    def _on_started(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self._pending_lock = threading.Lock()  # guards _pending, _unwritten, _parked and writes into reserved blocks
        # Blocks a reservation lends (`Reservation.arriving_block_ids`) and has not written yet -> its request id
        self._unwritten: dict[int, str] = {}
        # Requests whose own KV has all come, waiting for blocks they borrowed: (last chunk, borrowed blocks)
        self._parked: dict[str, tuple[ChunkMeta, frozenset[int]]] = {}
        self._receivers: dict[str, KVReceiver] = {}
        self._channel_owners: dict[str, object] = {}  # channel name -> its P's handle
        self.handshakes = ReservationQueue()  # handshakes waiting for room (on the event loop)
        self._line_asks = LineAsks(self._shareable_hashes)  # the blocks the waiting handshakes ask for
        self.num_granted = 0  # reservations granted (the scheduler's line-wait predictions)
        self._ended_aborted: OrderedDict[str, None] = OrderedDict()  # the latest requests their clients aborted here
        background_task(every(self.options.watchdog_interval_s, self._watchdog, f"{self.worker_id}'s watchdog"))

    # ---- handshake --------------------------------------------------------------
    async def reserve(
        self, request: GenerateRequest, subscription: str, prefill_handle=None, wait_s: float = 0.0
    ) -> ReservationInfo:
        """Hold blocks for `request`, waiting in line up to `wait_s` for room; its
        token events will go to `subscription`'s feed (`WorkerBase.feed`)."""
        self._ensure_started()
        request_id = request.request_id
        # Open before the first await: an abort that comes meanwhile (the scheduler's
        # cleanup) ends the stream, and the request is turned away as it would
        # reserve, instead of being granted blocks nobody waits for.
        self.streams.open(request_id, subscription, request.client_rid)
        block_size = self.engine.pool.block_size
        self._line_asks.add(request_id, blocks_to_reserve(len(request.prompt_token_ids), block_size),
                            request.prompt_token_ids)
        try:
            await self.prepare_pattern(request)
            reservation = await self.handshakes.wait_turn(
                request_id, lambda: self._try_reserve(request, prefill_handle), wait_s)
        except Withdrawn as exc:
            self.streams.forget(request_id)
            if exc.aborted:
                raise RequestAborted(f"request {request_id} was aborted by its client") from None
            raise ReservationRefused(f"request {request_id} was aborted while it waited for KV blocks") from None
        except BaseException as exc:  # a refusal, or the call cancelled (its caller left)
            self.streams.forget(request_id)
            if isinstance(exc, asyncio.CancelledError):
                # Cancelled as the engine thread granted it (that call runs to its end):
                # nobody waits for those blocks, which were held until reservation_ttl_s.
                # Queued after it, this frees them; a grant still to come finds the
                # stream forgotten and is turned away (`_aborted_on_its_way`).
                background_task(self._end_failed(request_id, "its caller left"))
            raise
        finally:
            self._line_asks.remove(request_id)
        if reservation is None:
            self.streams.forget(request_id)
            behind = f", {len(self.handshakes)} more handshakes waiting" if len(self.handshakes) else ""
            raise ReservationRefused(
                f"decode worker {self.worker_id} had no room for {len(request.prompt_token_ids)} prompt tokens "
                f"within {wait_s:g} s ({self.engine.pool.num_available} blocks free{behind})"
            )
        self.num_granted += 1
        return ReservationInfo(request.request_id, self.worker_id, reservation.block_ids,
                               reservation.num_cached_blocks, len(reservation.borrowed_block_ids))

    async def _try_reserve(self, request: GenerateRequest, prefill_handle):
        """The engine's reservation for `request` now, then waiting for its KV, or
        None if its pool has no room. Raises RequestAborted if its client aborted
        it on its way (`_aborted_on_its_way`, on the engine thread)."""
        request_id = request.request_id

        def reserve(engine: Engine, held: list[int]):  # (held: the prefix the store had, reused by the reservation)
            if self._aborted_on_its_way(request):
                engine.pool.release(held)
                raise RequestAborted(f"request {request_id} was aborted by its client")
            reservation = engine.reserve(request.prompt_token_ids, request.params, request_id, held)
            if reservation is not None:
                with self._pending_lock:
                    self._pending[request_id] = _Pending(reservation.block_ids, prefill_handle, time.monotonic(),
                                                         frozenset(reservation.borrowed_block_ids),
                                                         num_in=reservation.num_cached_blocks)
                    self._unwritten.update(dict.fromkeys(reservation.arriving_block_ids, request_id))
            return reservation

        return await self.import_then(request, reserve, computes_prompt=False, reserving=True)

    def _on_step(self, exported, outputs) -> None:
        super()._on_step(exported, outputs)
        self._wake_line_if_any_finished(outputs)

    def _wake_line_if_any_finished(self, outputs) -> None:
        """On the engine thread: requests that finished freed their blocks and places; the line tries again."""
        if len(self.handshakes) and any(out.finished for out in outputs):
            self.aio.call_soon_threadsafe(self.handshakes.room_freed)

    async def open_channel(
        self, name: str, backend: str, host: str | None = None, port: int | None = None, prefill_handle=None,
        shared_path: str | None = None,
    ) -> bool:
        """D's end of a new P-D channel (called by P when the pair first meets):
        `host`/`port` of P's TCPStore for gloo, `shared_path` for store. The
        channel is closed when the watchdog finds `prefill_handle` dead."""
        self._ensure_started()
        if prefill_handle is not None:
            self._channel_owners[name] = prefill_handle
        if backend == "object_store":
            self._receivers[name] = ObjectStoreReceiver()
        elif backend == "gloo":
            timeout = self.options.transfer_timeout_s
            pair = await self.in_thread(lambda: GlooPair(name, host, port, 1, timeout))
            self._receivers[name] = GlooReceiver(pair)
        elif backend == "store":
            self._receivers[name] = StoreReceiver(name, shared_path)
        elif backend == "nccl":
            pair = await self.in_thread(lambda: NcclPair(name, 1))
            self._receivers[name] = NcclReceiver(pair)
        else:
            raise ValueError(f"unknown channel backend {backend!r}")
        return True

    def _num_channels(self) -> int:
        return len(self._receivers)

    def _num_waiting_handshakes(self) -> int:
        return len(self.handshakes)

    def _num_waiting_blocks(self) -> int:
        return self._line_asks.total(self.engine.holds_block)

    def _shareable_hashes(self, prompt: list[int]) -> list[bytes]:
        """The hashes of a prompt's blocks a reservation may share (as `Scheduler.usable_hashes`)."""
        block_size = self.engine.pool.block_size
        return block_hashes(prompt[:num_usable_blocks(len(prompt), block_size) * block_size], block_size,
                            self.engine.scheduler.hash_seed)

    def _num_reservations_granted(self) -> int:
        return self.num_granted

    async def close_channel(self, name: str) -> None:
        self._channel_owners.pop(name, None)
        receiver = self._receivers.pop(name, None)
        if receiver is not None:
            receiver.close()

    # ---- transfer ---------------------------------------------------------------
    async def receive_chunk(self, meta: ChunkMeta, channel_name: str, payload=None) -> float:
        """Receive one chunk into the reserved blocks. Resolves (to the arrival wall
        time) once the bytes are in place; raises TransferFailed if they cannot be."""
        self._ensure_started()
        receiver = self._receivers.get(channel_name)
        if receiver is None:
            raise TransferFailed(f"decode worker {self.worker_id} has no channel {channel_name!r}")
        cache = self.engine.runner.kv_cache
        shape = (len(meta.dst_block_ids),) + tuple(cache.shape[1:])
        # Always consume the bytes, even for a request that is gone: the pair's
        # sends and receives must stay paired.
        kv = await self.in_thread(receiver.recv, shape, cache.dtype, payload)
        try:
            await self.in_thread(self._write_chunk, meta, kv)
            arrived_s = time.time()
            if meta.is_last:
                await self._activate(meta)
        except (TransferFailed, RequestAborted):
            raise
        except Exception as exc:  # the bytes were consumed, the channel is in step: fail this request only
            raise TransferFailed(f"request {meta.request_id}: chunk {meta.chunk_index} could not be placed on "
                                 f"{self.worker_id}: {type(exc).__name__}: {exc}") from exc
        finally:  # (blocks this chunk wrote were lent: their borrowers start, whatever became of this request)
            if self._parked:
                await self._activate_unparked()
        return arrived_s

    def _write_chunk(self, meta: ChunkMeta, kv: torch.Tensor) -> None:
        with self._pending_lock:
            pending = self._pending.get(meta.request_id)
            if pending is None and meta.request_id in self._ended_aborted:
                # P sent it before its own part of the abort came (the scheduler asks D first).
                raise RequestAborted(f"request {meta.request_id} was aborted by its client")
            if pending is None:
                raise TransferFailed(f"request {meta.request_id} has no reservation on {self.worker_id}")
            if meta.chunk_index != pending.next_chunk:
                raise TransferFailed(
                    f"request {meta.request_id}: chunk {meta.chunk_index} arrived, expected {pending.next_chunk}"
                )
            # The reservation's next blocks, those after the ones whose KV is in (a cached block
            # overwritten in place was another request's prefix): P sends them in order
            expected = pending.block_ids[pending.num_in : pending.num_in + len(meta.dst_block_ids)]
            if meta.dst_block_ids != expected:
                raise TransferFailed(f"request {meta.request_id}: chunk {meta.chunk_index} targets blocks "
                                     f"{meta.dst_block_ids}, expected {expected} of its reservation")
            if meta.dst_block_ids:
                self.engine.runner.write_blocks(meta.dst_block_ids, kv)
            for block_id in meta.dst_block_ids:
                self._unwritten.pop(block_id, None)
            pending.num_in += len(meta.dst_block_ids)  # (P sends the blocks after the cached ones, in order)
            pending.next_chunk += 1
            pending.heard_s = time.monotonic()  # a transfer under way, however long, is not abandoned

    async def _activate(self, meta: ChunkMeta) -> None:
        """Its last chunk is in: start decoding it, unless blocks it borrowed are still
        to come (then it waits, parked, for their owner's chunks: `_activate_unparked`),
        or it was ended since the chunk was written (its stream has been told)."""
        with self._pending_lock:
            pending = self._pending.pop(meta.request_id, None)
            if pending is None:
                return
            if not pending.borrowed.isdisjoint(self._unwritten):
                self._parked[meta.request_id] = (meta, pending.borrowed)
                return
        await self.call(lambda engine: self._activate_on_engine(engine, meta))

    async def _activate_unparked(self) -> None:
        """Start the parked requests whose borrowed blocks have all been written since
        (after a chunk of another request, whose own result this leaves alone), all
        in one engine call: one call each cost a step each, and the lender's chunk,
        whose reply P's sender waits for before the pair's next chunk, was answered
        9 steps after it landed with 8 borrowers parked on it (1 with none)."""
        with self._pending_lock:
            ready = [meta for meta, borrowed in self._parked.values() if borrowed.isdisjoint(self._unwritten)]
            for meta in ready:
                del self._parked[meta.request_id]
        if ready:
            await self.call(lambda engine: self._activate_all_on_engine(engine, ready))

    def _activate_all_on_engine(self, engine: Engine, ready: list[ChunkMeta]) -> None:
        for meta in ready:
            try:
                self._activate_on_engine(engine, meta)
            except Exception:  # noqa: BLE001 - ended, its stream told (`_activate_on_engine`); its P is done
                log.exception("decode worker %s: request %s could not start", self.worker_id, meta.request_id)

    def _activate_on_engine(self, engine: Engine, meta: ChunkMeta) -> None:
        """Start decoding a request whose last chunk landed, and publish its first
        token (on the engine thread, like every later token: one writer per
        stream); unless an abort or a drop freed its reservation since the chunk
        was written, which its stream has already been told. One the engine
        fails to start is ended here, in the same call (out of `_pending`,
        nothing else would free its blocks), its stream failed; the error is raised."""
        if meta.request_id not in engine.reservations:
            return
        first = SampledToken(meta.first_token_id, meta.first_logprob)
        try:
            output = engine.activate(meta.request_id, first, meta.seed, meta.prompt_logprobs,
                                     meta.num_cached_tokens)
        except Exception as exc:  # (the engine holds it from its reservation's end: this frees its blocks)
            reason = (f"request {meta.request_id} could not start decoding on {self.worker_id}: "
                      f"{type(exc).__name__}: {exc}")
            if self._end_failed_on_engine(engine, meta.request_id, reason):
                self.aio.call_soon_threadsafe(self.handshakes.room_freed)  # (the line tries again at once)
            raise
        self.streams.publish([output])
        self._wake_line_if_any_finished([output])  # (done at its first token: one token asked, or a stop)

    async def _drop(self, request_id: str, reason: str) -> None:
        self.handshakes.withdraw(request_id)
        await super()._drop(request_id, reason)
        self.handshakes.room_freed()

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        self._ensure_started()
        waiting = self.handshakes.withdraw(request_id)
        aborted = await super().abort(request_id, reason)
        self.handshakes.room_freed()
        return aborted or waiting

    async def end_aborted(self, request_ids: list[str]) -> None:
        """As `abort`, but each stream ends as aborted: a handshake waiting in line
        is answered with RequestAborted, a request waiting for its KV is dropped
        (P's next chunk is refused, which ends P's side)."""
        for request_id in request_ids:
            self.handshakes.withdraw(request_id, aborted=True)
            self._ended_aborted[request_id] = None
        while len(self._ended_aborted) > ENDED_ABORTED_KEPT:
            self._ended_aborted.popitem(last=False)
        await super().end_aborted(request_ids)
        self.handshakes.room_freed()

    def _release_aborted(self, request_id: str, also_ending: Collection[str] = ()) -> None:
        """(On the engine thread, before the engine lets the request go.) A
        reservation ended before its KV was whole keeps the leading blocks whose KV
        came: they go into the prefix cache (`Engine.keep_arrived_blocks`), so the
        prompt sent again (a retry, the client's next try) or another sharing it is
        sent only the rest, and later reservations share them as they did while
        they were lent. One that ended before writing blocks it lent ends the
        requests that borrowed them too: their KV will never be whole. Each is
        ended here, in the same engine call (before any can be activated), and its
        stream fails, saying the fault was the lender's: its scheduler tries it
        again (it has no token yet) on the same pair if it likes, the try not counted."""
        with self._pending_lock:
            num_in = self._num_leading_blocks_in(request_id)
            self._pending.pop(request_id, None)
            self._parked.pop(request_id, None)
            lost = {block_id for block_id, owner in self._unwritten.items() if owner == request_id}
            borrowers = [rid for rid, p in self._pending.items() if not p.borrowed.isdisjoint(lost)]
            borrowers += [rid for rid, (_, borrowed) in self._parked.items() if not borrowed.isdisjoint(lost)]
        if num_in:
            self.engine.keep_arrived_blocks(request_id, num_in)
        for borrower in borrowers:  # (each keeps the blocks before the lost ones, still in `_unwritten`)
            self._release_aborted(borrower, also_ending)  # (its own borrowers aborted with it: as aborted too)
            self.engine.cancel_reservation(borrower)
            if borrower in also_ending:  # (aborted with it: failed, an n=4 call's `/abort_request` had its
                self.streams.end_aborted(borrower, None)  # three later choices tried again on another pair)
            elif borrower in self.streams:
                self.streams.fail(borrower, f"request {request_id}, whose KV blocks it shared, ended before they came",
                                  borrowed_kv_lost=True)
        with self._pending_lock:
            for block_id in lost:
                del self._unwritten[block_id]

    def _num_leading_blocks_in(self, request_id: str) -> int:
        """How many of a reservation's leading blocks hold their KV (under
        `_pending_lock`): those cached or written, up to a borrowed one still to
        come; a parked request's all but those. 0 for one decoding or unknown."""
        pending = self._pending.get(request_id)
        if pending is not None:
            block_ids = pending.block_ids[:pending.num_in]
        elif request_id in self._parked and request_id in self.engine.reservations:
            block_ids = self.engine.reservations[request_id].block_table
        else:
            return 0
        return next((index for index, block_id in enumerate(block_ids) if block_id in self._unwritten), len(block_ids))

    async def abort_transfer(self, request_id: str, reason: str) -> bool:
        """Drop a request whose prefill failed, unless its KV has all arrived: once
        the last chunk activated it, P is no longer needed and decoding goes on.
        Returns whether the request was dropped."""
        self._ensure_started()
        return await self._drop_pending(request_id, reason)

    async def _drop_pending(self, request_id: str, reason: str, unheard_since: float | None = None) -> bool:
        """Drop a request still waiting for its KV; whether it was. Checked as the
        drop is queued on the engine thread, with no await between: a request its
        last chunk activated since an earlier look is decoding, and is left alone;
        one whose last chunk comes after finds its reservation gone. With
        `unheard_since` (monotonic), only if nothing came for it since: a chunk
        that landed while the watchdog dropped the expired ones before it (an
        await each) made it live again."""
        with self._pending_lock:
            pending = self._pending.get(request_id)
            waiting = pending is not None and (unheard_since is None or pending.heard_s < unheard_since)
        if waiting:
            await self._drop(request_id, reason)
        return waiting

    # ---- reservations that will never be filled -----------------------------------
    async def _hear_from_prefill(self, pending: list[tuple[str, _Pending]], now: float) -> None:
        """Reservations half through their TTL with nothing heard: their TTL
        counts again from now where their P says it holds the request (its
        prompt waits there behind others, or computes a long first chunk). The
        TTL is for requests nobody will fill (a scheduler gone between the
        handshake and the prefill, a P that lost the request), not for a busy P:
        a prefill that waited there longer than the TTL computed its prompt for a
        reservation D had dropped, and its request failed."""
        stale: dict[object, list[str]] = {}
        for rid, p in pending:
            if p.prefill_handle is not None and now - p.heard_s > self.options.reservation_ttl_s / 2:
                stale.setdefault(p.prefill_handle, []).append(rid)
        answers = await asyncio.gather(  # the Ps at once: the watchdog's expiries and pings wait for this
            *(within(handle.holding.remote(rids), self.options.watchdog_interval_s * 4) for handle, rids in
              stale.items()), return_exceptions=True)
        with self._pending_lock:
            for held in answers:
                if isinstance(held, BaseException):  # (a dead P: the ping tells; a slow one: the TTL runs on)
                    continue
                for rid in held:
                    if rid in self._pending:
                        self._pending[rid].heard_s = now

    async def _watchdog(self) -> None:
        """One round (`every` watchdog_interval_s): drop the reservations past
        their TTL, and those whose P died, closing the channels of a dead P."""
        now = time.monotonic()
        with self._pending_lock:
            pending = list(self._pending.items())
        await self._hear_from_prefill(pending, now)
        expired = [rid for rid, p in pending if now - p.heard_s > self.options.reservation_ttl_s]
        # The snapshot goes stale at each await: a request whose last chunk came in
        # meanwhile is decoding and must not be dropped (_drop_pending checks).
        for rid in expired:
            await self._drop_pending(
                rid, f"reservation expired: no KV came for it within {self.options.reservation_ttl_s:g}s",
                unheard_since=now - self.options.reservation_ttl_s)
        # One ping a P: handles compare by actor (each call brought its own handle
        # object, so grouped by id() a P was pinged once per reservation, in turn)
        handles = {p.prefill_handle for _, p in pending if p.prefill_handle is not None}
        handles.update(self._channel_owners.values())
        for handle in handles:
            if not await self._is_dead(handle.ping.remote()):  # the reservation TTL still bounds a slow one
                continue
            for rid, p in pending:
                if p.prefill_handle == handle:
                    await self._drop_pending(rid, "prefill worker died before the transfer finished")
            for name, owner in list(self._channel_owners.items()):
                if owner == handle:
                    await self.close_channel(name)
