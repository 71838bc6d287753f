"""A consumer's side of the workers' token feeds: one Ray stream a worker, routed to
each request's queue.

    feeds = TokenFeeds()                      # one a process (a scheduler replica)
    feed = feeds.of(worker)                   # subscribes on first use
    with feed.expect(request_id) as events:   # before the request is started
        await worker.submit.remote(request, feed.subscription)
        async for event in events:            # its TokenEvents, up to the finishing one
            ...
    await feeds.close()

A worker sends a batch of events a wake-up for all the requests this process runs
there (`actors.token_streams`), so the per-item cost of a Ray stream is paid once a
step, not once a token and request. The events a request's iterator yields are
those of one Ray stream, so in order. If the worker dies every request waiting on
it ends with `WorkerDied`; if only the feed ends or fails (the worker lives on and
has aborted them), with `FeedLost`, and the next request subscribes again. Closing
the feed (or this process going away) makes the worker abort the requests it still
runs for it; a consumer that stops reading one request early aborts it itself
(`worker.abort`).

A feed serves many requests, so it is subscribed apart from the request that first
needs it (`actors.background`): made in that request's context, it was cancelled
with it, and every other request on it failed.
"""

from __future__ import annotations

import asyncio
import uuid

import ray

from actors.background import background_call, background_task
from actors.messages import GenerateRequest, TokenEvent, WorkerDied, error_message
from actors.token_streams import SubscriptionClosed

_ENDED = object()  # a queue's marker: the feed is gone


class FeedLost(RuntimeError):
    """A live worker's feed ended or failed; its requests on it are gone (the worker
    aborts what a closed feed leaves), the worker is not."""


class RequestEvents:
    """One request's events from a feed; an async iterator that ends after the
    finishing event. Use as a context manager: leaving it stops the routing."""

    def __init__(self, feed: TokenFeed, request_id: str) -> None:
        self._feed = feed
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def __enter__(self) -> RequestEvents:
        return self

    def __exit__(self, *exc) -> None:
        self._feed._queues.pop(self.request_id, None)

    def __aiter__(self) -> RequestEvents:
        return self

    async def __anext__(self) -> TokenEvent:
        """The next event; if more have arrived since, all of them as one (a reader
        that falls behind reads fewer, larger events, and catches up)."""
        if self.finished:
            raise StopAsyncIteration
        event = await self.queue.get()
        while event is not _ENDED and not event.finished and not self.queue.empty():
            later = self.queue.get_nowait()
            if later is _ENDED:  # the last item ever queued: keep it for the next call
                self.queue.put_nowait(later)
                break
            event = _merged(event, later)
        if event is _ENDED:
            raise self._feed.lost(self.request_id)
        self.finished = event.finished
        return event


def _merged(event: TokenEvent, later: TokenEvent) -> TokenEvent:
    logprobs = None if event.logprobs is None and later.logprobs is None else \
        (event.logprobs or []) + (later.logprobs or [])
    return later._replace(token_ids=event.token_ids + later.token_ids, text=event.text + later.text,
                          logprobs=logprobs, prompt_logprobs=event.prompt_logprobs or later.prompt_logprobs)


class TokenFeed:
    """This process's subscription to one worker."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.subscription = uuid.uuid4().hex
        self.error: str | None = None  # why the feed ended, once it has
        self.worker_died = False  # whether it ended because its worker died
        self._queues: dict[str, RequestEvents] = {}
        owner = _current_actor()
        self._stream = background_call(
            lambda: worker.feed.options(num_returns="streaming").remote(self.subscription, owner))
        self._task = background_task(self._route())

    @property
    def alive(self) -> bool:
        return self.error is None

    def expect(self, request_id: str) -> RequestEvents:
        """Route `request_id`'s events here from now on (call before starting it)."""
        if self.error is not None:
            raise self.lost(request_id)
        events = RequestEvents(self, request_id)
        self._queues[request_id] = events
        return events

    async def _route(self) -> None:
        try:
            async for ref in self._stream:
                for row in await ref:  # a TokenEvent as a plain tuple
                    events = self._queues.get(row[0])  # its request id
                    if events is not None:
                        # (by position, its defaults filling the fields a worker of an earlier version
                        # does not send: `_make` refused a row one field short, and every event failed)
                        events.queue.put_nowait(TokenEvent(*row))
            self.error = "the worker's feed ended"
        except ray.exceptions.ActorUnavailableError as exc:  # (not a death: cluster/actor_errors.py)
            self.error = f"the worker is unreachable for now ({type(exc).__name__})"
        except ray.exceptions.RayActorError as exc:
            self.error = f"worker died ({type(exc).__name__})"
            self.worker_died = True
        except asyncio.CancelledError:
            self.error = "the feed was closed"
            raise
        except Exception as exc:  # noqa: BLE001 - any failure ends every request on it, said
            self.error = f"the worker's feed failed: {type(exc).__name__}: {error_message(exc)}"
        finally:
            for events in list(self._queues.values()):
                events.queue.put_nowait(_ENDED)

    def lost(self, request_id: str) -> WorkerDied | FeedLost:
        """What a request waiting on this ended feed raises."""
        return (WorkerDied if self.worker_died else FeedLost)(f"request {request_id}: {self.error}")

    async def close(self) -> None:
        """Unsubscribe: the worker aborts the requests it still runs for this feed."""
        ray.cancel(self._stream)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def _current_actor():
    """This process's actor handle (a Serve replica's), for the worker to watch;
    None in a driver (not an actor)."""
    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None


class TokenFeeds:
    """The feeds of one process, one a worker actor (subscribed on first use, again
    after a feed ended)."""

    def __init__(self) -> None:
        self._feeds: dict[object, TokenFeed] = {}  # by actor handle (equal handles: the same actor)

    def of(self, worker) -> TokenFeed:
        feed = self._feeds.get(worker)
        if feed is None or not feed.alive:
            self._feeds = {w: f for w, f in self._feeds.items() if f.alive}  # dead and removed workers' go
            feed = self._feeds[worker] = TokenFeed(worker)
        return feed

    async def close(self) -> None:
        feeds, self._feeds = list(self._feeds.values()), {}
        await asyncio.gather(*(feed.close() for feed in feeds), return_exceptions=True)


async def colocated_events(feeds: TokenFeeds, worker, request: GenerateRequest):
    """A request's events from a colocated worker, submitted through its feed; one
    not read to its finishing event is aborted there. Raises `WorkerDied` or
    `FeedLost`."""
    feed = feeds.of(worker)
    finished = False
    try:
        with feed.expect(request.request_id) as events:
            try:
                await worker.submit.remote(request, feed.subscription)
            except ray.exceptions.ActorUnavailableError as exc:  # (not a death: cluster/actor_errors.py)
                raise FeedLost(f"request {request.request_id}: the worker is unreachable for now "
                               f"({type(exc).__name__})") from None
            except ray.exceptions.RayActorError as exc:
                raise WorkerDied(f"request {request.request_id}: worker died ({type(exc).__name__})") from None
            except SubscriptionClosed as exc:  # the worker ended this feed before it ended here
                raise FeedLost(f"request {request.request_id}: {error_message(exc)}") from None
            async for event in events:
                finished = event.finished
                yield event
    finally:
        if not finished:  # made outside the request, which Ray may be cancelling with its calls
            await asyncio.gather(background_call(lambda: worker.abort.remote(request.request_id)),
                                 return_exceptions=True)
