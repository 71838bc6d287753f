"""The autoscale benchmark's figures from synthetic records and events (no Ray)."""

from __future__ import annotations

import pytest

from benchmarks.autoscale_timeline import (Event, bins, breach_s, pool_sizes, reactions, scale_downs_after_ups,
                                           size_at)
from benchmarks.http_client import RequestRecord
from benchmarks.serving_metrics import Slo

SLO = Slo(ttft_s=1.0, tbt_s=0.1, attainment=0.9)


def record(sent_s: float, ttft_s: float | None, gap_s: float = 0.05, tokens: int = 3, status: str = "ok"):
    r = RequestRecord(0, 100, tokens, sent_s, sent_s=sent_s, status=status, ttft_s=ttft_s)
    if ttft_s is not None:
        r.token_times_s = [ttft_s + i * gap_s for i in range(tokens)]
    return r


EVENTS = [
    Event(-20.0, "prefill", "started", "p0"), Event(-20.0, "decode", "started", "d1"),
    Event(-10.0, "prefill", "ready", "p0"), Event(-10.0, "decode", "ready", "d1"),
    Event(35.0, "prefill", "up", None, "ttft_attainment"), Event(35.1, "prefill", "started", "p2"),
    Event(50.0, "prefill", "ready", "p2"), Event(52.0, "prefill", "serving", "p2"),
    Event(120.0, "prefill", "down", "p2", "idle"), Event(120.1, "prefill", "drain_started", "p2"),
    Event(125.0, "prefill", "drained", "p2"),
]


def test_pool_sizes_follow_the_events():
    sizes = pool_sizes(EVENTS, ["prefill", "decode"])
    assert [size_at(sizes["prefill"], t) for t in (0.0, 40.0, 51.0, 121.0, 130.0)] == [1, 1, 2, 1, 1]
    # (t, serving, starting, draining) after each prefill event
    assert sizes["prefill"] == [(-20.0, 0, 1, 0), (-10.0, 1, 0, 0), (35.1, 1, 1, 0), (50.0, 2, 0, 0),
                                (120.1, 1, 0, 1), (125.0, 1, 0, 0)]
    assert size_at(sizes["decode"], 100.0) == 1
    taken_back = [*EVENTS[:-1], Event(123.0, "prefill", "taken_back", "p2")]  # (a scale-up before it drained)
    assert pool_sizes(taken_back, ["prefill"])["prefill"][-1] == (123.0, 2, 0, 0)


def test_breach_is_the_first_moment_a_request_missed():
    records = [record(5.0, 0.2), record(31.0, 0.3), record(32.0, 2.5), record(33.0, 0.4, gap_s=0.5)]
    # 32.0 + 1.0 (late from its TTFT deadline) vs 33.0 + 0.4 (its first token, TBT too slow).
    assert breach_s(records, SLO, after_s=30.0) == pytest.approx(33.0)
    assert breach_s(records[:2], SLO, after_s=30.0) is None


def test_each_pool_is_timed_from_a_miss_of_the_slo_it_serves():
    late, slow = record(32.0, 2.5), record(33.0, 0.4, gap_s=0.5)  # TTFT missed at 33.0; TBT missed from 33.4
    assert breach_s([late, slow], SLO, after_s=30.0, role="prefill") == pytest.approx(33.0)
    assert breach_s([late, slow], SLO, after_s=30.0, role="decode") == pytest.approx(33.4)
    assert breach_s([late], SLO, after_s=30.0, role="decode") is None
    failed = record(34.0, None, status="error")
    assert breach_s([failed], SLO, after_s=30.0, role="decode") == pytest.approx(35.0)


def test_reaction_times_of_each_scale_up_after_the_step():
    records = [record(31.0, 0.2), record(32.0, 3.0)]
    (r,) = reactions(EVENTS, records, SLO, step_s=30.0)
    assert r["role"] == "prefill" and r["worker_id"] == "p2" and r["signal"] == "ttft_attainment"
    assert (r["breach_s"], r["decided_s"], r["ready_s"], r["serving_s"]) == (33.0, 35.0, 50.0, 52.0)
    assert r["breach_to_serving_s"] == pytest.approx(19.0) and r["step_to_serving_s"] == pytest.approx(22.0)
    (ahead,) = reactions(EVENTS, [record(31.0, 0.2)], SLO, step_s=30.0)
    assert ahead["breach_s"] is None and ahead["breach_to_serving_s"] == 0.0  # scaled before any miss


def test_scale_downs_counted_within_the_horizon_of_a_scale_up():
    flapping = EVENTS + [Event(60.0, "prefill", "down", "p0"), Event(80.0, "prefill", "down", "p3")]
    assert scale_downs_after_ups(EVENTS, 60.0) == {"prefill": 0}  # the down at 120 s is 85 s after the up
    assert scale_downs_after_ups(flapping, 60.0) == {"prefill": 2}


def test_bins_give_offered_load_and_attainment():
    records = [record(1.0, 0.2), record(2.0, 3.0), record(6.0, 0.1), record(7.0, None, status="error")]
    rows = bins(records, SLO, bin_s=5.0, end_s=10.0)
    assert [(r["sent"], r["attainment"], r["failed"]) for r in rows[:2]] == [(2, 0.5, 0), (2, 0.5, 1)]
    assert rows[0]["offered_req_s"] == pytest.approx(0.4) and rows[2]["attainment"] is None
