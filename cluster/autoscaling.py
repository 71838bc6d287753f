"""Autoscaling policy, one per pool, P and D independent (after Dynamo's planner:
each phase is sized from its own SLO figure and its own load signal).

Pure Python, no Ray and no clock of its own: the pool manager
(`cluster/pool_autoscaler.py`) builds a `PoolObservation` every
`autoscaling.interval_s`, calls `decide(observation, now_s)` and carries out the
`Decision` (start a worker, or drain one). Tests feed sequences of observations with
their own clock.

- Prefill (`PrefillScaling`): up when the TTFT attainment of the window falls
  below the SLO target, or when the queued prompt tokens per prefill worker exceed
  `prefill_backlog_up_tokens`; down when attainment is at least target + margin
  (or unknown: too few requests), the backlog per worker stayed under
  `prefill_backlog_down_tokens` for the whole window (its peak), and one worker
  fewer would have stayed under the up threshold.
- Decode (`DecodeScaling`): the same shape with TBT attainment and the fraction of
  the pool's KV blocks in use by requests past their prefill (`kv_usage_up` /
  `kv_usage_down`; blocks reserved for prompts still in prefill are the prefill
  pool's backlog, see cluster/scaling_signals.py).

Rules shared by both (`ScalingPolicy`):
- Bounds: never above `max_size` nor below `min_size` (outside them: one step
  back at once, no cooldown).
- One step at a time: no decision while a worker of the pool is starting or
  draining; but for one: pressure while a worker this policy scaled down still
  drains takes that worker back (`num_recallable`), at once. It is warm, where a
  new one is a model load and a cooldown away, and the drain was the wrong call.
  One drained by hand (`tandem drain`) or by a redeploy is never taken back.
- Cooldowns count from the end of the last step, i.e. the last moment the pool had
  a worker starting or draining: up needs `scale_up_cooldown_s`, down needs
  `scale_down_cooldown_s` (long: at most one scale-down in that time after a
  scale-up).
- Hysteresis: separate up and down thresholds; between them the pool holds. Up
  reacts to the load now, down to its peak over the window: a load that comes in
  waves (clients that start together and end together) must be low for a whole
  window before a worker goes.
- Memory of shortfalls: a size whose attainment fell below the target is not
  come back to (nor any smaller) for `shortfall_memory_s`, unless the load (the
  rate of outcomes: attainment counts those since the pool last changed, so a
  count right after a step covers seconds, not the window) fell under
  `LOAD_FALL` of the load it fell short at. Backlog
  and KV use each ask whether one worker fewer would still fit; attainment cannot
  say, and under a steady load a pool scaled up for it came back down at its next
  cooldown, fell short again, and went up again (a model load each round, every
  minute or two: a review's run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from cluster.config import AutoscalingSettings, PoolSettings


class Action(Enum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


@dataclass(frozen=True)
class PoolObservation:
    """One pool at one moment, as the pool manager sees it."""

    num_serving: int  # ready workers that take new requests
    num_starting: int = 0  # started, not ready yet
    num_draining: int = 0  # taking no new requests, finishing what they hold
    num_recallable: int = 0  # of those, ones this pool's policy scaled down (a scale-up takes one back)
    attainment: float | None = None  # of this pool's SLO figure over the window; None: too few outcomes
    num_samples: int = 0  # outcomes behind `attainment`
    samples_span_s: float | None = None  # the time they came in (the window, or less since the pool last changed)
    backlog_tokens: int = 0  # prefill: prompt tokens admitted to the pool to compute (not cached), not yet prefilled
    kv_blocks_used: int = 0  # decode: KV blocks held by requests past their prefill, over the serving workers
    kv_blocks_total: int = 0  # decode: KV blocks over the serving workers
    backlog_tokens_peak: int = 0  # the highest backlog_tokens over the window
    kv_blocks_used_peak: int = 0  # the highest kv_blocks_used over the window
    handshakes_waiting: int = 0  # decode: handshakes in the serving workers' lines, waiting for KV blocks


LOAD_FALL = 0.8  # of the load (outcomes a second) at which a size fell short: under it, that size may serve again


@dataclass
class Shortfall:
    """A size's attainment fell below the target: when last, and at the least load it did."""

    at_s: float
    rate: float  # outcomes a second


def _rate(obs: PoolObservation) -> float:
    """Outcomes a second behind the observation's attainment (over at least a
    second); their count where it does not say over how long."""
    return obs.num_samples / max(obs.samples_span_s, 1.0) if obs.samples_span_s is not None else obs.num_samples


