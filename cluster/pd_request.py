"""One request through a prefill/decode pair, as the global scheduler drives it.

    call = DisaggregatedCall(prefill, decode, request, channel="gloo")
    async for event in call.events():   # TokenEvents from D, first token included
        ...
    call.prefill_result                  # P's timeline: chunks computed, sent, arrived

Steps: handshake (D reserves blocks, naming P so it can watch for P's death), open
D's token stream, start P's prefill; P's chunk transfers resolve as the blocks land
and the last one activates the request on D. If P fails before that, D is told to
drop the request and the stream ends with an error event (after it, D goes on);
if the consumer stops early, both sides are cancelled and free what they hold.
"""

from __future__ import annotations

import asyncio

import ray

from actors.messages import GenerateRequest, PrefillResult, ReservationInfo, ReservationRefused, TokenEvent, WorkerDied


class DisaggregatedCall:
    def __init__(
        self, prefill, decode, request: GenerateRequest, channel: str = "gloo", handshake_timeout_s: float = 10.0
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.request = request
        self.channel = channel
        self.handshake_timeout_s = handshake_timeout_s
        self.reservation: ReservationInfo | None = None
        self.prefill_result: PrefillResult | None = None
        self.prefill_error: BaseException | None = None

    async def events(self):
        request_id = self.request.request_id
        try:
            self.reservation = await asyncio.wait_for(
                self.decode.reserve.remote(self.request, self.prefill), self.handshake_timeout_s
            )
        except asyncio.TimeoutError:
            await asyncio.gather(self.decode.abort.remote(request_id, "handshake timed out"), return_exceptions=True)
            raise ReservationRefused(f"handshake with the decode worker timed out after {self.handshake_timeout_s}s") from None
        except ray.exceptions.RayActorError as exc:
            raise WorkerDied(f"request {request_id}: decode worker died before the handshake ({type(exc).__name__})") from None
        stream = self.decode.stream.options(num_returns="streaming").remote(request_id)
        prefill_task = asyncio.ensure_future(self._run_prefill())
        finished = False
        try:
            try:
                async for ref in stream:
                    event: TokenEvent = await ref
                    finished = event.finished
                    yield event
                    if finished:
                        break
            except ray.exceptions.RayActorError as exc:
                raise WorkerDied(f"request {request_id}: decode worker died ({type(exc).__name__})") from None
            await prefill_task
        finally:
            if not finished:
                prefill_task.cancel()
                await asyncio.gather(
                    self.prefill.abort.remote(request_id), self.decode.abort.remote(request_id), return_exceptions=True
                )

    async def _run_prefill(self) -> None:
        try:
            self.prefill_result = await self.prefill.prefill.remote(
                self.request, self.reservation, self.decode, self.channel
            )
        except (ray.exceptions.RayError, RuntimeError) as exc:
            self.prefill_error = exc
            # D would notice a dead P by itself; a failed transfer it learns here.
            # A P that fails after the last chunk landed costs nothing: D goes on.
            reason = f"prefill failed: {exc}"
            await asyncio.gather(
                self.decode.abort_transfer.remote(self.request.request_id, reason), return_exceptions=True
            )
