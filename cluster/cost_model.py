"""Cost models fitted online by least squares over a sliding window of observations.

    prefill_step_s = a + sum over the step's chunks of (b * new_tokens + c * new_tokens * context_tokens)
    decode_step_s = a + b * batch_size + c * kv_tokens

(a chunk's context: its tokens and those before them). Both are a step's time,
fitted on engine steps: a prompt alone takes one step a chunk, and its prediction
is the sum of those (cluster/admission.py). Each model is seeded by a start-up
profile (real timings from the worker, actors/profiler.py) and refitted as
timings arrive: on the next prediction after them, not on each one (a
scheduler observes a token gap a request every few tokens; a least-squares fit of
the window each time cost it a sixth of its CPU at batch 64, a py-spy sample).
Plain numpy; a prediction never goes below the smallest time seen (a fit can
extrapolate to negative values for tiny inputs).
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np


class LinearCostModel:
    def __init__(self, num_features: int, window: int = 256) -> None:
        self.num_features = num_features
        self._rows: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._coef: np.ndarray | None = None  # None: not fitted since the last observation
        self._floor = 0.0

    @property
    def is_fitted(self) -> bool:
        return bool(self._rows)

    def observe(self, features: tuple[float, ...], seconds: float) -> None:
        assert len(features) == self.num_features
        self._rows.append((tuple(float(f) for f in features), float(seconds)))
        self._coef = None

    def _coefficients(self) -> np.ndarray:
        """The fit of the window, refitted after new observations (costs only grow
        with work: no coefficient below zero)."""
        if not self._rows:
            raise RuntimeError("cost model has no observations yet")
        if self._coef is None:
            x = np.array([(1.0, *f) for f, _ in self._rows])
            y = np.array([s for _, s in self._rows])
            self._coef = _non_negative_least_squares(x, y)
            self._floor = float(y.min())
        return self._coef

    def fixed_s(self) -> float:
        """The fitted cost of no work (the intercept): what every call costs."""
        return float(self._coefficients()[0])

    def predict(self, features: tuple[float, ...]) -> float:
        value = float(self._coefficients() @ np.array((1.0, *features)))
        return max(value, self._floor * 0.5)


def _non_negative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The least-squares coefficients under coef >= 0. The optimum is the plain
    fit on some subset of the columns (the others at zero) that comes out
    non-negative, so with a few columns every subset is tried and the feasible fit
    with the least error kept. Clipping the plain fit's negative coefficients to
    zero instead kept the others fitted beside them: a D's step model, refitted on
    token gaps whose batch coefficient came out at -0.13 ms a request, then
    predicted with the intercept and KV slope of a fit it no longer was."""
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    if (coef >= 0).all():
        return coef
    best, best_error = np.zeros(x.shape[1]), float(y @ y)
    for mask in itertools.product((True, False), repeat=x.shape[1]):
        columns = np.flatnonzero(mask)
        if not len(columns):
            continue
        part, *_ = np.linalg.lstsq(x[:, columns], y, rcond=None)
        if (part < 0).any():
            continue
        error = float(np.sum((x[:, columns] @ part - y) ** 2))
        if error < best_error:
            best, best_error = np.zeros(x.shape[1]), error
            best[columns] = part
    return best


def prefill_features(new_tokens: int, cached_tokens: int) -> tuple[float, float]:
    """One chunk of `new_tokens` after `cached_tokens` computed before it."""
    context = new_tokens + cached_tokens
    return (float(new_tokens), new_tokens * context / 1e3)


def prefill_step_features(chunks: tuple[tuple[int, int], ...]) -> tuple[float, float]:
    """A step's chunks, each (new tokens, tokens before them): their features summed
    (the model is linear, and the step's fixed part is paid once)."""
    parts = [prefill_features(new, before) for new, before in chunks]
    return (sum(p[0] for p in parts), sum(p[1] for p in parts))


def decode_features(batch_size: int, kv_tokens: int) -> tuple[float, float]:
    return (float(batch_size), kv_tokens / 1e3)
