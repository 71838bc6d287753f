"""A decode worker's line of handshakes waiting for KV blocks
(actors/reservation_queue.py): first come, first served, over a pool of counted
blocks; waits end at their time, on withdrawal, or on an attempt's error, and the
next in line then takes its turn."""

from __future__ import annotations

import asyncio

import pytest

from actors.reservation_queue import ReservationQueue, Withdrawn


class Blocks:
    """A pool of `free` blocks; `attempt(n)` takes n if it can (None if not)."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.tries = 0

    def attempt(self, n: int):
        async def take():
            self.tries += 1
            await asyncio.sleep(0)  # a call onto the engine thread, in D
            if n > self.free:
                return None
            self.free -= n
            return n

        return take


def run(coroutine):
    return asyncio.run(coroutine)


def test_the_first_in_line_is_served_first_even_when_a_later_one_would_fit():
    async def scenario():
        queue, blocks, served = ReservationQueue(), Blocks(free=2), []

        async def wait(name, n):
            await queue.wait_turn(name, blocks.attempt(n), wait_s=10)
            served.append(name)

        long = asyncio.ensure_future(wait("long", 8))
        await asyncio.sleep(0.01)
        short = asyncio.ensure_future(wait("short", 3))
        await asyncio.sleep(0.01)
        blocks.free += 5  # 7 free: the short one would fit, the long one not
        queue.room_freed()
        await asyncio.sleep(0.05)
        assert served == [] and len(queue) == 2 and blocks.free == 7
        blocks.free += 5
        queue.room_freed()
        await asyncio.gather(long, short)
        return served, blocks.free

    assert run(scenario()) == (["long", "short"], 1)


def test_a_request_alone_is_served_at_once_and_one_behind_others_does_not_jump_them():
    async def scenario():
        queue, blocks = ReservationQueue(), Blocks(free=4)
        assert await queue.wait_turn("alone", blocks.attempt(3), wait_s=0) == 3
        waiting = asyncio.ensure_future(queue.wait_turn("big", blocks.attempt(4), wait_s=10))
        await asyncio.sleep(0.01)
        # Without a wait, one that would fit is refused while another waits ahead of it.
        assert await queue.wait_turn("small", blocks.attempt(1), wait_s=0) is None
        assert blocks.free == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert len(queue) == 0
        assert await queue.wait_turn("small", blocks.attempt(1), wait_s=0) == 1

    run(scenario())


def test_a_wait_ends_at_its_time_and_the_next_takes_its_turn():
    async def scenario():
        queue, blocks = ReservationQueue(), Blocks(free=0)
        first = asyncio.ensure_future(queue.wait_turn("first", blocks.attempt(5), wait_s=0.3))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(queue.wait_turn("second", blocks.attempt(1), wait_s=10))
        await asyncio.sleep(0.01)
        blocks.free = 2  # freed without a wake-up: the first in line tries again by itself
        assert await first is None
        assert await asyncio.wait_for(second, 1) == 1
        return blocks.tries

    assert run(scenario()) >= 3  # the first tried at least on entry and after RETRY_S


def test_a_wait_ends_at_its_time_though_room_is_freed_during_each_try():
    """D frees room (`room_freed`) after every step that finished a request; a try
    that spanned such a step came back with its wake-up set and tried again at
    once, never reading its deadline: the first in line held the line past its
    wait for as long as requests kept finishing."""
    async def scenario():
        queue, blocks = ReservationQueue(), Blocks(free=0)
        big = blocks.attempt(5)

        async def attempt_during_steps():
            result = await big()
            await asyncio.sleep(0.01)  # the engine call waits out a step that finished a request
            queue.room_freed()
            return result

        started = asyncio.get_running_loop().time()
        result = await asyncio.wait_for(queue.wait_turn("big", attempt_during_steps, wait_s=0.2), 5)
        return result, asyncio.get_running_loop().time() - started

    result, waited = run(scenario())
    assert result is None and waited < 1.0


def test_a_withdrawn_request_stops_waiting_and_leaves_the_line():
    async def scenario():
        queue, blocks = ReservationQueue(), Blocks(free=0)
        head = asyncio.ensure_future(queue.wait_turn("head", blocks.attempt(1), wait_s=10))
        behind = asyncio.ensure_future(queue.wait_turn("behind", blocks.attempt(1), wait_s=10))
        await asyncio.sleep(0.01)
        assert queue.withdraw("behind") and not queue.withdraw("unknown")
        with pytest.raises(Withdrawn) as behind_withdrawn:
            await behind
        assert "behind" not in queue and "head" in queue
        queue.withdraw("head", aborted=True)  # by its client (/abort_request), which the error says
        with pytest.raises(Withdrawn) as head_withdrawn:
            await head
        assert len(queue) == 0
        assert not behind_withdrawn.value.aborted and head_withdrawn.value.aborted

    run(scenario())


def test_an_attempts_error_reaches_its_caller_and_the_line_moves_on():
    async def scenario():
        queue, blocks = ReservationQueue(), Blocks(free=0)

        async def broken():
            raise ValueError("prompt can never fit")

        head = asyncio.ensure_future(queue.wait_turn("head", blocks.attempt(1), wait_s=10))
        await asyncio.sleep(0.01)
        bad = asyncio.ensure_future(queue.wait_turn("bad", broken, wait_s=10))
        await asyncio.sleep(0.01)
        queue.withdraw("head")  # "bad" is first now and tries
        with pytest.raises(ValueError, match="never fit"):
            await bad
        with pytest.raises(Withdrawn):
            await head
        waiting = asyncio.ensure_future(queue.wait_turn("twice", blocks.attempt(1), wait_s=10))
        await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="already waiting"):
            await queue.wait_turn("twice", blocks.attempt(1), wait_s=10)
        assert "twice" in queue  # the first wait goes on
        waiting.cancel()

    run(scenario())


def test_a_request_withdrawn_while_it_tries_is_withdrawn_though_granted():
    """The withdrawal came while its attempt ran on D's engine thread, which
    granted it: the handshake said reserved for a request already aborted (the
    abort's own engine call, queued after, cancels what it got)."""
    async def scenario():
        queue, blocks = ReservationQueue(), Blocks(free=4)

        async def attempt():
            queue.withdraw("a", aborted=True)  # (as the abort arrives meanwhile)
            return await blocks.attempt(1)()

        with pytest.raises(Withdrawn) as withdrawn:
            await queue.wait_turn("a", attempt, 1.0)
        return withdrawn.value.aborted, len(queue), blocks.free

    assert run(scenario()) == (True, 0, 3)
