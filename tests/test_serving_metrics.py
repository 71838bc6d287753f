"""Unit tests of the serving metrics: percentiles, per-request TBT, attainment and
DistServe goodput on synthetic traces whose answers are known (no timings)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from benchmarks.http_client import RequestRecord
from benchmarks.report import percentile
from benchmarks.serving_metrics import Slo, attainment, attains, cdf, goodput, request_tbt_s, summarize


def record(ttft_s: float, gaps_s: list[float], status: str = "ok", index: int = 0) -> RequestRecord:
    times = [ttft_s]
    for gap in gaps_s:
        times.append(times[-1] + gap)
    return RequestRecord(index, 16, len(times), 0.0, sent_s=float(index), status=status, http_status=200,
                         ttft_s=ttft_s, e2e_s=times[-1], token_times_s=times)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_matches_numpy(seed, q):
    rng = random.Random(seed)
    values = [rng.expovariate(1.0) for _ in range(rng.randint(1, 500))]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-15)


def test_request_tbt_statistics():
    r = record(1.0, [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 2.0])
    assert request_tbt_s(r, "mean") == pytest.approx(2.9 / 10)
    assert request_tbt_s(r, "p90") == pytest.approx(np.percentile(r.gaps_s, 90))
    assert request_tbt_s(r, "max") == pytest.approx(2.0)
    assert request_tbt_s(record(1.0, []), "mean") is None


def test_attainment_counts_misses_rejections_and_failures():
    slo = Slo(ttft_s=1.0, tbt_s=0.2)
    trace = [
        record(0.5, [0.1, 0.1]),  # meets both
        record(0.5, []),  # one token: meets any TBT SLO
        record(1.5, [0.1]),  # TTFT too slow
        record(0.5, [0.1, 0.5]),  # mean TBT 0.3 > 0.2
        record(0.5, [0.1], status="rejected"),
        record(0.5, [0.1], status="error"),
    ]
    assert [attains(r, slo) for r in trace] == [True, True, False, False, False, False]
    assert attainment(trace, slo) == pytest.approx(2 / 6)
    summary = summarize(trace, slo, window_s=6.0)
    assert summary["attainment_admitted"] == pytest.approx(2 / 5)
    assert summary["rejected_fraction"] == pytest.approx(1 / 6)
    assert summary["goodput_req_s"] == pytest.approx(2 / 6)
    assert summary["status"] == {"ok": 4, "rejected": 1, "error": 1}


def test_tbt_stat_changes_the_verdict_on_a_stall():
    stalled = record(0.5, [0.05] * 98 + [3.0])  # one 3 s stall in 100 tokens
    assert attains(stalled, Slo(1.0, 0.1, tbt_stat="mean"))  # mean 0.079
    assert attains(stalled, Slo(1.0, 0.1, tbt_stat="p90"))
    assert not attains(stalled, Slo(1.0, 0.1, tbt_stat="max"))


def test_summary_percentiles_over_all_gaps():
    trace = [record(0.1 * (i + 1), [0.01 * (i + 1)] * 4, index=i) for i in range(10)]
    summary = summarize(trace, Slo(10.0, 10.0), window_s=10.0)
    gaps = [g for r in trace for g in r.gaps_s]
    assert summary["tbt_s"]["p99"] == pytest.approx(np.percentile(gaps, 99))
    assert summary["ttft_s"]["p50"] == pytest.approx(np.percentile([r.ttft_s for r in trace], 50))
    assert summary["attainment"] == 1.0


def synthetic_sweep(slo: Slo, knee_rate: float, rates: list[float], num_requests: int = 100) -> list[tuple[float, float]]:
    """A system whose TTFT grows with load: at rate r, request i has TTFT
    (r / knee_rate) * (i + 1) / num_requests * slo.ttft_s * 1.2, so the fraction
    meeting the TTFT SLO is min(1, knee_rate / (1.2 r)) up to rounding."""
    points = []
    for rate in rates:
        trace = [record(rate / knee_rate * (i + 1) / num_requests * slo.ttft_s * 1.2, [0.01] * 3, index=i)
                 for i in range(num_requests)]
        points.append((rate, attainment(trace, slo)))
    return points


def test_goodput_on_synthetic_trace_with_known_answer():
    slo = Slo(ttft_s=1.0, tbt_s=0.1, attainment=0.9)
    points = synthetic_sweep(slo, knee_rate=2.0, rates=[0.5, 1.0, 1.5, 2.0, 2.5])
    attained = dict(points)
    assert attained[1.5] == pytest.approx(1.0)
    assert attained[2.0] == pytest.approx(0.83)  # floor(100 / 1.2) / 100
    result = goodput(points, slo.attainment)
    assert result.kind == "interpolated" and (result.last_met, result.first_missed) == (1.5, 2.0)
    assert result.rate == pytest.approx(1.5 + (1.0 - 0.9) / (1.0 - 0.83) * 0.5)


def test_goodput_edges_and_first_miss_ends_the_search():
    assert goodput([(1.0, 0.95), (2.0, 0.95)], 0.9).kind == "above_sweep"
    assert goodput([(1.0, 0.95), (2.0, 0.95)], 0.9).rate == 2.0
    below = goodput([(1.0, 0.5), (2.0, 0.95)], 0.9)
    assert (below.kind, below.rate) == ("below_sweep", 0.0)
    # a noisy late recovery does not raise the goodput past the first miss
    assert goodput([(2.0, 1.0), (1.0, 1.0), (3.0, 0.8), (4.0, 0.95)], 0.9).rate == pytest.approx(2.5)
    with pytest.raises(ValueError):
        goodput([], 0.9)


def test_cdf_is_sorted_and_ends_at_one():
    xs, ys = cdf([3.0, 1.0, 2.0])
    assert xs == [1.0, 2.0, 3.0] and ys == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_slo_rejects_unknown_tbt_stat():
    with pytest.raises(ValueError):
        Slo(1.0, 1.0, tbt_stat="median")


def test_an_event_of_several_tokens_is_one_gap():
    """Found by a review: its k tokens stamped alike made k - 1 zero gaps beside
    one long one, and a request stalled 800 ms between 16-token events read as
    0 ms at p90 (vLLM's ITL counts each event's gap once)."""
    times = [0.5 + 0.8 * (i // 16) for i in range(64)]  # four events of 16 tokens, 0.8 s apart
    r = RequestRecord(0, 16, 64, 0.0, sent_s=0.0, status="ok", ttft_s=0.5, e2e_s=times[-1], token_times_s=times)
    assert r.gaps_s == pytest.approx([0.8] * 3)
    assert request_tbt_s(r, "p90") == pytest.approx(0.8) and request_tbt_s(r, "max") == pytest.approx(0.8)
    assert request_tbt_s(r, "mean") == pytest.approx(2.4 / 63)  # (per token, as DistServe's TPOT)
    assert summarize([r], Slo(ttft_s=1.0, tbt_s=0.1), window_s=1.0)["tbt_s"]["p50"] == pytest.approx(0.8)


def test_the_makespan_ends_with_the_last_request_whatever_its_status():
    """Found by a review: it ended at the last `ok` request's end, so requests
    timed out after it did not lengthen the run, and throughput read high."""
    served = record(0.5, [0.1] * 9)
    served.ended_s = served.sent_s + served.e2e_s
    timed_out = RequestRecord(1, 16, 10, 0.0, sent_s=0.0, status="timeout", ended_s=300.0)
    summary = summarize([served, timed_out], Slo(ttft_s=1.0, tbt_s=0.2), window_s=1.0)
    assert summary["makespan_s"] == pytest.approx(300.0)
    assert summary["throughput_tok_s"] == pytest.approx(10 / 300.0)


def test_the_headline_ratios_are_taken_where_the_contender_last_met_the_target_before_a_miss():
    """Found by a review: the highest rate it met the target at anywhere (0.3,
    past a miss at 0.2) was taken, where the baseline was deep in overload."""
    from types import SimpleNamespace

    from benchmarks.serve import analyse

    slo = Slo(ttft_s=1.0, tbt_s=0.2, attainment=0.9)
    good, bad = record(0.5, [0.1]), record(0.5, [0.1], status="error")
    made = {0.1: [good] * 5, 0.2: [good] * 3 + [bad] * 2, 0.3: [good] * 5}
    records = {"base": {rate: [good] * 5 for rate in made}, "contender": made}
    workloads = {rate: SimpleNamespace(requests=[None] * 5) for rate in made}
    spec = SimpleNamespace(baseline="base", contender="contender")
    assert analyse(spec, records, workloads, slo)["ratios"]["at_rate"] == 0.1


def test_an_engine_run_that_returns_fewer_tokens_than_asked_is_a_failed_run():
    """Found by a review: tokens per second counted the tokens asked for, and a
    run that stopped short got full credit in the headline ratio."""
    from types import SimpleNamespace

    from benchmarks.engine import measure
    from benchmarks.engine_systems import RunResult

    workload = SimpleNamespace(name="w", num_output_tokens=8)
    short = SimpleNamespace(name="short", run=lambda w: RunResult(1.0, [[1, 2, 3]]))
    whole = SimpleNamespace(name="whole", run=lambda w: RunResult(2.0, [[1] * 8]))
    runs = measure([short, whole], [workload])
    assert runs["short"][0].elapsed_s != runs["short"][0].elapsed_s  # (nan: failed)
    assert "returned 3 of the 8 tokens asked" in runs["short"][0].extra["error"]
    assert runs["whole"][0].elapsed_s == 2.0
