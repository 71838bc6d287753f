"""What the autoscaler learns from the schedulers: the SLO outcome of each request
and where the admitted requests are.

Scheduler side: `OutcomeRecorder`. Each request is timed by a `RequestTimer`
(tokens as they arrive, then how it ended); `report()` takes what accumulated since
the last call as a `SchedulerReport` (plain data), which the scheduler sends to the
pool manager on every refresh (about once a second).

Pool manager side: `SignalBook`. TTFT outcomes judge the prefill pool and TBT
outcomes the decode pool, each request's figure against the SLO, over a time
window; an early rejection counts as a miss of the figure that was predicted to
miss. The time a request waited in a decode worker's line for KV room (or a
place in its batch) is the decode pool's: the prefill pool is judged by the TTFT
without it, and a request whose TTFT missed only for that wait (served, or
rejected early for its predicted wait) is a miss of the decode pool's (a line
miss). Counted as the prefill pool's, a decode pool short of room scaled the
prefill pool up for nothing, and nothing scaled the decode pool where its KV
use read low (its places full, say). From each replica's latest report it also keeps the backlog and the requests
in flight per worker; a replica silent for `FRESH_S` stops counting in the load,
and one silent for `stale_after_s` is forgotten (drains wait for it until then). Each
report is answered with the other replicas' load (`PeerLoad`), which the replica's
cost models add to its own (see cluster/admission.py).

Definitions:
- TTFT: from the scheduler taking the request to its first token, retries
  included. A request that fails before its first token is a TTFT miss; one its
  client cancels counts nowhere.
- TBT of a request: (last token time - first token time) / (tokens - 1), the mean,
  as the benchmarks judge it (`benchmarks/serving_metrics.py`); a request with
  fewer than two tokens has none.
- Backlog of a prefill (or colocated) worker: the prompt tokens it computes (its
  cached prefix aside, as admission predicted it: two turns of a 3k-token chat,
  each nearly all cached, read as 6k tokens and scaled the pool up) of the
  requests admitted to it whose first token has not come yet (queued or in
  prefill), past their handshake: one waiting in a decode worker's line for KV
  blocks is no P's work yet (its D is short of KV, not the prefill pool of compute).
- Decoding on a decode (or colocated) worker: the requests past their first token,
  and their KV tokens (prompt plus generated).
- Not here: the blocks a decode worker reserved for prompts still in prefill. The
  decode policy subtracts them from the blocks in use (they measure the prefill
  backlog, which another decode worker would not shorten), and D reports them
  itself (`WorkerStats.num_reserved_blocks`), in the same stats answer as its
  blocks in use. Estimated here from the requests' states, they were up to a report
  interval older than D's figure: a burst of reservations made since the last
  report counted as decode load, and scaled the decode pool up under a
  prefill-heavy load.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

FIGURES = ("ttft", "tbt")
MAX_SAMPLES_HELD = 10_000  # outcomes of each kind a replica holds while the pool manager gets no report


@dataclass(frozen=True)
class PeerLoad:
    """The load the other scheduler replicas put on each worker, from their latest
    reports (at most a refresh interval old). Empty with one replica."""

    backlog_tokens: dict[str, int] = field(default_factory=dict)
    decoding: dict[str, int] = field(default_factory=dict)
    decoding_kv_tokens: dict[str, int] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    backlog_prompts: dict[str, int] = field(default_factory=dict)  # the prompts `backlog_tokens` are of


@dataclass(frozen=True)
class SchedulerReport:
    replica_id: str
    ttft_s: tuple[float, ...] = ()  # math.inf: failed before its first token
    tbt_s: tuple[float, ...] = ()
    num_rejected_ttft: int = 0  # early rejections whose predicted TTFT missed the SLO
    num_rejected_tbt: int = 0
    num_line_misses: int = 0  # TTFT misses (served or rejected) that D's line alone made: the decode pool's
    backlog_tokens: dict[str, int] = field(default_factory=dict)  # prefill (or colocated) worker -> tokens
    decoding: dict[str, int] = field(default_factory=dict)  # decode (or colocated) worker -> requests
    decoding_kv_tokens: dict[str, int] = field(default_factory=dict)  # decode (or colocated) worker -> KV tokens
    inflight: dict[str, int] = field(default_factory=dict)  # worker -> requests in flight there now
    routed: dict[str, int] = field(default_factory=dict)  # worker -> requests sent there since the last report
    draining: frozenset[str] = frozenset()  # workers this replica knows are draining (routes nothing new there)
    backlog_prompts: dict[str, int] = field(default_factory=dict)  # prefill (or colocated) worker -> prompts


class RequestTimer:
    """One request's token times; `end` hands its outcome to the recorder."""

    def __init__(self, recorder: OutcomeRecorder, started_s: float) -> None:
        self.recorder = recorder
        self.started_s = started_s
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.num_tokens = 0
        self.attempt = None  # the running attempt's InFlight record (cluster/admission.py)
        self.line_wait_s = 0.0  # the ended attempts' time in D's line
        self.ended_in_line = False  # its last attempt ended waiting in D's line

    def attempt_started(self, attempt) -> None:
        """An attempt's InFlight record: its time in D's line is read from it."""
        self.attempt = attempt

    def attempt_ended(self, now_s: float) -> None:
        """The attempt ended (served, retried or given up): its time in D's line
        before its first token kept, and whether it ended there."""
        attempt, self.attempt = self.attempt, None
        if attempt is not None:
            self.line_wait_s += attempt.waited_in_line_s(now_s) if attempt.in_prefill else 0.0
            self.ended_in_line = attempt.in_line

    def tokens(self, count: int, now_s: float) -> None:
        if count <= 0:
            return
        if self.first_s is None:
            self.first_s = now_s
            running = self.attempt.waited_in_line_s(now_s) if self.attempt is not None else 0.0
            self.recorder.record_ttft(now_s - self.started_s, self.line_wait_s + running)
        self.last_s = now_s
        self.num_tokens += count

    @property
    def tbt_s(self) -> float | None:
        """The request's TBT so far: its mean gap between tokens (None before two)."""
        if self.num_tokens < 2:
            return None
        return (self.last_s - self.first_s) / (self.num_tokens - 1)

    def end(self, outcome: str, now_s: float) -> None:
        """outcome: "ok", "error", "cancelled", "aborted" (/abort_request),
        "withdrawn" (cluster/client_call.py) or "rejected" (as the scheduler's
        metric); "ok" and "error" teach. An error is a miss: of the TTFT
        before the first token, of the TBT after it (a timeout, a D that died
        mid-stream: the worst decode misses were in no sample). A client that
        left before its first token, having waited past the TTFT SLO, is a
        TTFT miss too, of the time it waited (clients that time out are the
        misses an overloaded pool makes: without them, its attainment read as
        met while they gave up); one that left sooner is no outcome (its TTFT
        is not known). Before the first token, its time in D's line is the
        decode pool's (`OutcomeRecorder.record_ttft`); one that failed there (no
        room within its handshake's wait) is a line miss."""
        if outcome == "error" and self.first_s is None and self.ended_in_line:
            self.recorder.line_missed()
        elif outcome == "error":
            (self.recorder.record_ttft if self.first_s is None else self.recorder.record_tbt)(math.inf)
        elif outcome == "ok" and self.tbt_s is not None:
            self.recorder.record_tbt(self.tbt_s)
        elif outcome == "cancelled" and self.first_s is None and now_s - self.started_s > self.recorder.ttft_slo_s:
            self.recorder.record_ttft(now_s - self.started_s, self.line_wait_s)


