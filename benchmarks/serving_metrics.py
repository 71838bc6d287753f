"""Serving metrics from the client's request records: latency percentiles,
throughput, SLO attainment and goodput. Plain Python (no numpy).

Definitions (times measured at the client, see `benchmarks/http_client.py`):
- TTFT: from sending a request to its first output token (queueing, prefill, KV
  transfer and HTTP included). p50/p90/p99 over the requests that finished `ok`.
- TBT (inter-token latency): every gap between consecutive events that brought
  a request output tokens (one a token where each event brings one; an event of
  several tokens is one gap, as vLLM's ITL counts it); p50/p90/p99 over all gaps
  of all `ok` requests (so a long stall counts once per request it stalled).
- A request's own TBT, the statistic its SLO is judged on (`tbt_stat`):
  `mean` = (last token time - first token time) / (n - 1), DistServe's TPOT (the
  default); `p90` = the 90th percentile of its gaps; `max` = its longest gap. A
  one-token request meets any TBT SLO.
- Attainment: the fraction of *offered* requests that finished `ok` with TTFT <=
  the TTFT SLO and request TBT <= the TBT SLO. Rejected (429), failed and timed-out
  requests count as misses. `attainment_admitted` is the same over the requests
  that were not rejected (what an admitted user experiences).
- Cached fraction: prompt tokens served from a prefix cache / prompt tokens, over
  `ok` requests.
- Throughput: `ok` requests, and their output tokens, per second of makespan (from
  the first send to the last end of any request: a timeout or an error ends at
  its end too, as the run's wall time does in vLLM's and SGLang's benchmarks).
- Goodput at one load: requests that attained the SLO per second of the offered
  window (`window_s`; the benchmarks pass number of requests / offered rate).
- Goodput (DistServe): the highest offered rate at which the attainment target is
  met. Found from a sweep over rates (`goodput`): rates are walked in increasing
  order until the first that misses the target; the goodput is where attainment
  crosses the target, interpolated linearly between the last rate that met it and
  that first miss. If every rate meets the target the goodput is at least the
  highest rate (`above_sweep`); if the lowest rate misses it, it is below the
  sweep and reported as 0 (`below_sweep`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from benchmarks.http_client import RequestRecord
from benchmarks.report import percentile

TBT_STATS = ("mean", "p90", "max")
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tbt_s: float
    attainment: float = 0.9  # the target fraction of requests
    tbt_stat: str = "mean"

    def __post_init__(self):
        if self.tbt_stat not in TBT_STATS:
            raise ValueError(f"tbt_stat must be one of {TBT_STATS}, got {self.tbt_stat!r}")


def request_tbt_s(record: RequestRecord, stat: str = "mean") -> float | None:
    """One request's TBT by `stat`; None for fewer than two events that brought
    tokens (`RequestRecord.gaps_s`)."""
    gaps = record.gaps_s
    if not gaps:
        return None
    if stat == "mean":
        times = record.token_times_s
        return (times[-1] - times[0]) / (len(times) - 1)
    if stat == "p90":
        return percentile(gaps, 90)
    if stat == "max":
        return max(gaps)
    raise ValueError(f"tbt_stat must be one of {TBT_STATS}, got {stat!r}")


def attains(record: RequestRecord, slo: Slo, stat: str | None = None) -> bool:
    if record.status != "ok" or record.ttft_s is None or record.ttft_s > slo.ttft_s:
        return False
    tbt = request_tbt_s(record, stat or slo.tbt_stat)
    return tbt is None or tbt <= slo.tbt_s


def attainment(records: Sequence[RequestRecord], slo: Slo, stat: str | None = None) -> float:
    """Fraction of offered requests that met both SLOs (0.0 for none offered)."""
    return sum(attains(r, slo, stat) for r in records) / len(records) if records else 0.0


def percentiles(values: Sequence[float], qs: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    return {f"p{q:g}": (percentile(values, q) if values else None) for q in qs}


def summarize(records: Sequence[RequestRecord], slo: Slo, window_s: float) -> dict:
    """Every figure of one run at one load. `window_s`: the offered window."""
    ok = [r for r in records if r.status == "ok"]
    admitted = [r for r in records if r.status != "rejected"]
    gaps = [g for r in ok for g in r.gaps_s]
    ends = [r.ended_s if r.ended_s is not None else r.sent_s + r.e2e_s for r in records
            if r.ended_s is not None or r.e2e_s is not None]
    sends = [r.sent_s for r in records if r.sent_s is not None]
    makespan = (max(ends) - min(sends)) if ends and ok else 0.0
    num_attained = sum(attains(r, slo) for r in records)
    by_stat = {stat: attainment(records, slo, stat) for stat in TBT_STATS}
    return {
        "num_requests": len(records),
        "status": dict(Counter(r.status for r in records)),
        "ttft_s": percentiles([r.ttft_s for r in ok]),
        "tbt_s": percentiles(gaps),
        "request_tbt_s": {stat: percentiles([t for r in ok if (t := request_tbt_s(r, stat)) is not None])
                          for stat in TBT_STATS},
        "e2e_s": percentiles([r.e2e_s for r in ok]),
        "attainment": by_stat[slo.tbt_stat],
        "attainment_by_tbt_stat": by_stat,
        "attainment_admitted": attainment(admitted, slo),
        "rejected_fraction": 1 - len(admitted) / len(records) if records else 0.0,
        "cached_fraction": (sum(r.num_cached_tokens for r in ok) / sum(r.num_prompt_tokens for r in ok)) if ok else 0.0,
        "throughput_req_s": len(ok) / makespan if makespan else 0.0,
        "throughput_tok_s": sum(r.num_output_tokens for r in ok) / makespan if makespan else 0.0,
        "goodput_req_s": num_attained / window_s if window_s > 0 else None,
        "makespan_s": makespan,
    }


# ---- goodput from a rate sweep ------------------------------------------------------
@dataclass(frozen=True)
class Goodput:
    rate: float  # req/s; 0.0 when even the lowest rate misses the target
    kind: str  # "interpolated" | "above_sweep" | "below_sweep"
    last_met: float | None  # the highest rate (before the first miss) that met the target
    first_missed: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def goodput(points: Sequence[tuple[float, float]], target: float) -> Goodput:
    """DistServe goodput from (offered rate, attainment) points; see the module
    docstring. Raises ValueError on no points."""
    if not points:
        raise ValueError("goodput of an empty sweep")
    ordered = sorted(points)
    met: tuple[float, float] | None = None
    for rate, achieved in ordered:
        if achieved >= target:
            met = (rate, achieved)
            continue
        if met is None:
            return Goodput(0.0, "below_sweep", None, rate)
        (r0, a0), (r1, a1) = met, (rate, achieved)
        crossing = r0 + (a0 - target) / (a0 - a1) * (r1 - r0)
        return Goodput(crossing, "interpolated", r0, r1)
    return Goodput(ordered[-1][0], "above_sweep", ordered[-1][0], None)


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted values and their empirical CDF (i / n), for plotting."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]
