"""The colocated worker: prefill and decode in one engine (the seeds' "PD fusion").
The baseline every disaggregation claim is measured against."""

from __future__ import annotations

from actors.messages import GenerateRequest
from actors.worker_base import WorkerBase


class ColocatedWorker(WorkerBase):
    async def submit(self, request: GenerateRequest, subscription: str) -> None:
        """Queue a request; its token events, from the first token to the end, go
        to `subscription`'s feed (`WorkerBase.feed`)."""
        self._ensure_started()
        self.streams.open(request.request_id, subscription, request.client_rid)
        try:
            await self.prepare_pattern(request)

            def add(engine, held: list[int]) -> None:
                if self._aborted_on_its_way(request):  # (or its client left: its stream failed by the abort)
                    engine.pool.release(held)
                    self.streams.end_aborted(request.request_id, None)  # (one ended already: as it is)
                else:
                    engine.add_request(request.prompt_token_ids, request.params, request.request_id,
                                       pinned_block_ids=held)

            await self.import_then(request, add)
        except Exception:
            self.streams.forget(request.request_id)
            raise
