"""What a decode step of so many rows costs, measured live on the engine's own
decode-only steps: the time of each row count seen of late, and between those,
a straight line.

Speculative decoding asks it (actors/speculation.py): a draft is a row that
yields a token only if confirmed, so whether it pays depends on what rows cost
on this machine, at this batch. On a GPU a decode step reads the weights whatever
its rows, up to large batches (a row costs little, until a CUDA graph's size is
passed); on a CPU a step is compute-bound from a few rows on. Nor is the cost a
line: on this machine's two cores a step of the bench preset took 22 ms with one
row, 29 with three and 34 with five (a one-off probe: a lone request verifying
0, 2 or 4 drafts, as in `tandem bench speculative`), the first extra row dearest. So a
row count's time is its own: an average of its latest steps (each new one
weighing `WEIGHT`), and row counts not seen are read off the line through the
nearest seen on either side (or the two nearest, past the ends).

A row count not seen in the latest `MAX_AGE` steps is forgotten (the batch and
the contexts have moved on), and with fewer than two remembered the cost is
unknown (`curve` gives None, and the trim verifies every draft, which measures
more rows): a batch whose rows never change tells nothing about what more rows
cost. The counts just past those the trim keeps are measured by its exploring
steps (actors/speculation.py `EXPLORE_EVERY`).

Only steps that decode alone are recorded (each chunk one known token plus its
drafts): a chunk of a prompt costs what a decode row does not. The time is the
runner's, from launch to tokens read (actors/model_runner.py `last_step_s`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

WEIGHT = 0.2  # a step's share of its row count's time
MAX_AGE = 256  # steps after which a row count not seen again is forgotten


@dataclass
class _RowCount:
    seconds: float
    last_seen: int  # the step it was last seen at


class DecodeStepCosts:
    def __init__(self) -> None:
        self._counts: dict[int, _RowCount] = {}
        self._num_steps = 0

    def record(self, num_rows: int, seconds: float) -> None:
        """A decode-only step of `num_rows` rows took `seconds`."""
        self._num_steps += 1
        seen = self._counts.get(num_rows)
        if seen is None:
            self._counts[num_rows] = _RowCount(seconds, self._num_steps)
        else:
            seen.seconds += WEIGHT * (seconds - seen.seconds)
            seen.last_seen = self._num_steps
        if len(self._counts) > 1 and self._num_steps % MAX_AGE == 0:
            self._counts = {n: c for n, c in self._counts.items() if self._num_steps - c.last_seen < MAX_AGE}

    def curve(self) -> StepCurve | None:
        """The step time against rows, now; None while fewer than two row counts
        were seen in the latest `MAX_AGE` steps."""
        recent = sorted((n, c.seconds) for n, c in self._counts.items() if self._num_steps - c.last_seen < MAX_AGE)
        return StepCurve(recent) if len(recent) > 1 else None


class StepCurve:
    """Seconds for a step of any number of rows: the seen counts' times, a line
    between neighbours, the end segments' lines past the ends (never below 0)."""

    def __init__(self, points: list[tuple[int, float]]) -> None:
        assert len(points) > 1
        self._rows = [n for n, _ in points]
        self._seconds = [s for _, s in points]

    def __call__(self, num_rows: int) -> float:
        right = min(max(bisect.bisect_left(self._rows, num_rows), 1), len(self._rows) - 1)
        x0, x1 = self._rows[right - 1], self._rows[right]
        y0, y1 = self._seconds[right - 1], self._seconds[right]
        return max(0.0, y0 + (y1 - y0) * (num_rows - x0) / (x1 - x0))
