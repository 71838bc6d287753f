"""Token events from the engine thread to a worker's consumers, one batch a wake-up.

A consumer (a scheduler replica, a test, a benchmark) subscribes once to a worker
(`WorkerBase.feed`) and names its subscription when it starts a request there; every
event of the requests it started comes back on that one Ray stream, as lists. Not a
Ray stream a request: a streamed Ray item costs about half a millisecond of CPU
between the two processes (a one-off probe: an async actor yielding 64 x 200 small
events on 64 streams took 7.0 s, the same events as 200 lists of 64 on one stream
0.27 s), so per-request streams cost a decode worker at batch 64 more than its step
(docs/benchmarks.md, `tandem bench delivery`). SGLang (scheduler to detokenizer) and
vLLM v1 (engine core to front end) likewise send one message a step for the batch.

The engine thread publishes a step's `RequestOutput`s at once: they become
`TokenEvent` deltas, grouped by subscription, handed to the event loop in one
`call_soon_threadsafe` (a wake-up of the loop is a write to its self-pipe, so one a
step, not one a token). A subscription whose consumer is slow gathers events until
it reads: later batches are larger, never more of them.

`stream_interval` (SGLang's setting of that name): a request's event waits until it
has that many new tokens (its first and its last go at once). Every hop after the
worker (Ray, the scheduler replica, Serve's proxy, the client) costs CPU an event,
so fewer, larger events deliver more tokens a second from the same cores, at the
price of coarser streaming (docs/benchmarks.md, `tandem bench delivery`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from actors.messages import TokenEvent
from actors.request import RequestOutput


@dataclass
class _Stream:
    subscription: str
    client_rid: str = ""  # the client's name for the request (`GenerateRequest.client_rid`)
    num_tokens_sent: int = 0
    num_chars_sent: int = 0
    closed: bool = False


@dataclass
class _Subscription:
    events: list[TokenEvent] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    ended: bool = False  # its consumer is gone: the feed returns


class SubscriptionClosed(RuntimeError):
    """A request named a subscription whose consumer has gone."""


class TokenStreams:
    def __init__(self, loop: asyncio.AbstractEventLoop, stream_interval: int = 1) -> None:
        self._loop = loop
        self.stream_interval = stream_interval
        self._streams: dict[str, _Stream] = {}
        self._subscriptions: dict[str, _Subscription] = {}
        self._closed_subscriptions: set[str] = set()

    # ---- on the event loop ----------------------------------------------------
    def open(self, request_id: str, subscription: str, client_rid: str = "") -> None:
        """Deliver `request_id`'s events to `subscription` (opened here if its feed
        has not started yet)."""
        self._subscription(subscription)
        self._streams[request_id] = _Stream(subscription, client_rid)

    def _subscription(self, name: str) -> _Subscription:
        """A subscription, made on first use (a request may name it before its feed
        starts); a closed one is refused."""
        if name in self._closed_subscriptions:
            raise SubscriptionClosed(f"subscription {name!r} is closed: its consumer went away")
        return self._subscriptions.setdefault(name, _Subscription())

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def is_open(self, request_id: str) -> bool:
        """Whether `request_id` streams here and has not ended."""
        stream = self._streams.get(request_id)
        return stream is not None and not stream.closed

    def named(self, client_rid: str | None) -> list[str]:
        """The requests still streaming that the client named `client_rid`; every
        one still streaming for None."""
        return [rid for rid, s in self._streams.items()
                if not s.closed and (client_rid is None or s.client_rid == client_rid)]

    async def batches(self, subscription: str):
        """The subscription's events, a list each time there are some, as plain
        tuples (`TokenEvent(*row)` rebuilds them), until the consumer cancels or
        `end` is called; a request's stream is forgotten after its last event."""
        sub = self._subscription(subscription)
        while True:
            await sub.ready.wait()
            sub.ready.clear()
            if sub.ended:
                return
            batch, sub.events = sub.events, []
            for event in batch:
                if event.finished:
                    self._streams.pop(event.request_id, None)
            yield [tuple(event) for event in batch]  # plain tuples pickle fast (`TokenEvent`)

    def end(self, subscription: str) -> None:
        """Make the subscription's `batches` return (its consumer died without
        cancelling it)."""
        sub = self._subscriptions.get(subscription)
        if sub is not None:
            sub.ended = True
            sub.ready.set()

    def close(self, subscription: str) -> list[str]:
        """End a subscription (its consumer went away) and forget its streams,
        those ended whose last event it never read too. Returns its requests that
        had not finished: the caller aborts them."""
        self._closed_subscriptions.add(subscription)
        self._subscriptions.pop(subscription, None)
        gone = [(rid, s.closed) for rid, s in self._streams.items() if s.subscription == subscription]
        for rid, _ in gone:
            self._streams.pop(rid, None)
        return [rid for rid, closed in gone if not closed]

    def _deliver(self, events: list[TokenEvent], subscriptions: list[str]) -> None:
        for event, name in zip(events, subscriptions):
            sub = self._subscriptions.get(name)
            if sub is not None:
                sub.events.append(event)
                sub.ready.set()

    # ---- on any thread (the engine's, mostly) ---------------------------------------
    def publish(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, as each request's new tokens and text since its last
        event; one hand-over to the event loop."""
        events, subscriptions = [], []
        now = time.time()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None or stream.closed:
                continue
            start = stream.num_tokens_sent
            if start and not output.finished and output.num_tokens - start < self.stream_interval:
                continue
            events.append(TokenEvent(  # by position: by keyword costs twice as much (1.1 us against 0.6)
                output.request_id,
                output.new_token_ids(start),
                output.new_text(stream.num_chars_sent),
                output.new_logprobs(start),
                output.finished,
                output.finish_reason.value if output.finish_reason else None,
                now,
                output.num_cached_tokens,
                None,  # error
                output.prompt_logprobs if not start else None,
                False,  # borrowed_kv_lost
                output.stop_matched,
            ))
            subscriptions.append(stream.subscription)
            stream.num_tokens_sent = output.num_tokens
            stream.num_chars_sent = output.num_chars
            stream.closed = output.finished
        if events:
            self._loop.call_soon_threadsafe(self._deliver, events, subscriptions)

    def fail(self, request_id: str, error: str, borrowed_kv_lost: bool = False) -> None:
        """End a request's stream with an error event (`TokenEvent.borrowed_kv_lost`:
        the error was the request's that lent it KV blocks)."""
        self._end(request_id, "error", error, borrowed_kv_lost)

    def end_aborted(self, request_id: str, output: RequestOutput | None) -> None:
        """End a request's stream as aborted: with its aborted `output` (the
        tokens it made since its last event, finish_reason "abort"), or, for a
        request that had not started decoding here, an empty abort event."""
        if output is not None:
            self.publish([output])
        else:
            self._end(request_id, "abort", None)

    def _end(self, request_id: str, reason: str, error: str | None, borrowed_kv_lost: bool = False) -> None:
        stream = self._streams.get(request_id)
        if stream is None or stream.closed:
            return
        stream.closed = True
        event = TokenEvent(request_id, [], "", None, True, reason, time.time(), error=error,
                           borrowed_kv_lost=borrowed_kv_lost)
        self._loop.call_soon_threadsafe(self._deliver, [event], [stream.subscription])
