"""A decode worker's handshakes waiting for KV blocks, first come, first served.

A handshake asks D to reserve blocks for a prompt. When D's pool cannot hold it
now, the handshake waits here, on D's event loop, until running requests free
enough blocks or its wait is over (then D refuses it). Only the first in line
tries to reserve, again each time blocks may have come free (`room_freed`, which D
calls after a step that finished requests and after an abort), so:
- a long prompt gets its turn among short ones that keep arriving (each of which
  would fit in the few blocks one finished request frees);
- a full D does no work for the waiting handshakes but one try per freed room (a
  try is a call onto the engine thread, between two steps). Waiting callers that
  asked again and again instead (the scheduler did, every 10-200 ms each) slowed
  D's steps, which freed blocks more slowly: at 1.5 times D's rate, D served a
  quarter of what it serves at its rate (docs/benchmarks.md, tandem bench
  handshake).

SGLang's decode side keeps such requests in a queue too (its prealloc queue, which
pre-allocates in arrival order); vLLM's scheduler serves its waiting queue first
come, first served. Strictly first come: a prompt that does not fit yet holds back
smaller ones behind it, which bounds its wait by the time D needs to free its blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

# The first in line also tries again after this long without a wake-up: blocks can
# come free without a finished request (a prefix-cache eviction, a reservation
# expiring), and a missed wake-up must not cost a whole wait.
RETRY_S = 0.25


class Withdrawn(Exception):
    """The request was aborted while it waited: by its client (`aborted`, through
    `/abort_request`), or because its caller went away."""

    def __init__(self, request_id: str, aborted: bool = False) -> None:
        super().__init__(request_id)
        self.aborted = aborted


class ReservationQueue:
    def __init__(self) -> None:
        self._line: dict[str, asyncio.Event] = {}  # request id -> its wake-up, in arrival order
        self._withdrawn: dict[str, bool] = {}  # request id -> whether its client aborted it

    def __len__(self) -> int:
        return len(self._line)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._line

    async def wait_turn(self, request_id: str, attempt: Callable[[], Awaitable[T | None]], wait_s: float) -> T | None:
        """`attempt()`'s first result that is not None, tried when `request_id` is
        first in line; None if `wait_s` passes first. Raises Withdrawn if the
        request is withdrawn, and whatever `attempt` raises."""
        if request_id in self._line:
            raise ValueError(f"request {request_id!r} is already waiting")
        wake = asyncio.Event()
        self._line[request_id] = wake
        deadline = time.monotonic() + wait_s
        try:
            if len(self._line) == 1:
                wake.set()  # nobody ahead: try at once
            loop = asyncio.get_running_loop()
            while True:
                first = next(iter(self._line)) == request_id
                if not wake.is_set():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    # The first in line also wakes every RETRY_S, the others at their time.
                    # (A timer, not asyncio.wait_for: before Python 3.12 that could
                    # swallow a cancellation arriving as the event was set. Nor
                    # actors.deadlines.within, which is wait_for on Python 3.10.)
                    timer = loop.call_later(min(remaining, RETRY_S) if first else remaining, wake.set)
                    try:
                        await wake.wait()
                    finally:
                        timer.cancel()
                wake.clear()
                if request_id in self._withdrawn:
                    raise Withdrawn(request_id, self._withdrawn[request_id])
                if next(iter(self._line)) != request_id:
                    continue
                result = await attempt()
                if request_id in self._withdrawn:  # withdrawn while it tried: raised, granted or not
                    raise Withdrawn(request_id, self._withdrawn[request_id])
                if result is not None:
                    return result
                if time.monotonic() >= deadline:  # (a wake-up set during the try must not extend the wait)
                    return None
        finally:
            del self._line[request_id]
            self._withdrawn.pop(request_id, None)
            self.room_freed()  # the next in line takes its turn

    def room_freed(self) -> None:
        """Blocks may have come free: the first in line tries again."""
        if self._line:
            next(iter(self._line.values())).set()

    def withdraw(self, request_id: str, aborted: bool = False) -> bool:
        """End a waiting request's wait (its `wait_turn` raises Withdrawn, saying
        whether its client `aborted` it); whether it was waiting."""
        wake = self._line.get(request_id)
        if wake is None:
            return False
        self._withdrawn[request_id] = aborted
        wake.set()
        return True
