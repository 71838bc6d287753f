"""The aborts a worker was asked for (`/abort_request`), kept a while, so that a
request still on its way when its abort came does not start.

An abort ends the requests a worker holds (their streams, `WorkerBase.abort_named`);
a request the scheduler had admitted but not yet handed over (tokenized, routed,
its handshake in flight to D) is not there to end. Each request carries when the
scheduler replica took it (`GenerateRequest.arrived_s`), each abort when it was
asked; a decode worker about to reserve a request's blocks, and a colocated one
about to add it, ends it instead if an abort of its name (or of every request)
was asked after it arrived. A request sent after the abort, even one reusing
the name, is not ended (retrying with the same rid works). The times come from
different hosts' clocks; skew between them only moves the line by that much.
A prefill worker turns away a prefill so marked (D reserved it, and then its
part of the abort ended it); it also keeps the ids of requests its scheduler
abandoned before their prefill came (`PrefillWorker.abort`).
"""

from __future__ import annotations

import time

from actors.messages import GenerateRequest

# How long an abort is kept: longer than a request can be on its way to a worker
# (admission, then a handshake's wait in D's line, at most timeouts.handshake_s).
KEEP_S = 300.0


class AbortMarks:
    def __init__(self) -> None:
        self._asked: dict[str | None, float] = {}  # client rid (None: every request) -> latest abort's wall time

    def mark(self, client_rid: str | None, asked_s: float) -> None:
        """An abort of `client_rid`'s requests (every one for None), asked at `asked_s`."""
        self._asked[client_rid] = max(asked_s, self._asked.get(client_rid, 0.0))
        if len(self._asked) > 64:  # forget old ones now and then (read on the engine thread: a new dict)
            since = time.time() - KEEP_S
            self._asked = {rid: at for rid, at in self._asked.items() if at >= since}

    def ends(self, request: GenerateRequest) -> bool:
        """Whether an abort asked after `request` arrived names it."""
        if not request.arrived_s:
            return False
        asked = self._asked.get(None, 0.0)
        if request.client_rid:
            asked = max(asked, self._asked.get(request.client_rid, 0.0))
        return request.arrived_s <= asked
