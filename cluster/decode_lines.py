"""How long a request would wait in a decode worker's line for KV blocks.

A decode worker (D) without room for a prompt keeps its handshake waiting
(actors/reservation_queue.py) until running requests finish and free blocks;
only then does the prefill start. Admission adds that wait to the predicted TTFT.
It is predicted from D's stats, read at each refresh by every scheduler replica
alike: the handshakes waiting now, and the reservations D granted per second
while handshakes waited, over the last `WINDOW_S`. D grants a waiting handshake
only as blocks come free, so that rate is how fast D frees room; between
readings without a line it is how fast requests came, which says nothing of it
(a burst onto a D with room read as a slow D: its own requests, predicted
behind each other at the rate the previous burst arrived, were turned away).
First come, first served, so a request joining a line of k waits about
(k + 1) / rate; k counts, besides the line at the last reading, this replica's
requests sent to D since then that its room did not hold
(`PoolView.num_joined_line`: a burst joins the line between two readings). With
room for the prompt once the line has what it asks for (the scheduler's
`PoolView.headroom`), no wait. With no grant while handshakes waited for
`MIN_SPAN_S` or more, D frees nothing now: the wait is the whole handshake wait,
at whose end the request would be refused. Without a line read for `MIN_SPAN_S`
in the window, no prediction (no wait).
"""

from __future__ import annotations

import itertools
from collections import deque

WINDOW_S = 5.0  # the grant rate's window
MIN_SPAN_S = 1.0  # the shortest span of readings the rate is read from


class DecodeLines:
    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s  # the handshake's wait (timeouts.handshake_s)
        # D -> (time, reservations granted so far, handshakes waiting), one per reading
        self._readings: dict[str, deque[tuple[float, int, int]]] = {}

    def observe(self, worker_id: str, num_granted: int, num_waiting: int, now_s: float) -> None:
        readings = self._readings.setdefault(worker_id, deque())
        if readings and num_granted < readings[-1][1]:  # a new worker under the same id: start again
            readings.clear()
        readings.append((now_s, num_granted, num_waiting))
        while len(readings) > 2 and now_s - readings[1][0] >= WINDOW_S:
            readings.popleft()

    def forget(self, worker_id: str) -> None:
        self._readings.pop(worker_id, None)

    def grant_rate(self, worker_id: str) -> float | None:
        """Reservations granted per second between readings of the window that
        found handshakes waiting, to the next reading; None before `MIN_SPAN_S`
        of those."""
        readings = self._readings.get(worker_id, ())
        span_s = granted = 0
        for (start_s, start, waiting), (end_s, end, _) in itertools.pairwise(readings):
            if waiting:
                span_s += end_s - start_s
                granted += end - start
        return granted / span_s if span_s >= MIN_SPAN_S else None

    def read_at_s(self, worker_id: str) -> float | None:
        """When D's stats were last read (monotonic)."""
        readings = self._readings.get(worker_id)
        return readings[-1][0] if readings else None

    def wait_s(self, worker_id: str, has_room: bool, joined: int = 0) -> float:
        """The predicted wait of a request joining D's line now; `has_room`: D's
        free blocks held its prompt at the last reading; `joined`: requests sent
        to D since that reading that joined its line."""
        readings = self._readings.get(worker_id)
        waiting = readings[-1][2] if readings else 0
        if has_room and not waiting:
            return 0.0
        waiting += joined
        rate = self.grant_rate(worker_id)
        if rate is None:
            return 0.0
        if rate <= 0:
            return self.max_wait_s if waiting else 0.0
        return min((waiting + 1) / rate, self.max_wait_s)
