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
its workers. A replica that dies stops beating, and after `LOST_AFTER_S` the
store answers the response as failed (cluster/response_store.py), rather than in
progress for ever.

The task belongs to no request (actors/background.py): the POST that started it
has returned, and a Ray call made in its context would go with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine

from actors.background import background_task

BEAT_S = 1.0

log = logging.getLogger("tandem.background")


class BackgroundResponses:
    """The background responses this replica serves, by id."""

    def __init__(self, stored) -> None:
        self.stored = stored  # cluster/stored_responses.py StoredResponses
        self.running: dict[str, asyncio.Task] = {}  # (held: the loop keeps only weak references to tasks)

    def start(self, response_id: str, answer: Coroutine) -> None:
        """Run `answer` (which admits the request, collects its answer and stores
        the final response) to its end, unless the store says to stop."""
        task = background_task(self._run(response_id, answer))
        self.running[response_id] = task
        task.add_done_callback(lambda _: self.running.pop(response_id, None))

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
