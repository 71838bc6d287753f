"""One request through a prefill/decode pair, as the global scheduler drives it.

    call = DisaggregatedCall(prefill, decode, request, channel="gloo", feeds=feeds)
    async for event in call.events():   # TokenEvents from D, first token included
        ...
    call.prefill_result                  # P's timeline: chunks computed, sent, arrived

Steps: listen for the request's events on D's feed (`cluster.token_feeds`; without
`feeds` the call subscribes for itself), handshake (D reserves blocks, naming the
feed, and P so it can watch for P's death; while D has no room for the prompt the
handshake waits in D's line for up to its time: `actors.reservation_queue`), start
P's prefill; P's chunk transfers resolve as the blocks land and the last one
activates the request on D. If P fails
before that, D is told to drop the request and the stream ends with an error event
(after it, D goes on); if the consumer stops early, both sides are cancelled and
free what they hold. A request its client aborts (`/abort_request`, on either
side, at any step) ends with finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import time

import ray

from actors.background import background_call
from actors.deadlines import within
from actors.messages import (GenerateRequest, PrefillResult, RequestAborted, ReservationInfo, ReservationRefused,
                             TokenEvent, WorkerDied, error_message)
from actors.token_streams import SubscriptionClosed
from cluster.token_feeds import FeedLost, TokenFeeds

# What the handshake's call may take beyond the wait D was given: the call's way
# there and back, and D's last try at the end of its wait.
HANDSHAKE_GRACE_S = 5.0


class DisaggregatedCall:
    def __init__(
        self, prefill, decode, request: GenerateRequest, channel: str = "gloo", handshake_timeout_s: float = 10.0,
        feeds: TokenFeeds | None = None, on_reserved=None, on_prefilled=None,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.request = request
        self.channel = channel
        self.handshake_timeout_s = handshake_timeout_s
        self.reservation: ReservationInfo | None = None
        self.prefill_result: PrefillResult | None = None
        self.prefill_error: BaseException | None = None
        self.feeds = feeds
        self.on_reserved = on_reserved  # called once D has reserved the blocks (P starts then)
        self.on_prefilled = on_prefilled  # called with P's PrefillResult once the last chunk landed

    async def events(self):
        request_id = self.request.request_id
        feeds = self.feeds or TokenFeeds()
        feed = feeds.of(self.decode)
        prefill_task = None
        finished = failed = aborted = False
        try:
            with feed.expect(request_id) as stream:
                try:
                    self.reservation = await within(
                        self.decode.reserve.remote(self.request, feed.subscription, self.prefill,
                                                   self.handshake_timeout_s),
                        self.handshake_timeout_s + HANDSHAKE_GRACE_S)
                except asyncio.TimeoutError:
                    raise ReservationRefused(
                        f"the decode worker did not answer the handshake within "
                        f"{self.handshake_timeout_s + HANDSHAKE_GRACE_S:g} s") from None
                except ray.exceptions.ActorUnavailableError:  # (a RayActorError, not a death: cluster/actor_errors.py)
                    raise ReservationRefused("the decode worker is unreachable for now") from None
                except SubscriptionClosed as exc:  # D ended this feed before ours saw it end: a 500 that was no retry
                    raise FeedLost(f"request {request_id}: {error_message(exc)}") from None
                except ray.exceptions.RayActorError as exc:
                    raise WorkerDied(
                        f"request {request_id}: decode worker died before the handshake ({type(exc).__name__})"
                    ) from None
                except RequestAborted:  # by its client (/abort_request): in D's line, or before it came to D
                    finished = True
                    yield TokenEvent(request_id, [], "", None, True, "abort", time.time())
                    return
                if self.on_reserved is not None:
                    self.on_reserved()
                prefill_task = asyncio.ensure_future(self._run_prefill())
                async for event in stream:  # raises WorkerDied if D dies
                    finished, failed = event.finished, event.error is not None
                    aborted = event.finish_reason == "abort"
                    yield event
                if not (failed or aborted):
                    await prefill_task
        finally:
            # Who must stop: D, if the consumer left first; P, if it left first or D
            # ended the request with an error (its reservation expired, say) or as
            # aborted by its client, while P's prefill runs: P would compute it for
            # nobody, the call waiting. (Of a request never sent to P, or one P is
            # done with, P is not told: it would keep the abort for a prefill to
            # come, `PrefillWorker.abort`.)
            stop_prefill = (prefill_task is not None and not prefill_task.done()
                            and (not finished or failed or aborted))
            ends = ([self.prefill] if stop_prefill else []) + ([self.decode] if not finished else [])
            if stop_prefill:
                prefill_task.cancel()
            if ends:  # (made outside the request, which Ray may be cancelling with its calls)
                aborts = background_call(lambda: [w.abort.remote(request_id) for w in ends])
                told = asyncio.gather(*aborts, return_exceptions=True)
                if not finished:  # (a busy P answers after its step: a call D ended does not wait for it)
                    await told
            if self.feeds is None:
                await feeds.close()

    async def _run_prefill(self) -> None:
        try:
            self.prefill_result = await self.prefill.prefill.remote(
                self.request, self.reservation, self.decode, self.channel
            )
        except RequestAborted:  # by its client (/abort_request): ended on D as aborted too, not failed
            await asyncio.gather(self.decode.end_aborted.remote([self.request.request_id]), return_exceptions=True)
            return
        except (ray.exceptions.RayError, RuntimeError) as exc:
            self.prefill_error = exc
            # D would notice a dead P by itself; a failed transfer it learns here.
            # A P that fails after the last chunk landed costs nothing: D goes on.
            reason = f"prefill failed: {error_message(exc)}"
            await asyncio.gather(
                self.decode.abort_transfer.remote(self.request.request_id, reason), return_exceptions=True
            )
            return
        if self.on_prefilled is not None:
            self.on_prefilled(self.prefill_result)
