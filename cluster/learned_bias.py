"""A margin learned per worker from what admission's predictions missed by.

Admission admits a request when its predicted TTFT and TBT are within the SLO,
and the SLO is met when `slo.attainment` of the requests (0.9) meet it. A model
fitted by least squares predicts a mean: a request admitted just inside the SLO
on a mean prediction misses it as often as the mean is short (for D's TBT, 30-37%
of requests in `tandem bench predictions`). So each prediction adds the
`quantile` (the attainment target) of its worker's latest residuals (observed
less the model's prediction, never below zero): a request predicted inside the
SLO then meets it nearer as often as the target asks (83-85% within the TBT
prediction there; the fading below keeps it short of 90%).

The residuals fade: each counts whole for its first `half_life_s`, then halves
every `half_life_s`, and the bias with them while none comes. Only admitted
requests are observed, so a bias learned in a bad spell that put every
prediction past the SLO would otherwise reject every request from then on (it
did, in `tandem bench handshake` with early rejection: after an overloaded
warm-up, all 538 requests of the next two rounds); faded, requests get in again
and what they take says what the bias is now.

Each residual used to fade from the moment it was observed. A window of 64 then
spans seconds of traffic whose older part counted shrunken, so the quantile sat
below the target under any load: `tandem bench predictions` found 0.68 and 0.80
of first tokens within their prediction, where 0.9 is asked; counted whole for a
half-life, 0.88-0.95 (docs/benchmarks.md, "The learned bias counts a residual
whole for a half-life"). The lock-out above clears one half-life later than it did.
"""

from __future__ import annotations

import copy
import time
from collections import deque

HALF_LIFE_S = 10.0  # a residual, and a bias without new ones, halves every this long
WINDOW = 64  # the latest residuals a worker's bias is the quantile of


class LearnedBias:
    """Per worker: the faded `quantile` of its latest `WINDOW` residuals."""

    def __init__(self, quantile: float, half_life_s: float = HALF_LIFE_S) -> None:
        self.quantile = quantile
        self.half_life_s = half_life_s
        self._bias: dict[str, tuple[float, float]] = {}  # worker_id -> (bias, when learned)
        self._residuals: dict[str, deque[tuple[float, float]]] = {}  # worker_id -> (residual, when)

    def observe(self, worker_id: str, residual_s: float) -> None:
        """One prediction's error: observed seconds less the model's (its bias left out)."""
        now = time.monotonic()
        window = self._residuals.setdefault(worker_id, deque(maxlen=WINDOW))
        window.append((residual_s, now))
        faded = [r * self._fade(now - at) for r, at in window]
        self._bias[worker_id] = (max(quantile(faded, self.quantile), 0.0), now)

    def __call__(self, worker_id: str) -> float:
        """The worker's bias now (0 before any residual)."""
        entry = self._bias.get(worker_id)
        if entry is None:
            return 0.0
        bias, learned_s = entry
        return bias * self._fade(time.monotonic() - learned_s)

    def _fade(self, age_s: float) -> float:
        """Whole for `half_life_s`, then halving every `half_life_s`."""
        return 0.5 ** (max(age_s - self.half_life_s, 0.0) / self.half_life_s)

    def seed_from(self, peer_id: str, worker_id: str) -> None:
        """A new worker starts from a peer's bias and residuals (same model, same node type)."""
        if peer_id in self._bias:
            self._bias[worker_id] = self._bias[peer_id]
            self._residuals[worker_id] = copy.copy(self._residuals[peer_id])

    def forget(self, worker_id: str) -> None:
        self._bias.pop(worker_id, None)
        self._residuals.pop(worker_id, None)


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile of `values`, interpolated between the two nearest ranks (as
    numpy's default). In Python: on a window of 64 a twentieth of np.quantile's
    time, and no first call of 7-15 ms added to the first request's first token."""
    ranked = sorted(values)
    position = q * (len(ranked) - 1)
    below = int(position)
    above = min(below + 1, len(ranked) - 1)
    return ranked[below] + (ranked[above] - ranked[below]) * (position - below)
