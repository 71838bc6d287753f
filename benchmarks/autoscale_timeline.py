"""What `tandem bench autoscale` reports, from the client's request records and the
pool manager's scaling events, on one time axis (seconds from the workload's
start; events are converted from wall-clock time).

- Pool sizes over time (`pool_sizes`): per pool, the workers *serving* (ready, not
  draining), *starting* and *draining*, as step functions of the events.
- Offered load and attainment per bin (`bins`): requests sent per second in each
  `bin_s` bin, and the fraction of those requests that met both SLOs.
- Reaction (`reactions`): for each scale-up after the load step, the times of
  the SLO breach before it, the decision, the new worker ready and the new worker
  serving (its first request). The breach is the first moment after the step at
  which a request missed the SLO that pool serves: for prefill, its send time plus
  the TTFT SLO when its TTFT missed (it was late from then on); for decode, its
  first token time when its TBT missed (a pool cannot act on the other's SLO). Breach to serving is reported as 0 when the new worker served before any
  request missed ("ahead of the breach").
- Oscillation (`scale_downs_after_ups`): per pool, the most scale-downs that
  followed one scale-up within `horizon_s` (goal: at most one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.serving_metrics import Slo, attains, request_tbt_s


@dataclass(frozen=True)
class Event:
    """A scaling event on the workload's clock."""

    t_s: float
    role: str
    kind: str
    worker_id: str | None
    signal: str = ""
    reason: str = ""


def to_events(scaling_events, t0_wall_s: float) -> list[Event]:
    """ScalingEvents (wall clock) -> Events (seconds from `t0_wall_s`)."""
    return [Event(e.time_s - t0_wall_s, e.role, e.kind, e.worker_id, e.signal, e.reason) for e in scaling_events]


def pool_sizes(events: Sequence[Event], roles: Sequence[str]) -> dict[str, list[tuple[float, int, int, int]]]:
    """role -> [(t_s, serving, starting, draining)] after each event of that pool."""
    out: dict[str, list[tuple[float, int, int, int]]] = {role: [] for role in roles}
    state: dict[str, str] = {}  # worker -> starting | serving | draining
    role_of: dict[str, str] = {}
    for event in sorted(events, key=lambda e: e.t_s):
        if event.role not in out or event.worker_id is None:
            continue
        worker = event.worker_id
        if event.kind == "started":
            state[worker], role_of[worker] = "starting", event.role
        elif event.kind == "ready" and state.get(worker) == "starting":
            state[worker] = "serving"
        elif event.kind == "drain_started":
            state[worker] = "draining"
        elif event.kind == "taken_back" and state.get(worker) == "draining":
            state[worker] = "serving"
        elif event.kind in ("drained", "drain_timeout", "died_draining", "died", "start_failed", "replaced"):
            state.pop(worker, None)
        else:
            continue
        mine = [s for w, s in state.items() if role_of.get(w) == event.role]
        out[event.role].append((event.t_s, mine.count("serving"), mine.count("starting"), mine.count("draining")))
    return out


def size_at(steps: Sequence[tuple[float, int, int, int]], t_s: float) -> int:
    """Serving workers at `t_s` from a `pool_sizes` series (0 before the first)."""
    serving = 0
    for at_s, count, _, _ in steps:
        if at_s > t_s:
            break
        serving = count
    return serving


def bins(records, slo: Slo, bin_s: float, end_s: float) -> list[dict]:
    """Per bin of send time: offered req/s, attainment, requests that failed."""
    count = max(1, int(end_s // bin_s) + 1)
    rows = [{"t_s": i * bin_s, "sent": 0, "attained": 0, "failed": 0} for i in range(count)]
    for record in records:
        if record.sent_s is None:
            continue
        row = rows[min(int(record.sent_s // bin_s), count - 1)]
        row["sent"] += 1
        row["attained"] += attains(record, slo)
        row["failed"] += record.status != "ok"
    for row in rows:
        row["offered_req_s"] = row["sent"] / bin_s
        row["attainment"] = row["attained"] / row["sent"] if row["sent"] else None
    return rows


def breach_s(records, slo: Slo, after_s: float, role: str | None = None) -> float | None:
    """The first moment after `after_s` at which a request missed its SLO. For a
    pool (`role`), the SLO that pool serves: TTFT for prefill (the request is late
    from its send time plus the TTFT SLO), TBT for decode (late from its first
    token, when its gaps start). Failed requests count for both."""
    moments = []
    for record in records:
        if record.sent_s is None or record.sent_s < after_s or attains(record, slo):
            continue
        ttft_missed = record.ttft_s is None or record.ttft_s > slo.ttft_s
        tbt = request_tbt_s(record, slo.tbt_stat) if record.ttft_s is not None else None
        tbt_missed = record.status != "ok" or (tbt is not None and tbt > slo.tbt_s)
        if ttft_missed and role != "decode":
            moments.append(record.sent_s + slo.ttft_s)
        elif tbt_missed and role != "prefill":
            moments.append(record.sent_s + (record.ttft_s if record.ttft_s is not None else slo.ttft_s))
    return min(moments) if moments else None


def reactions(events: Sequence[Event], records, slo: Slo, step_s: float) -> list[dict]:
    """Each scale-up decided after the load step, with its timeline."""
    out = []
    ordered = sorted(events, key=lambda e: e.t_s)
    for i, up in enumerate(ordered):
        if up.kind != "up" or up.t_s < step_s:
            continue
        breach = breach_s(records, slo, step_s, up.role if up.role in ("prefill", "decode") else None)
        started = next((e for e in ordered[i:] if e.kind == "started" and e.role == up.role), None)
        worker = started.worker_id if started else None
        ready = next((e.t_s for e in ordered if e.kind == "ready" and e.worker_id == worker), None)
        serving = next((e.t_s for e in ordered if e.kind == "serving" and e.worker_id == worker), None)
        to_serving = None
        if serving is not None:
            to_serving = max(0.0, serving - breach) if breach is not None else 0.0
        out.append({"role": up.role, "worker_id": worker, "signal": up.signal, "reason": up.reason,
                    "breach_s": breach, "decided_s": up.t_s, "ready_s": ready, "serving_s": serving,
                    "step_to_serving_s": None if serving is None else serving - step_s,
                    "breach_to_serving_s": to_serving})
    return out


def scale_downs_after_ups(events: Sequence[Event], horizon_s: float = 60.0) -> dict[str, int]:
    """Per pool: the most scale-down decisions within `horizon_s` after one scale-up."""
    out: dict[str, int] = {}
    for up in (e for e in events if e.kind == "up"):
        downs = sum(1 for e in events
                    if e.kind == "down" and e.role == up.role and up.t_s < e.t_s <= up.t_s + horizon_s)
        out[up.role] = max(out.get(up.role, 0), downs)
    return out
