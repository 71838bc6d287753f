"""A worker's latest prefill steps and what each took: the timings the scheduler
fits the worker's prefill cost model on, live, as it fits a decode worker's step
model on the token gaps it serves (cluster/admission.py).

Only steps that compute prompt tokens alone are kept: a step that also decodes
(a colocated worker's mixed batch) costs what no prefill model describes. The
time is the runner's, from the step's launch to its tokens read (its compute and
sampling), not the scheduling around it. A bounded ring: the scheduler reads it
with the worker's stats, about once a second, and takes the steps after the last
one it saw (`PrefillStep.seq`); a P that runs more steps than the ring holds
between two reads is sampled, not replayed.

Written on the engine thread, read from the actor's event loop without a lock:
`latest` copies the deque in one call, which no append interleaves.
"""

from __future__ import annotations

from collections import deque

from actors.messages import PrefillStep
from actors.scheduler import ScheduledChunk

NUM_KEPT = 64


class PrefillStepLog:
    def __init__(self, num_kept: int = NUM_KEPT) -> None:
        self._steps: deque[PrefillStep] = deque(maxlen=num_kept)

    def record(self, seq: int, chunks: list[ScheduledChunk], seconds: float) -> None:
        """Keep step `seq` if every chunk of it computes prompt tokens (a
        request's recompute after preemption counts: its chunks start inside
        the prompt)."""
        if not chunks or any(c.start >= c.request.num_prompt_tokens for c in chunks):
            return
        self._steps.append(PrefillStep(seq, tuple((c.num_new_tokens, c.start) for c in chunks), seconds))

    def clear(self) -> None:
        self._steps.clear()

    def latest(self, after: int = -1) -> tuple[PrefillStep, ...]:
        """The kept steps later than step `after`, oldest first."""
        return tuple(step for step in tuple(self._steps) if step.seq > after)
