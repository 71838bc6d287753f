"""Work a request starts that must outlive it.

Ray cancels the Ray calls a task made when that task is cancelled (`ray.cancel`'s
`recursive`, on by default), and Serve cancels a request's task when its client
disconnects. In an async actor, the calls' parent is read from the asyncio
context the call is made in, so a Ray call made in a request's context, or from an
asyncio task created there (which copies it), is cancelled with that request. What
a scheduler replica keeps for all of its requests (a worker's token feed, the
membership refresh) is started here, in a context of its own: a feed made in a
request's context went with that request, failing every other request on it
(tests/test_token_feeds.py). Checked on this machine: a streaming call made
in a request's context ended in TaskCancelledError when the request was cancelled;
made in a fresh context, or one copied outside any request, it kept running.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def detached_task(coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run `coroutine` as a task whose Ray calls belong to no request."""
    return asyncio.get_running_loop().create_task(coroutine, context=contextvars.Context())


def call_detached(fn: Callable[[], T]) -> T:
    """`fn()`, its Ray calls belonging to no request (e.g. `lambda: actor.m.remote()`)."""
    return contextvars.Context().run(fn)
