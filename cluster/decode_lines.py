"""How long a request would wait in a decode worker's line for KV blocks.

A decode worker (D) without room for a prompt keeps its handshake waiting
(actors/reservation_queue.py) until running requests finish and free blocks;
only then does the prefill start. Admission adds that wait to the predicted TTFT.
It is predicted from D's stats, read at each refresh by every scheduler replica
alike: the handshakes waiting now, and the reservations D granted per second
in the last `WINDOW_S` since a reading first found handshakes waiting. D grants a
waiting handshake only as blocks come free, so from then on the rate is about
how fast D frees room; before, it was how fast requests came to a D with room,
which says nothing of it (a burst onto an idle D read as a D that frees
nothing, and its last requests were turned away with a predicted wait of 10 s).
Readings without a line after the first with one still count: under a steady
overload D's line comes and goes between readings, and the rate over only the
readings with a line was the higher one, the waits it predicted too short (in
`tandem bench handshake --short-every-ms 20 --ttft-slo-ms 1500`, 0.38-0.94 of
the admitted within the SLO against 0.76-0.99, six runs a side;
docs/benchmarks.md).
First come, first served, so a request joining a line of k waits about
(k + 1) / rate; k counts, besides the line at the last reading, this replica's
requests sent to D since then that its room did not hold
(`DecodeRooms.num_joined_line`: a burst joins the line between two readings). With
room for the prompt once the line has what it asks for (the scheduler's
`DecodeRooms.headroom`), no wait. With no grant for `MIN_SPAN_S` or more since
handshakes waited, D frees nothing now: the wait is the whole handshake wait,
at whose end the request would be refused. Without a line read for `MIN_SPAN_S`
in the window, no prediction here: the scheduler predicts the wait from when
its requests on D will finish (`DecodeRooms.release_wait_s`).
"""

from __future__ import annotations

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
        """Reservations granted per second in the window since the first reading
        that found handshakes waiting; None before `MIN_SPAN_S` of that."""
        readings = self._readings.get(worker_id, ())
        first = next(((at_s, granted) for at_s, granted, waiting in readings if waiting), None)
        if first is None or readings[-1][0] - first[0] < MIN_SPAN_S:
            return None
        return (readings[-1][1] - first[1]) / (readings[-1][0] - first[0])

    def read_at_s(self, worker_id: str) -> float | None:
        """When D's stats were last read (monotonic)."""
        readings = self._readings.get(worker_id)
        return readings[-1][0] if readings else None

    def wait_s(self, worker_id: str, has_room: bool, joined: int = 0) -> float | None:
        """The predicted wait of a request joining D's line now; `has_room`: D's
        free blocks held its prompt at the last reading; `joined`: requests sent
        to D since that reading that joined its line. None without a grant rate
        to go by."""
        readings = self._readings.get(worker_id)
        waiting = readings[-1][2] if readings else 0
        if has_room and not waiting:
            return 0.0
        waiting += joined
        rate = self.grant_rate(worker_id)
        if rate is None:
            return None
        if rate <= 0:  # D granted nothing: a request without room, or behind a line, waits it all
            return self.max_wait_s
        return min((waiting + 1) / rate, self.max_wait_s)
