"""Per-request token streams from the engine thread to the actor's event loop.

The engine thread publishes cumulative `RequestOutput`s; each stream turns them into
`TokenEvent` deltas on an asyncio queue that a streaming actor method drains.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from actors.request import RequestOutput
from actors.messages import TokenEvent


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_tokens_sent: int = 0
    num_chars_sent: int = 0
    closed: bool = False


class TokenStreams:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._streams: dict[str, _Stream] = {}

    def open(self, request_id: str) -> None:
        self._streams[request_id] = _Stream()

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def publish(self, output: RequestOutput) -> None:
        """Called from the engine thread."""
        stream = self._streams.get(output.request_id)
        if stream is None or stream.closed:
            return
        new_ids = output.new_token_ids(stream.num_tokens_sent)
        new_text = output.new_text(stream.num_chars_sent)
        logprobs = output.new_logprobs(stream.num_tokens_sent)
        stream.num_tokens_sent = output.num_tokens
        stream.num_chars_sent = output.num_chars
        stream.closed = output.finished
        event = TokenEvent(
            request_id=output.request_id,
            token_ids=new_ids,
            text=new_text,
            logprobs=logprobs,
            finished=output.finished,
            finish_reason=output.finish_reason.value if output.finish_reason else None,
            time_s=time.time(),
            num_cached_tokens=output.num_cached_tokens,
        )
        self._loop.call_soon_threadsafe(stream.queue.put_nowait, event)

    def fail(self, request_id: str, error: str) -> None:
        """End a stream with an error event (any thread)."""
        stream = self._streams.get(request_id)
        if stream is None or stream.closed:
            return
        stream.closed = True
        event = TokenEvent(request_id, [], "", None, True, "error", time.time(), error=error)
        self._loop.call_soon_threadsafe(stream.queue.put_nowait, event)

    async def events(self, request_id: str):
        """Yield the request's events until the finishing one; then forget it."""
        stream = self._streams[request_id]
        try:
            while True:
                event = await stream.queue.get()
                yield event
                if event.finished:
                    return
        finally:
            self._streams.pop(request_id, None)

    def pending_ids(self) -> list[str]:
        return [rid for rid, s in self._streams.items() if not s.closed]
