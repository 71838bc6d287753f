"""How long a request would wait in a decode worker's line for KV blocks.

A decode worker (D) without room for a prompt keeps its handshake waiting
(actors/reservation_queue.py) until running requests finish and free blocks;
only then does the prefill start. Admission adds that wait to the predicted TTFT.
It is predicted from D's stats, read at each refresh by every scheduler replica
alike: the handshakes waiting now, and the reservations D granted per second over
the last `WINDOW_S` (while D is full, as many as requests finished). First come,
first served, so a request joining a line of k waits about (k + 1) / rate; k
counts, besides the line at the last reading, this replica's requests sent to D
since then and not yet through its handshake (a burst joins the line between two
readings). With room for the prompt once the line has what it asks for (the
scheduler's `PoolView.headroom`), no wait. With no grant in the window while
handshakes wait, D frees nothing now: the wait is the whole handshake wait, at
whose end the request would be refused. Without two readings a second apart, no
prediction (no wait).
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 5.0  # the grant rate's window
MIN_SPAN_S = 1.0  # the shortest span of readings the rate is read from


class DecodeLines:
    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s  # the handshake's wait (timeouts.handshake_s)
        self._readings: dict[str, deque[tuple[float, int]]] = {}  # D -> (time, reservations granted so far)
        self._waiting: dict[str, int] = {}  # D -> handshakes waiting at the last reading

    def observe(self, worker_id: str, num_granted: int, num_waiting: int, now_s: float) -> None:
        readings = self._readings.setdefault(worker_id, deque())
        if readings and num_granted < readings[-1][1]:  # a new worker under the same id: start again
            readings.clear()
        readings.append((now_s, num_granted))
        while len(readings) > 2 and now_s - readings[1][0] >= WINDOW_S:
            readings.popleft()
        self._waiting[worker_id] = num_waiting

    def forget(self, worker_id: str) -> None:
        self._readings.pop(worker_id, None)
        self._waiting.pop(worker_id, None)

    def grant_rate(self, worker_id: str) -> float | None:
        """Reservations granted per second over the window; None before two
        readings `MIN_SPAN_S` apart."""
        readings = self._readings.get(worker_id)
        if not readings or readings[-1][0] - readings[0][0] < MIN_SPAN_S:
            return None
        (first_s, first), (last_s, last) = readings[0], readings[-1]
        return (last - first) / (last_s - first_s)

    def read_at_s(self, worker_id: str) -> float | None:
        """When D's stats were last read (monotonic)."""
        readings = self._readings.get(worker_id)
        return readings[-1][0] if readings else None

    def wait_s(self, worker_id: str, has_room: bool, joined: int = 0) -> float:
        """The predicted wait of a request joining D's line now; `has_room`: D's
        free blocks held its prompt at the last reading; `joined`: requests sent
        to D since that reading and still in their handshake."""
        waiting = self._waiting.get(worker_id, 0)
        if has_room and not waiting:
            return 0.0
        waiting += joined
        rate = self.grant_rate(worker_id)
        if rate is None:
            return 0.0
        if rate <= 0:
            return self.max_wait_s if waiting else 0.0
        return min((waiting + 1) / rate, self.max_wait_s)
