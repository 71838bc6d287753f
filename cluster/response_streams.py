"""A request's token events on their way into an HTTP response: the first event
(read before the response starts, so admission errors keep their status) put back
in front, a whole request collected, several requests' events merged as they come
(OpenAI's n and batched prompts). Closing any of these closes the events under it,
which aborts their requests on the workers."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from cluster.api_models import ApiError


async def prepend(first, rest):
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        await rest.aclose()  # closing this closes the request's events (it is aborted)


class Collected(NamedTuple):
    """A whole request's events, read to the end."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list | None
    prompt_logprobs: list | None
    stop_matched: int | str | None = None  # what ended it for "stop" (`TokenEvent.stop_matched`)


async def collect(events) -> Collected:
    text, ids, reason, cached, logprobs, prompt_logprobs, matched = "", [], None, 0, None, None, None
    async for event in events:
        if event.error:
            raise ApiError(503, f"request failed: {event.error}", kind="service_unavailable")
        text += event.text
        ids += event.token_ids
        cached = event.num_cached_tokens
        if event.logprobs is not None:  # extended in place: a copy an event would be quadratic in the length
            logprobs = logprobs if logprobs is not None else []
            logprobs.extend(event.logprobs)
        prompt_logprobs = prompt_logprobs or event.prompt_logprobs
        if event.finished:
            reason, matched = event.finish_reason, event.stop_matched
    return Collected(text, ids, reason, cached, logprobs, prompt_logprobs, matched)


async def merged(streams):
    """(index, event) from several event streams as each arrives; closing this
    closes them all (their requests are aborted)."""
    if len(streams) == 1:
        try:
            async for event in streams[0]:
                yield 0, event
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, stream):
        try:
            async for event in stream:
                await queue.put((index, event))
        except Exception as exc:  # handed to the reader
            await queue.put((index, exc))
        else:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, event = await queue.get()
            if isinstance(event, Exception):
                raise event
            if event is None:
                open_streams -= 1
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
