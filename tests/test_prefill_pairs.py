"""A prefill worker's channels to its decode workers (actors/prefill_worker.py):
one per D and backend, opened once, forgotten once however many threads find
it broken. Stand-ins for the worker, its D and the channel's sends; no Ray."""

from __future__ import annotations

import asyncio
import queue
import threading
import types

import ray
import torch

from actors.kv_channel import ObjectStoreSender
from actors.messages import ChunkMeta, GenerateRequest, ReservationInfo
from actors.prefill_worker import PrefillWorker, _Job, _PairSender, _Transfer


class _DeadReply:
    def future(self):
        def result(timeout=None):
            raise ray.exceptions.RayActorError()

        return types.SimpleNamespace(result=result)


def _worker():
    worker = object.__new__(PrefillWorker)
    worker._pairs, worker._pairs_lock, worker._opening = {}, threading.Lock(), {}
    worker.options = types.SimpleNamespace(transfer_timeout_s=1.0)
    worker.engine = types.SimpleNamespace(runner=types.SimpleNamespace(
        read_blocks=lambda ids, after=None: torch.zeros(len(ids), 2)))
    worker.failed, worker.released = [], []
    worker.fail_job = lambda job, exc: worker.failed.append(job.request.request_id)
    worker.release_later = lambda ids: worker.released.append(tuple(ids))
    return worker


def _job(request_id: str) -> _Job:
    return _Job(GenerateRequest(request_id, [1, 2, 3], None), ReservationInfo(request_id, "d0", [5, 6], 0), None)


def test_a_pair_forgotten_by_two_threads_at_once_fails_its_jobs_and_unpins_their_blocks():
    """D died mid-send: the sender thread (its reply failed) and the watchdog (its
    ping failed) both forgot the pair. The second's KeyError killed the sender
    thread before it failed its job and unpinned what was queued."""
    worker = _worker()
    decode = types.SimpleNamespace(receive_chunk=types.SimpleNamespace(remote=lambda *args: _DeadReply()),
                                   close_channel=types.SimpleNamespace(remote=lambda *args: None))
    pair = object.__new__(_PairSender)
    pair.worker, pair.sender, pair.decode = worker, ObjectStoreSender("kv-p0-d0-x"), decode
    pair.broken, pair._closed, pair._lock, pair._queue = None, False, threading.Lock(), queue.Queue()
    pair.forgotten = False

    class Racing(dict):
        """The watchdog's forget_pair runs as the sender thread's reads the pairs
        (once: the watchdog's own read must not start another)."""

        raced = False

        def items(self):
            snapshot = list(super().items())
            if not Racing.raced:
                Racing.raced = True
                watchdog = threading.Thread(target=PrefillWorker.forget_pair, args=(worker, pair), daemon=True)
                watchdog.start()
                watchdog.join(0.5)  # (it waits for the lock, where there is one)
            return snapshot

    worker._pairs = Racing({("d0", "gloo"): pair})
    for request_id, block in (("A", 10), ("B", 11)):
        pair._queue.put(_Transfer(_job(request_id), ChunkMeta(request_id, 0, [5], False), [block], 0.0))
    errors = []
    hook, threading.excepthook = threading.excepthook, lambda args: errors.append(args.exc_value)
    try:
        sender = threading.Thread(target=pair._run)
        sender.start()
        sender.join(5)
    finally:
        threading.excepthook = hook
    assert errors == [] and not sender.is_alive()
    assert worker.failed == ["A", "B"] and sorted(worker.released) == [(10,), (11,)] and dict(worker._pairs) == {}


def test_a_broken_pair_replaced_before_its_sender_thread_forgets_it_is_closed_all_the_same():
    """The sender thread marks the pair broken; a prefill meanwhile finds it so and
    opens a new one in its place; then the thread forgets it. Looked up by its
    place, the old pair was never closed: its thread and D's end of it stayed."""
    worker = _worker()
    told_to_close = []
    decode = types.SimpleNamespace(close_channel=types.SimpleNamespace(remote=told_to_close.append))
    old = _PairSender(worker, ObjectStoreSender("kv-p0-d0-old"), decode)
    worker._pairs[("d0", "object_store")] = old

    async def open_pair(key, decode_handle):
        worker._pairs[key] = _PairSender(worker, ObjectStoreSender("kv-p0-d0-new"), decode)
        return worker._pairs[key]

    async def replaced():
        old.broken = "channel kv-p0-d0-old broken"  # (the sender thread, before it forgets the pair)
        return await worker._pair_for(ReservationInfo("r2", "d0", [1], 0), decode, "object_store")

    worker._open_pair = open_pair
    new = asyncio.run(replaced())
    worker.forget_pair(old)
    old._thread.join(5)
    assert new is not old and worker._pairs == {("d0", "object_store"): new}
    assert old._closed and not old._thread.is_alive() and told_to_close == ["kv-p0-d0-old"]
    worker.forget_pair(new)  # (once each)
    worker.forget_pair(new)
    assert worker._pairs == {} and told_to_close == ["kv-p0-d0-old", "kv-p0-d0-new"]


def test_a_channel_is_one_per_decode_worker_and_backend_and_its_opening_is_not_kept():
    """A request asking another backend got the first backend's channel (the
    transfer benchmark's object_store row was measured over gloo); the finished
    openings were kept, each holding the pair it opened."""
    worker = _worker()
    opened = []

    async def open_pair(key, decode_handle):
        await asyncio.sleep(0)
        pair = types.SimpleNamespace(key=key, broken=None)
        worker._pairs[key] = pair
        opened.append(key)
        return pair

    worker._open_pair = open_pair

    async def scenario():
        first = await worker._pair_for(ReservationInfo("r1", "d0", [1], 0), None, "gloo")
        again = await worker._pair_for(ReservationInfo("r2", "d0", [1], 0), None, "gloo")
        other = await worker._pair_for(ReservationInfo("r3", "d0", [1], 0), None, "object_store")
        await asyncio.sleep(0)  # (the openings' done callbacks)
        return first, again, other

    first, again, other = asyncio.run(scenario())
    assert first is again and other is not first and other.key == ("d0", "object_store")
    assert opened == [("d0", "gloo"), ("d0", "object_store")] and worker._opening == {}