@dataclass(frozen=True)
class Decision:
    action: Action
    signal: str  # a short code, the metric label: ttft_attainment, prefill_backlog, kv_usage, idle, ...
    reason: str  # one line for the log, with the figures


def _hold(signal: str, reason: str) -> Decision:
    return Decision(Action.HOLD, signal, reason)


class ScalingPolicy:
    """Bounds, one step at a time, cooldowns and hysteresis; subclasses say what
    pushes the pool up (`pressure`) and what lets it come down (`relief`)."""

    role = "base"
    figure = "SLO"  # the latency whose attainment this pool answers for

    def __init__(self, pool: PoolSettings, knobs: AutoscalingSettings, attainment_target: float) -> None:
        self.min_size = pool.min_size
        self.max_size = pool.max_size
        self.knobs = knobs
        self.target = attainment_target
        self.down_attainment = min(1.0, attainment_target + knobs.scale_down_margin)
        self.settled_s = -math.inf  # the last step taken, or the end of one (a worker starting or draining)
        self.shortfalls: dict[int, Shortfall] = {}  # by pool size

    def carry_on_from(self, before: ScalingPolicy) -> None:
        """What `before`, this pool's policy until a redeploy rebuilt it, learned of
        the pool: when it last settled (its cooldowns run on; a fresh policy's let
        it scale down at once) and the sizes that fell short (not come back to:
        forgotten, a redeploy of any setting brought back the down, short, up
        cycle `shortfall_memory_s` is there to stop)."""
        self.settled_s = before.settled_s
        self.shortfalls = dict(before.shortfalls)

    def stepped(self, now_s: float) -> None:
        """A step this policy decided was carried out (a worker started, taken
        back or draining): the pool settles from now too. A worker ready, or a
        drain over, before the next control round was never seen starting or
        draining, and the cooldown, counted from the step before, let the next
        step come one round later (a drain of 5 s under a 10 s round: a
        scale-down every round where the cooldown asked 60 s). A step decided and
        not carried out (held by the restart backoff, no worker to drain) does
        not: it held the next scale-up a cooldown past the backoff."""
        self.settled_s = now_s

    def decide(self, obs: PoolObservation, now_s: float) -> Decision:
        if obs.num_starting or obs.num_draining:
            self.settled_s = now_s
            recall = self._recall(obs, now_s) if obs.num_recallable and not obs.num_starting else None
            return recall or _hold("in_progress", f"{obs.num_starting} starting, {obs.num_draining} draining")
        size = obs.num_serving
        if size < self.min_size:
            return Decision(Action.UP, "below_min", f"{size} workers, below the minimum of {self.min_size}")
        if size > self.max_size:
            return Decision(Action.DOWN, "above_max", f"{size} workers, above the maximum of {self.max_size}")
        pressure = self.pressure(obs)
        if pressure is not None:
            signal, reason = pressure
            if signal == f"{self.figure.lower()}_attainment":
                self._note_shortfall(size, obs, now_s)
            if size >= self.max_size:
                return _hold("at_max", f"{reason}, but already at the maximum of {self.max_size}")
            waited = now_s - self.settled_s
            if waited < self.knobs.scale_up_cooldown_s:
                return _hold("cooldown", f"{reason}; up cooldown ({waited:.0f}/{self.knobs.scale_up_cooldown_s:.0f} s)")
            return Decision(Action.UP, signal, reason)
        if size > self.min_size:
            reason = self.relief(obs)
            short = self._short_at(size - 1, obs, now_s) if reason is not None else None
            if short is not None:
                return _hold("fell_short", f"{reason}, but {short}")
            if reason is not None:
                waited = now_s - self.settled_s
                if waited < self.knobs.scale_down_cooldown_s:
                    return _hold("cooldown", f"{reason}; down cooldown "
                                             f"({waited:.0f}/{self.knobs.scale_down_cooldown_s:.0f} s)")
                return Decision(Action.DOWN, "idle", reason)
        return _hold("steady", f"{size} workers")

    def _recall(self, obs: PoolObservation, now_s: float) -> Decision | None:
        """UP, while a worker this policy scaled down still drains, if the pool is
        short again: the pool manager takes that worker back. No cooldown (it
        counts from now: the pool is still changing), and a shortfall at this
        size is noted as at any other time."""
        pressure = self.pressure(obs)
        if pressure is None or obs.num_serving >= self.max_size:
            return None
        signal, reason = pressure
        if signal == f"{self.figure.lower()}_attainment":
            self._note_shortfall(obs.num_serving, obs, now_s)
        return Decision(Action.UP, signal, f"{reason}; a worker scaled down and still draining is taken back")

    def _note_shortfall(self, size: int, obs: PoolObservation, now_s: float) -> None:
        known = self.shortfalls.get(size)
        fresh = known is not None and now_s - known.at_s < self.knobs.shortfall_memory_s
        self.shortfalls[size] = Shortfall(now_s, min(_rate(obs), known.rate) if fresh else _rate(obs))

    def _short_at(self, size: int, obs: PoolObservation, now_s: float) -> str | None:
        """Why `size` workers would fall short again (None: no reason to think so):
        it, or a larger size, did within the memory at no more load than now's."""
        for known_size, known in sorted(self.shortfalls.items()):
            if (known_size >= size and now_s - known.at_s < self.knobs.shortfall_memory_s
                    and _rate(obs) > LOAD_FALL * known.rate):
                return (f"{known_size} workers fell short of the {self.figure} target {now_s - known.at_s:.0f} s ago "
                        f"at {known.rate:.2f} requests a second (now {_rate(obs):.2f})")
        return None

    # ---- what each pool watches ---------------------------------------------------------
    def pressure(self, obs: PoolObservation) -> tuple[str, str] | None:
        """(signal, reason) when the pool is short, else None."""
        raise NotImplementedError

    def relief(self, obs: PoolObservation) -> str | None:
        """A reason when one worker fewer would do, else None."""
        raise NotImplementedError

    def _attainment_low(self, obs: PoolObservation) -> tuple[str, str] | None:
        if obs.attainment is not None and obs.attainment < self.target:
            return (f"{self.figure.lower()}_attainment",
                    f"{self.figure} attainment {obs.attainment:.0%} below the target {self.target:.0%} "
                    f"({obs.num_samples} requests)")
        return None

    def _attainment_high(self, obs: PoolObservation) -> str | None:
        if obs.attainment is None:
            return f"too few requests to judge {self.figure}"
        if obs.attainment >= self.down_attainment:
            return f"{self.figure} attainment {obs.attainment:.0%}"
        return None


