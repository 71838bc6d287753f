"""Waiting for something with a time limit, without losing a cancellation.

Before Python 3.12, `asyncio.wait_for` swallows a cancellation that arrives as the
awaited thing finishes: it wraps the awaitable in a future of its own, and when it
is cancelled while that future is already done it returns the result instead of
raising (CPython issue gh-86296, fixed in 3.12 by building `wait_for` on
`asyncio.timeout`). A request whose client leaves just as its next token event
arrives then keeps running, its workers computing for nobody. `within` waits under
`asyncio.timeout` where it exists (3.11 and later): no extra task, and a cancellation
is never turned into a result. Python 3.10 keeps `wait_for`.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float) -> T:
    """`await awaitable`, raising `TimeoutError` (asyncio's, before 3.11) after
    `seconds`."""
    if sys.version_info < (3, 11):
        return await asyncio.wait_for(awaitable, seconds)
    async with asyncio.timeout(seconds):
        return await awaitable
