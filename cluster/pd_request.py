"""One request through a prefill/decode pair, as the global scheduler drives it.

    call = DisaggregatedCall(prefill, decode, request, channel="gloo", feeds=feeds)
    async for event in call.events():   # TokenEvents from D, first token included
        ...
    call.prefill_result                  # P's timeline: chunks computed, sent, arrived

Steps: listen for the request's events on D's feed (`cluster.token_feeds`; without
`feeds` the call subscribes for itself), handshake (D reserves blocks, naming the
feed, and P so it can watch for P's death; while D has no room for the prompt it is
asked again until the handshake's time is up), start P's prefill; P's chunk transfers
resolve as the blocks land and the last one activates the request on D. If P fails
before that, D is told to drop the request and the stream ends with an error event
(after it, D goes on); if the consumer stops early, both sides are cancelled and
free what they hold.
"""

from __future__ import annotations

import asyncio

import ray

from actors.messages import (GenerateRequest, PrefillResult, ReservationInfo, ReservationRefused, WorkerDied,
                             error_message)
from cluster.token_feeds import TokenFeeds

# How often a handshake asks a full decode worker again: soon at first, then less
# often, so many waiting requests do not keep D's event loop busy.
RESERVE_RETRY_S = (0.01, 0.2)  # first wait, longest wait (doubling in between)


class DisaggregatedCall:
    def __init__(
        self, prefill, decode, request: GenerateRequest, channel: str = "gloo", handshake_timeout_s: float = 10.0,
        feeds: TokenFeeds | None = None,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.request = request
        self.channel = channel
        self.handshake_timeout_s = handshake_timeout_s
        self.reservation: ReservationInfo | None = None
        self.prefill_result: PrefillResult | None = None
        self.prefill_error: BaseException | None = None
        self._refusal = ""  # D's last "no room now", while the handshake waits
        self.feeds = feeds

    async def events(self):
        request_id = self.request.request_id
        feeds = self.feeds or TokenFeeds()
        feed = feeds.of(self.decode)
        prefill_task = None
        finished = False
        try:
            with feed.expect(request_id) as stream:
                try:
                    self.reservation = await asyncio.wait_for(self._reserve(feed.subscription),
                                                              self.handshake_timeout_s)
                except asyncio.TimeoutError:
                    raise ReservationRefused(
                        f"handshake with the decode worker timed out after {self.handshake_timeout_s}s"
                        + (f" ({self._refusal})" if self._refusal else "")) from None
                except ray.exceptions.RayActorError as exc:
                    raise WorkerDied(
                        f"request {request_id}: decode worker died before the handshake ({type(exc).__name__})"
                    ) from None
                prefill_task = asyncio.ensure_future(self._run_prefill())
                async for event in stream:  # raises WorkerDied if D dies
                    finished = event.finished
                    yield event
                await prefill_task
        finally:
            if not finished:
                if prefill_task is not None:
                    prefill_task.cancel()
                await asyncio.gather(
                    self.prefill.abort.remote(request_id), self.decode.abort.remote(request_id), return_exceptions=True
                )
            if self.feeds is None:
                await feeds.close()

    async def _reserve(self, subscription: str) -> ReservationInfo:
        """D's reservation. A D whose KV blocks are all taken now (ReservationRefused)
        is asked again until the caller's timeout, so a burst waits for running
        requests to free blocks instead of failing (SGLang's decode side keeps such
        requests in a queue; nothing is computed meanwhile: P starts after). A
        prompt that could never fit is refused at once (InvalidRequestError)."""
        wait_s, longest_s = RESERVE_RETRY_S
        while True:
            try:
                return await self.decode.reserve.remote(self.request, subscription, self.prefill)
            except ReservationRefused as exc:
                self._refusal = error_message(exc)
                await asyncio.sleep(wait_s)
                wait_s = min(2 * wait_s, longest_s)

    async def _run_prefill(self) -> None:
        try:
            self.prefill_result = await self.prefill.prefill.remote(
                self.request, self.reservation, self.decode, self.channel
            )
        except (ray.exceptions.RayError, RuntimeError) as exc:
            self.prefill_error = exc
            # D would notice a dead P by itself; a failed transfer it learns here.
            # A P that fails after the last chunk landed costs nothing: D goes on.
            reason = f"prefill failed: {error_message(exc)}"
            await asyncio.gather(
                self.decode.abort_transfer.remote(self.request.request_id, reason), return_exceptions=True
            )
