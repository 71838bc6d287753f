"""Background responses (`background: true`, OpenAI's Responses API): the request
is answered at once with the response `queued`, stored; the replica that took it
serves it in a task of its own and stores the final response, which
`GET /v1/responses/{id}` returns (polling), and `POST /v1/responses/{id}/cancel`
stops it from any replica.

The request is checked before the POST answers (bad input is still a 4xx), then
admitted and served in the task, as the request unstreamed (its answer the
same), and its final response stored through `StoredResponses.finish`; a
refusal at admission (an SLO rejection, say) is the response's failure. Every
`BEAT_S` while it runs,
the replica tells the store it is still at it (`beat`), and the store answers
with the response's status: `cancelled` (a cancel, on any replica) or a response
deleted stops the task, which closes the request's streams and so aborts it on
its workers. A cancel or delete that lands on the replica serving the response
stops it at once (`stop`). A replica that dies stops beating, and after `LOST_AFTER_S` the
store answers the response as failed (cluster/response_store.py), rather than in
progress for ever.

With `stream`, the POST answers with the response's events as the task writes
them (`EventFeed`), and the task keeps them in the store as it goes, every
`FLUSH_S`, the last ones with the final state (`stream_to_store`): a client whose
stream broke, or another, replays them from any replica by `GET
/v1/responses/{id}?stream=true`, after the last sequence number it saw
(`starting_after`). A client that leaves the POST's stream leaves the response
running; a cancel ends the stream without a last event. The last event
(`response.completed`, ...) reaches the POST's stream once the store has kept
the final state: a cancel that landed just before it was kept ended the stream
"completed" while every GET said "cancelled".

The task belongs to no request (actors/background.py): the POST that started it
has returned, and a Ray call made in its context would go with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine

from actors.background import background_task
from cluster.responses_format import is_final_event

BEAT_S = 1.0
FLUSH_S = 0.1  # a streamed background response's events go to the store at most this late

log = logging.getLogger("tandem.background")


class BackgroundResponses:
    """The background responses this replica serves, by id."""

    def __init__(self, stored) -> None:
        self.stored = stored  # cluster/stored_responses.py StoredResponses
        self.running: dict[str, asyncio.Task] = {}  # (held: the loop keeps only weak references to tasks)

    def start(self, response_id: str, answer: Coroutine, on_end: Callable[[], None] | None = None) -> None:
        """Run `answer` (which admits the request, collects its answer and stores
        the final response) to its end, unless the store says to stop; then
        `on_end`, however it ended. A streamed one's feed closes so: stopped before
        its events began (a cancel while it waited for admission or its first
        token), `answer` never reached the code that closes it, and the POST's
        stream stayed open for good."""
        task = background_task(self._run(response_id, answer))
        self.running[response_id] = task

        def ended(_) -> None:
            self.running.pop(response_id, None)
            answer.close()  # (stopped before it ran: never awaited; otherwise done already)
            if on_end is not None:
                on_end()

        task.add_done_callback(ended)

    def stop(self, response_id: str) -> bool:
        """Stop a response this replica serves, now (a cancel or a delete that
        came here: the beat would stop it up to `BEAT_S` later, its tokens still
        streaming meanwhile); whether it served it."""
        task = self.running.get(response_id)
        if task is not None:
            task.cancel()
        return task is not None

    async def _run(self, response_id: str, answer: Coroutine) -> None:
        work = asyncio.ensure_future(answer)
        try:
            while True:  # (the first beat at once: queued -> in_progress)
                status = await self.stored.beat(response_id)
                if work.done():  # (finished meanwhile: its last state stored)
                    break
                if status != "in_progress":  # cancelled, deleted or given up
                    log.info("background response %s stops: %s", response_id, status or "deleted")
                    return
                if (await asyncio.wait({work}, timeout=BEAT_S))[0]:
                    break
            work.result()
        except Exception:  # (nobody else would hear of it; unbeaten, the store gives it up)
            log.exception("background response %s failed", response_id)
        finally:
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work


class EventFeed:
    """A streamed background response's events on this replica, as its task
    writes them: the POST that started it reads them as they come (`read`)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.is_over = False
        self._changed = asyncio.Event()

    def add(self, event: str) -> None:
        self.events.append(event)
        self._changed.set()

    def close(self) -> None:
        self.is_over = True
        self._changed.set()

    async def read(self):
        """Every event, from the first, until the feed is closed."""
        num_read = 0
        while True:
            while num_read < len(self.events):
                num_read += 1
                yield self.events[num_read - 1]
            if self.is_over:
                return
            self._changed.clear()  # (nothing runs between the checks above and the wait)
            await self._changed.wait()


async def stream_to_store(stored, response_id: str, events: AsyncIterator[str], feed: EventFeed,
                          finish: Callable[[list[str], int], Awaitable[bool]]) -> None:
    """`events` to `feed` as they come and to the store (`stored`, the
    replica's StoredResponses) at most `FLUSH_S` later, the first at once, and
    those written before a pause (admission, the first token, a stall) during it,
    not when the next one comes; `finish(last, first)` stores the final state
    with the last ones (`first`: the index of the first of them), and says
    whether the store kept it: the stream's final event (`is_final_event`)
    reaches `feed` only then (not kept: cancelled, or too large), and the store
    only with the final state, not in a flush before it. Stopped
    (cancelled), the events close, which ends the request, and those written are
    stored. Each batch says where it starts in the stream: one whose call was
    stopped may have been stored, and is sent again with those after it; the
    store keeps each event once."""
    unsent = _UnsentEvents(stored, response_id)
    pausing = asyncio.ensure_future(unsent.flush_in_pauses())
    final = None
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                if is_final_event(event):  # (to the store with the final state alone: a replay shows it then)
                    final = event
                    continue
                feed.add(event)
                unsent.events.append(event)
                if time.monotonic() - unsent.flushed_s >= FLUSH_S:
                    await unsent.flush()
        await _stopped(pausing)
        if await finish(unsent.events + ([final] if final else []), unsent.num_sent) and final is not None:
            feed.add(final)
    except asyncio.CancelledError:
        await _stopped(pausing)
        if unsent.events:
            with contextlib.suppress(Exception):
                await unsent.flush()
        raise
    finally:
        feed.close()
        await _stopped(pausing)  # (where the events failed: the request did)


class _UnsentEvents:
    """A streamed response's events written and not yet in the store, and how
    many are (`num_sent`); one flush at a time."""

    def __init__(self, stored, response_id: str) -> None:
        self.stored, self.response_id = stored, response_id
        self.events: list[str] = []
        self.num_sent, self.flushed_s = 0, 0.0
        self._lock = asyncio.Lock()

    async def flush(self) -> None:
        """Those written so far to the store; kept here until it has said so."""
        async with self._lock:
            batch = self.events[:]
            if batch:
                await self.stored.add_events(self.response_id, batch, self.num_sent)
                del self.events[:len(batch)]
                self.num_sent += len(batch)
            self.flushed_s = time.monotonic()

    async def flush_in_pauses(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            if self.events and time.monotonic() - self.flushed_s >= FLUSH_S:
                await self.flush()


async def _stopped(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