class PrefillScaling(ScalingPolicy):
    role = "prefill"
    figure = "TTFT"

    def pressure(self, obs):
        low = self._attainment_low(obs)
        if low is not None:
            return low
        per_worker = obs.backlog_tokens / max(obs.num_serving, 1)
        if per_worker > self.knobs.prefill_backlog_up_tokens:
            return ("prefill_backlog", f"prefill backlog {per_worker:.0f} tokens per worker above "
                                       f"{self.knobs.prefill_backlog_up_tokens}")
        return None

    def relief(self, obs):
        attained = self._attainment_high(obs)
        peak = max(obs.backlog_tokens, obs.backlog_tokens_peak)
        per_worker = peak / obs.num_serving
        one_fewer = peak / (obs.num_serving - 1) if obs.num_serving > 1 else (math.inf if peak else 0.0)
        if (attained is None or per_worker >= self.knobs.prefill_backlog_down_tokens
                or one_fewer > self.knobs.prefill_backlog_up_tokens):
            return None
        return f"{attained}; prefill backlog at most {per_worker:.0f} tokens per worker over the window"


class DecodeScaling(ScalingPolicy):
    role = "decode"
    figure = "TBT"

    def pressure(self, obs):
        low = self._attainment_low(obs)
        if low is not None:
            return low
        usage = obs.kv_blocks_used / obs.kv_blocks_total if obs.kv_blocks_total else 0.0
        if usage > self.knobs.kv_usage_up:
            return "kv_usage", f"KV blocks {usage:.0%} in use, above {self.knobs.kv_usage_up:.0%}"
        return None

    def relief(self, obs):
        attained = self._attainment_high(obs)
        peak = max(obs.kv_blocks_used, obs.kv_blocks_used_peak)
        usage = peak / obs.kv_blocks_total if obs.kv_blocks_total else 0.0
        one_fewer = (usage * obs.num_serving / (obs.num_serving - 1) if obs.num_serving > 1
                     else (math.inf if peak else 0.0))
        if (attained is None or usage >= self.knobs.kv_usage_down or one_fewer > self.knobs.kv_usage_up
                or obs.handshakes_waiting):  # (requests wait for KV room: not a pool to shrink)
            return None
        return f"{attained}; KV blocks at most {usage:.0%} in use over the window"


POLICIES = {cls.role: cls for cls in (PrefillScaling, DecodeScaling)}


def make_policy(role: str, pool: PoolSettings, knobs: AutoscalingSettings, attainment_target: float) -> ScalingPolicy:
    if role not in POLICIES:
        raise ValueError(f"no scaling policy for the {role!r} pool; pools that scale: {sorted(POLICIES)}")
    return POLICIES[role](pool, knobs, attainment_target)
