"""Work a request starts that must outlive it.

Ray cancels the Ray calls a task made when that task is cancelled (`ray.cancel`'s
`recursive`, on by default), and Serve cancels a request's task when its client
disconnects; the scheduler's own cancel of a request reaches the workers' calls
the same way. In an async actor, a call's parent task is read from the asyncio
context the call is made in, so a Ray call made in a request's context, or from
an asyncio task created there (which copies it), is cancelled with that request.

What serves more than the request that happens to start it is started here, in a
context of its own: a scheduler replica's token feed to a worker and its
membership refresh, the report of a dead worker (the pool starts its
replacement), the pool manager's health and control loops, a prefill worker's
channel to a decode worker, a worker's watchdogs, and the abort a request sends
its workers as it ends unfinished. A feed made in a request's context went with
that request, failing every other request on it (tests/test_token_feeds.py).
The abort was made in the request's context once, and in one CI run of that
test a cancelled request's worker went on generating. Whether Ray's cancel of
the request's calls took the abort too was not seen (70 tries here did not show
it), but made here no cancel of the request can reach it. Checked on this
machine: a streaming call made in a request's context ended in
TaskCancelledError when the request was cancelled; made in a fresh context, or
in one copied outside any request, it kept running.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def background_task(coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run `coroutine` as a task whose Ray calls belong to no request."""
    return asyncio.get_running_loop().create_task(coroutine, context=contextvars.Context())


async def run_to_end(coroutine: Coroutine[Any, Any, T]) -> T:
    """`await coroutine`, run in a task of its own (`background_task`) to its end
    even if the caller is cancelled meanwhile (its failure then is nobody's)."""
    task = background_task(coroutine)
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
    return await asyncio.shield(task)


async def every(interval_s: float, one_round: Callable[[], Awaitable[Any]], what: str) -> None:
    """`await one_round()` every `interval_s`, for good (a watchdog's loop). A
    round that raises is logged and the next goes on: a watchdog that died at its
    first error left, for the worker's life, reservations that never expired and
    dead peers never noticed, and nothing said so."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await one_round()
        except Exception:  # noqa: BLE001 - logged; the next round tries again
            log.exception("%s: a round failed; the next goes on", what)


def background_call(fn: Callable[[], T]) -> T:
    """`fn()`, its Ray calls belonging to no request (e.g. `lambda: actor.m.remote()`)."""
    return contextvars.Context().run(fn)
