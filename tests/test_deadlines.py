"""`within`: a time limit that never turns a cancellation into a result."""

import asyncio
import sys

import pytest

from actors.deadlines import within


def test_a_cancellation_arriving_as_the_result_does_is_kept():
    async def scenario(wait):
        loop = asyncio.get_running_loop()
        arrived = loop.create_future()
        waiter = asyncio.create_task(wait(arrived, 10))
        await asyncio.sleep(0)  # the waiter waits
        arrived.set_result("token")  # the event arrives...
        waiter.cancel()  # ... and, before the waiter runs again, its client leaves
        try:
            return await waiter
        except asyncio.CancelledError:
            return "cancelled"

    assert asyncio.run(scenario(within)) == "cancelled"
    if sys.version_info < (3, 12):  # what asyncio.wait_for did here
        assert asyncio.run(scenario(asyncio.wait_for)) == "token"


def test_a_result_in_time_is_returned_and_a_late_one_times_out():
    async def scenario():
        assert await within(asyncio.sleep(0.01, result=7), 5) == 7
        with pytest.raises(asyncio.TimeoutError):
            await within(asyncio.sleep(5), 0.05)

    asyncio.run(scenario())