class OutcomeRecorder:
    """A replica's outcomes since its last report, each with when it was
    recorded (`clock`): a report the pool manager did not get is put back, and
    outcomes held longer than `hold_s` (the autoscaler's window) go. The pool
    manager stamps what a report carries with its arrival: held through an
    outage of minutes, an overload long over read as now, and an idle pool
    scaled up on it."""

    def __init__(self, replica_id: str, ttft_slo_s: float = math.inf, hold_s: float = math.inf,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.replica_id = replica_id
        self.ttft_slo_s = ttft_slo_s  # a client gone before its first token after it: a miss (RequestTimer.end)
        self.hold_s = hold_s
        self.clock = clock
        self._held = _Held()
        self._routed: dict[str, int] = {}
        self._sent: tuple[SchedulerReport, _Held] | None = None  # the latest report, and what it carried

    def timer(self, started_s: float) -> RequestTimer:
        return RequestTimer(self, started_s)

    def record_ttft(self, seconds: float, line_wait_s: float = 0.0) -> None:
        """A TTFT, of which `line_wait_s` in D's line: the prefill pool's outcome
        is the rest; a miss that wait alone made is a line miss."""
        now_s, own_s = self.clock(), seconds - line_wait_s
        self._held.ttft.append((now_s, own_s))
        if seconds > self.ttft_slo_s >= own_s:
            self._held.line_misses.append(now_s)

    def record_tbt(self, seconds: float) -> None:
        self._held.tbt.append((self.clock(), seconds))

    def line_missed(self) -> None:
        """A request whose wait in D's line made it miss (failed there)."""
        self._held.line_misses.append(self.clock())

    def rejected(self, ttft_missed: bool, tbt_missed: bool, line_missed: bool = False) -> None:
        """An early rejection, by what its prediction missed (`line_missed`: the
        TTFT, only for its wait in D's line; `ttft_missed` then False)."""
        now_s = self.clock()
        for missed, times in ((ttft_missed, self._held.rejected_ttft), (tbt_missed, self._held.rejected_tbt),
                              (line_missed, self._held.line_misses)):
            if missed:
                times.append(now_s)

    def routed(self, worker_ids: Iterable[str | None]) -> None:
        for worker_id in worker_ids:
            if worker_id is not None:
                self._routed[worker_id] = self._routed.get(worker_id, 0) + 1

    def report(self, inflight: Iterable, draining: Iterable[str] = ()) -> SchedulerReport:
        """What accumulated since the last report (then cleared), with the backlog
        and in-flight counts of `inflight` (cluster.admission.InFlight records) and
        the workers the scheduler already treats as draining."""
        backlog: dict[str, int] = {}
        prompts: dict[str, int] = {}
        counts: dict[str, int] = {}
        decoding: dict[str, int] = {}
        decoding_kv: dict[str, int] = {}
        for request in inflight:
            if request.in_prefill:
                # In its handshake (maybe waiting in D's line): no P's work yet.
                in_handshake = request.prefill_id is not None and request.reserved_s is None
                if not in_handshake:
                    _add(backlog, request.prefill_id or request.decode_id,
                         request.num_prompt_tokens - request.num_cached_tokens)
                    _add(prompts, request.prefill_id or request.decode_id, 1)
            else:
                _add(decoding, request.decode_id, 1)
                _add(decoding_kv, request.decode_id, request.num_prompt_tokens + request.num_generated)
            for worker_id in {request.prefill_id if request.in_prefill else None, request.decode_id} - {None}:
                _add(counts, worker_id, 1)
        held = self._held.since(self.clock() - self.hold_s)
        report = SchedulerReport(
            self.replica_id, ttft_s=held.values(held.ttft), tbt_s=held.values(held.tbt),
            num_rejected_ttft=len(held.rejected_ttft), num_rejected_tbt=len(held.rejected_tbt),
            num_line_misses=len(held.line_misses), backlog_tokens=backlog, decoding=decoding,
            decoding_kv_tokens=decoding_kv, inflight=counts,
            routed=dict(self._routed), draining=frozenset(draining), backlog_prompts=prompts)
        self._held, self._routed, self._sent = _Held(), {}, (report, held)
        return report

    def put_back(self, report: SchedulerReport) -> None:
        """A report the pool manager did not get: its outcomes go with the next
        (they were lost, a second's worth each time a pool manager restarted),
        as long as `hold_s` allows; the latest `MAX_SAMPLES_HELD` of each kind,
        however long it stays away."""
        if self._sent is not None and self._sent[0] is report:
            held = self._sent[1]
        else:  # (one this recorder did not make: its outcomes as of now)
            now_s = self.clock()
            held = _Held([(now_s, v) for v in report.ttft_s], [(now_s, v) for v in report.tbt_s],
                         [now_s] * report.num_rejected_ttft, [now_s] * report.num_rejected_tbt,
                         [now_s] * report.num_line_misses)
        self._held = held.joined(self._held)
        for worker_id, count in report.routed.items():
            _add(self._routed, worker_id, count)


@dataclass
class _Held:
    """Outcomes with when each was recorded: TTFTs and TBTs (at, seconds), and the
    times of early rejections by what they missed, and of line misses."""

    ttft: list[tuple[float, float]] = field(default_factory=list)
    tbt: list[tuple[float, float]] = field(default_factory=list)
    rejected_ttft: list[float] = field(default_factory=list)
    rejected_tbt: list[float] = field(default_factory=list)
    line_misses: list[float] = field(default_factory=list)

    def since(self, since_s: float) -> _Held:
        def timed(outcomes):
            return [o for o in outcomes if o[0] >= since_s]

        def times(recorded):
            return [t for t in recorded if t >= since_s]

        return _Held(timed(self.ttft), timed(self.tbt), times(self.rejected_ttft), times(self.rejected_tbt),
                     times(self.line_misses))

    def joined(self, later: _Held) -> _Held:
        """Both, the latest `MAX_SAMPLES_HELD` of each latency kind (the counts' times whole: 15,000
        rejections put back were counted as 10,000)."""
        return _Held([*self.ttft, *later.ttft][-MAX_SAMPLES_HELD:], [*self.tbt, *later.tbt][-MAX_SAMPLES_HELD:],
                     self.rejected_ttft + later.rejected_ttft, self.rejected_tbt + later.rejected_tbt,
                     self.line_misses + later.line_misses)

    @staticmethod
    def values(outcomes: list[tuple[float, float]]) -> tuple[float, ...]:
        return tuple(seconds for _, seconds in outcomes)


def _add(counter: dict[str, int], key: str, value: int) -> None:
    counter[key] = counter.get(key, 0) + value


@dataclass
class _Replica:
    last_s: float
    report: SchedulerReport


FRESH_S = 5.0  # a replica silent longer (it reports about every second) no longer counts in the load


class SignalBook:
    def __init__(self, ttft_slo_s: float, tbt_slo_s: float, window_s: float, stale_after_s: float = 30.0) -> None:
        self.slo_s = {"ttft": ttft_slo_s, "tbt": tbt_slo_s}
        self.window_s = window_s
        self.stale_after_s = stale_after_s
        self._outcomes: dict[str, deque[tuple[float, bool]]] = {figure: deque() for figure in FIGURES}
        self._replicas: dict[str, _Replica] = {}

    def add(self, report: SchedulerReport, now_s: float) -> None:
        self._replicas[report.replica_id] = _Replica(now_s, report)
        for figure, values, rejected in (("ttft", report.ttft_s, report.num_rejected_ttft),
                                         ("tbt", report.tbt_s,
                                          report.num_rejected_tbt + report.num_line_misses)):
            window = self._outcomes[figure]
            window.extend((now_s, value <= self.slo_s[figure]) for value in values)
            window.extend((now_s, False) for _ in range(rejected))
        self._prune(now_s)

    def _prune(self, now_s: float) -> None:
        for window in self._outcomes.values():
            while window and window[0][0] < now_s - self.window_s:
                window.popleft()
        for replica_id in [r for r, rep in self._replicas.items() if now_s - rep.last_s > self.stale_after_s]:
            del self._replicas[replica_id]

    def attainment(self, figure: str, now_s: float, since_s: float, min_samples: int) -> tuple[float | None, int]:
        """(fraction of outcomes meeting the SLO, how many) over the window, counting
        only outcomes after `since_s`; the fraction is None below `min_samples`."""
        self._prune(now_s)
        met = [ok for at_s, ok in self._outcomes[figure] if at_s >= since_s]
        if len(met) < min_samples:
            return None, len(met)
        return sum(met) / len(met), len(met)

    def _reporting(self, now_s: float) -> list[_Replica]:
        """The replicas that reported within `FRESH_S`: the load is theirs. One
        that stopped (Serve replaced it, it crashed) stops counting long before
        it is forgotten; its last backlog scaled the prefill pool up for 30 s."""
        self._prune(now_s)
        return [rep for rep in self._replicas.values() if now_s - rep.last_s <= FRESH_S]

    def backlog_tokens(self, worker_ids: Iterable[str], now_s: float) -> int:
        ids = set(worker_ids)
        return sum(tokens for rep in self._reporting(now_s)
                   for worker_id, tokens in rep.report.backlog_tokens.items() if worker_id in ids)

    def inflight(self, worker_id: str, now_s: float) -> int:
        return sum(rep.report.inflight.get(worker_id, 0) for rep in self._reporting(now_s))

    def peer_load(self, replica_id: str, now_s: float) -> PeerLoad:
        """The load of every replica but `replica_id` that reports (`_reporting`)."""
        load = PeerLoad()
        for rep in self._reporting(now_s):
            if rep.report.replica_id == replica_id:
                continue
            report = rep.report
            for total, part in ((load.backlog_tokens, report.backlog_tokens), (load.decoding, report.decoding),
                                (load.decoding_kv_tokens, report.decoding_kv_tokens), (load.inflight, report.inflight),
                                (load.backlog_prompts, report.backlog_prompts)):
                for worker_id, value in part.items():
                    _add(total, worker_id, value)
        return load

    def released(self, worker_id: str, now_s: float) -> bool:
        """True when every live replica reports the worker as draining (so routes
        nothing new to it) and has no request in flight there. No live replica: True.
        A replica silent past `FRESH_S` still counts here, until it is forgotten:
        a drain may wait a little longer, its requests must not be cut."""
        self._prune(now_s)
        return all(worker_id in rep.report.draining and not rep.report.inflight.get(worker_id)
                   for rep in self._replicas.values())
