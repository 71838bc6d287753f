"""cluster/prompt_thread.py: a large body's prompt work runs on one thread of its
own, in the order it came, while the event loop goes on; a small body's on the
loop; results and errors come back to the awaiting request."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cluster.prompt_thread import BODY_BYTES, INLINE_BODY_BYTES, PromptThread

LARGE = INLINE_BODY_BYTES + 1


def test_the_loop_goes_on_while_a_prompt_is_prepared():
    """The loop itself releases the work it waits on: were the work on the loop,
    it would wait for the loop, forever (here, 5 s, then fail)."""
    prompts = PromptThread()
    started, release = threading.Event(), threading.Event()

    def slow_prompt() -> str:
        started.set()
        assert release.wait(5), "the loop never came round: the work held it"
        return threading.current_thread().name

    async def serve() -> str:
        BODY_BYTES.set(LARGE)  # (as the ingress guard sets it for a request)
        prepared = asyncio.create_task(prompts.run(slow_prompt))
        await asyncio.to_thread(started.wait, 5)
        release.set()  # (the loop, running while the work waits for it)
        return await prepared

    assert asyncio.run(serve()).startswith("tandem-prompt")


def test_prompts_are_prepared_one_at_a_time_in_order_and_errors_reach_their_request():
    prompts = PromptThread()
    done, running = [], []

    def prepare(i: int) -> int:
        running.append(i)
        assert len(running) == 1, running  # never two at once
        done.append(i)
        running.remove(i)
        if i == 3:
            raise ValueError("prompt 3 is past the limit")
        return i * 10

    async def serve():
        BODY_BYTES.set(LARGE)
        return await asyncio.gather(*(prompts.run(prepare, i) for i in range(8)), return_exceptions=True)

    results = asyncio.run(serve())
    assert done == list(range(8))
    assert [r for i, r in enumerate(results) if i != 3] == [0, 10, 20, 40, 50, 60, 70]
    with pytest.raises(ValueError, match="prompt 3"):
        raise results[3]


def test_a_small_body_is_prepared_where_it_is_asked_for():
    """No thread hop for the common request, and no wait behind a large body."""
    prompts = PromptThread()

    async def serve(body_bytes: int) -> str:
        BODY_BYTES.set(body_bytes)
        return await prompts.run(lambda: threading.current_thread().name)

    assert asyncio.run(serve(INLINE_BODY_BYTES)) == threading.current_thread().name
    assert asyncio.run(serve(LARGE)).startswith("tandem-prompt")


def test_a_small_body_whose_prompt_work_is_large_goes_on_the_thread():
    """A Responses request continuing a stored conversation: its 49-byte body
    rendered and tokenized the history (tens of MB at most) on the loop."""
    from cluster.prompt_thread import prompt_work_is_large

    prompts = PromptThread()

    async def serve() -> tuple[str, str]:
        BODY_BYTES.set(49)
        small = await prompts.run(lambda: threading.current_thread().name)
        prompt_work_is_large()
        return small, await prompts.run(lambda: threading.current_thread().name)

    small, history = asyncio.run(serve())
    assert small == threading.current_thread().name and history.startswith("tandem-prompt")
