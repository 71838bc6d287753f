"""The autoscaler's signals: per-request outcomes on the scheduler side, the
windowed attainment and per-worker figures on the pool manager's side (injected
clock, no Ray)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cluster.admission import InFlight
from cluster.scaling_signals import OutcomeRecorder, PeerLoad, SchedulerReport, SignalBook


def test_a_request_gives_its_ttft_and_mean_tbt():
    recorder = OutcomeRecorder("r1")
    timer = recorder.timer(started_s=10.0)
    timer.tokens(1, 10.5)  # first token 0.5 s after the start
    timer.tokens(0, 10.6)  # an event without tokens changes nothing
    timer.tokens(2, 10.9)  # two tokens in one event share a time
    timer.tokens(1, 11.1)
    timer.end("ok", 11.1)
    report = recorder.report([])
    assert report.ttft_s == (0.5,)
    assert report.tbt_s == (pytest.approx((11.1 - 10.5) / 3),)
    assert recorder.report([]).ttft_s == ()  # taken: the next report starts empty


def test_failures_and_cancellations():
    recorder = OutcomeRecorder("r1", ttft_slo_s=1.0)
    recorder.timer(0.0).end("error", 0.1)  # failed before its first token: a TTFT miss
    recorder.timer(0.0).end("cancelled", 0.9)  # its client left within the SLO: no outcome
    recorder.timer(0.0).end("cancelled", 1.5)  # ... after it, waiting for its first token: a miss
    recorder.timer(0.0).end("aborted", 1.5)  # (by /abort_request: no outcome)
    served = recorder.timer(0.0)
    served.tokens(1, 0.1)
    served.end("cancelled", 3.0)  # left after its first token: no outcome
    one_token = recorder.timer(0.0)
    one_token.tokens(1, 0.2)
    one_token.end("ok", 0.2)  # one token: a TTFT, no TBT
    failed_late = recorder.timer(0.0)  # failed after its first token (timed out, its D died): a TBT miss
    failed_late.tokens(1, 0.3)
    failed_late.end("error", 0.4)
    recorder.rejected(ttft_missed=True, tbt_missed=False)
    report = recorder.report([])
    assert report.ttft_s == (math.inf, 1.5, 0.1, 0.2, 0.3) and report.tbt_s == (math.inf,)
    assert (report.num_rejected_ttft, report.num_rejected_tbt) == (1, 0)


def test_a_wait_in_ds_line_is_the_decode_pools_not_the_prefill_pools():
    """A TTFT the decode worker's line made late (it waited there for KV room):
    the prefill pool's outcome is the TTFT less that wait, and a miss the wait
    alone made counts against the decode pool; so does an early rejection for a
    predicted wait. All were the prefill pool's misses: a decode pool short of
    room scaled the prefill pool up, and could itself read as idle."""
    recorder = OutcomeRecorder("r1", ttft_slo_s=1.0)
    waited = recorder.timer(0.0)
    waited.attempt_started(InFlight("w", "p0", "d0", 10, 1, 0.1, admitted_s=0.0, reserved_s=1.2))
    waited.tokens(1, 1.5)  # 1.5 s, 1.2 of it in D's line: P's part 0.3 s, a line miss
    slow_anyway = recorder.timer(0.0)
    slow_anyway.attempt_started(InFlight("s", "p0", "d0", 10, 1, 0.1, admitted_s=0.0, reserved_s=0.5))
    slow_anyway.tokens(1, 2.5)  # P's own part 2 s: P's miss
    recorder.rejected(ttft_missed=False, tbt_missed=False, line_missed=True)
    report = recorder.report([])
    assert report.ttft_s == (pytest.approx(0.3), pytest.approx(2.0)) and report.num_line_misses == 2
    book = SignalBook(ttft_slo_s=1.0, tbt_slo_s=0.1, window_s=30)
    book.add(report, now_s=5.0)
    assert book.attainment("ttft", 5.0, 0.0, 1) == (0.5, 2)
    assert book.attainment("tbt", 5.0, 0.0, 1) == (0.0, 2)  # (the two line misses)
    assert InFlight("a", "p0", "d0", 10, 1, 0.1, admitted_s=2.0, reserved_s=3.5).waited_in_line_s(9.0) == 1.5
    assert InFlight("b", "p0", "d0", 10, 1, 0.1, admitted_s=2.0).waited_in_line_s(9.0) == 7.0  # (still waiting)
    assert InFlight("c", None, "c0", 10, 1, 0.1, admitted_s=2.0).waited_in_line_s(9.0) == 0.0  # (colocated)


def test_a_line_wait_over_attempts_and_one_that_ended_in_line_are_the_decode_pools():
    """An attempt refused in D's line (no room within its handshake's wait) and
    retried: its wait counts with the next one's; a request whose last attempt
    failed in the line, and one whose client left while it waited there, are
    line misses, not the prefill pool's."""
    recorder = OutcomeRecorder("r1", ttft_slo_s=1.0)
    attempt = lambda admitted_s, reserved_s=None: InFlight("a", "p0", "d0", 10, 1, 0.1,  # noqa: E731
                                                            admitted_s=admitted_s, reserved_s=reserved_s)
    retried = recorder.timer(0.0)
    retried.attempt_started(attempt(0.0))
    retried.attempt_ended(0.9)  # refused in the line after 0.9 s, retried
    retried.attempt_started(attempt(1.0, reserved_s=1.3))
    retried.tokens(1, 1.4)  # served: 1.4 s, 1.2 of it in lines
    retried.attempt_ended(1.4)
    refused = recorder.timer(0.0)
    refused.attempt_started(attempt(0.0))
    refused.attempt_ended(1.5)
    refused.end("error", 1.5)
    left = recorder.timer(0.0)
    left.attempt_started(attempt(0.2))
    left.attempt_ended(2.0)  # its client left after 2 s, 1.8 of them in the line
    left.end("cancelled", 2.0)
    report = recorder.report([])
    assert report.ttft_s == (pytest.approx(0.2), pytest.approx(0.2)) and report.num_line_misses == 3


def test_report_counts_backlog_inflight_and_routing():
    recorder = OutcomeRecorder("r1")
    recorder.routed(["p0", "d0"])
    recorder.routed(["p0", "d1"])
    inflight = [InFlight("a", "p0", "d0", 300, 10, 0.1, reserved_s=0.5),
                InFlight("b", "p0", "d1", 200, 10, 0.1, reserved_s=0.5),
                InFlight("c", "p1", "d1", 50, 10, 0.1, reserved_s=0.5, first_token_s=1.0),  # P is done with it
                InFlight("d", "p1", "d0", 70, 10, 0.1)]  # in its handshake (D's line): not P's work yet
    report = recorder.report(inflight, draining=["d1"])
    assert report.backlog_tokens == {"p0": 500}
    assert report.inflight == {"p0": 2, "p1": 1, "d0": 2, "d1": 2}
    assert report.routed == {"p0": 2, "d0": 1, "d1": 1}
    assert report.draining == frozenset({"d1"})


def test_a_prefill_backlog_counts_the_tokens_p_computes_not_its_cached_prefix():
    """Two turns of a 3,000-token chat, each with 2,900 tokens cached on P, read
    as a backlog of 6,000 tokens (over `prefill_backlog_up_tokens`, 4,096): the
    pool scaled up for 200 tokens of work."""
    inflight = [InFlight(f"turn{k}", "p0", "d0", 3000, 10, 0.1, reserved_s=0.5, num_cached_tokens=2900)
                for k in range(2)]
    assert OutcomeRecorder("r1").report(inflight).backlog_tokens == {"p0": 200}


def _book() -> SignalBook:
    return SignalBook(ttft_slo_s=1.0, tbt_slo_s=0.1, window_s=30.0, stale_after_s=10.0)


def test_attainment_over_the_window_with_rejections_as_misses():
    book = _book()
    book.add(SchedulerReport("r1", ttft_s=(0.5, 0.9, 2.0), tbt_s=(0.05,), num_rejected_ttft=1), now_s=0.0)
    assert book.attainment("ttft", 1.0, since_s=-math.inf, min_samples=4) == (0.5, 4)
    assert book.attainment("tbt", 1.0, since_s=-math.inf, min_samples=4) == (None, 1)  # too few
    book.add(SchedulerReport("r1", ttft_s=(0.1,) * 4), now_s=20.0)
    assert book.attainment("ttft", 20.0, -math.inf, 4) == (pytest.approx(6 / 8), 8)
    assert book.attainment("ttft", 20.0, since_s=10.0, min_samples=4) == (1.0, 4)  # only after a change
    assert book.attainment("ttft", 40.0, -math.inf, 1) == (1.0, 4)  # the first report left the window


def test_backlog_and_inflight_sum_over_live_replicas():
    book = _book()
    book.add(SchedulerReport("r1", backlog_tokens={"p0": 100, "p1": 50}, inflight={"p0": 1, "d0": 2}), 2.0)
    book.add(SchedulerReport("r2", backlog_tokens={"p0": 10}, inflight={"d0": 1}), 5.0)
    assert book.backlog_tokens(["p0"], 6.0) == 110
    assert book.inflight("d0", 6.0) == 3
    # r1 goes silent: past FRESH_S its load no longer counts (and after 10 s it is forgotten).
    book.add(SchedulerReport("r2", backlog_tokens={"p0": 10}, inflight={}), 12.0)
    assert book.backlog_tokens(["p0", "p1"], 12.0) == 10 and book.inflight("d0", 12.0) == 0


def test_a_worker_is_released_once_every_replica_knows_it_drains_and_has_nothing_there():
    book = _book()
    assert book.released("d1", 0.0)  # no scheduler at all
    book.add(SchedulerReport("r1", inflight={"d1": 1}, draining=frozenset({"d1"})), 1.0)
    book.add(SchedulerReport("r2", draining=frozenset()), 1.0)
    assert not book.released("d1", 1.5)  # r1 still has a request there; r2 has not seen the drain
    book.add(SchedulerReport("r1", draining=frozenset({"d1"})), 2.0)
    assert not book.released("d1", 2.5)
    book.add(SchedulerReport("r2", draining=frozenset({"d1"})), 3.0)
    assert book.released("d1", 3.5)


def test_report_counts_what_decodes_and_colocated_prefills():
    inflight = [InFlight("a", None, "c0", 100, 10, 0.1), InFlight("b", None, "c0", 40, 10, 0.1, first_token_s=1.0,
                                                                   num_generated=5),
                InFlight("c", "p0", "d0", 30, 10, 0.1, first_token_s=1.0, num_generated=2)]
    report = OutcomeRecorder("r1").report(inflight)
    assert report.backlog_tokens == {"c0": 100}
    assert report.decoding == {"c0": 1, "d0": 1} and report.decoding_kv_tokens == {"c0": 45, "d0": 32}


def test_each_replica_is_told_the_others_fresh_load():
    book = _book()
    book.add(SchedulerReport("r1", backlog_tokens={"p0": 100}, decoding={"d0": 2}, decoding_kv_tokens={"d0": 300},
                             inflight={"p0": 1, "d0": 2}), 0.0)
    book.add(SchedulerReport("r2", backlog_tokens={"p0": 10}, decoding={"d0": 1}, decoding_kv_tokens={"d0": 50},
                             inflight={"d0": 1}), 3.0)
    book.add(SchedulerReport("r3"), 4.0)
    assert book.peer_load("r3", 4.0) == PeerLoad({"p0": 110}, {"d0": 3}, {"d0": 350}, {"p0": 1, "d0": 3})
    assert book.peer_load("r1", 4.0) == PeerLoad({"p0": 10}, {"d0": 1}, {"d0": 50}, {"d0": 1})
    assert book.peer_load("r3", 6.0) == PeerLoad({"p0": 10}, {"d0": 1}, {"d0": 50}, {"d0": 1})  # r1 not fresh
    assert book.peer_load("only", 9.5) == PeerLoad()


def test_a_replica_that_stopped_reporting_stops_counting_in_the_load_but_still_holds_its_drains():
    """A crashed or replaced replica's last backlog counted for the 30 s until it
    was forgotten: the prefill pool scaled up for load that was gone. It now
    stops counting after FRESH_S, like the peers' load; a drain still waits for it."""
    book = _book()
    book.add(SchedulerReport("gone", backlog_tokens={"p0": 20000}, inflight={"p0": 1, "d0": 1},
                             draining=frozenset({"d0"})), 0.0)
    book.add(SchedulerReport("live"), 1.0)
    assert book.backlog_tokens(["p0"], 1.0) == 20000 and book.inflight("p0", 1.0) == 1
    book.add(SchedulerReport("live"), 12.0)
    assert book.backlog_tokens(["p0"], 12.0) == 0 and book.inflight("p0", 12.0) == 0
    assert not book.released("d0", 12.0)  # its request there may still run


def test_a_report_the_pool_manager_did_not_get_goes_with_the_next():
    """Cleared as it was made, a report lost on its way (a pool manager
    restarting) lost its outcomes; put back, the next carries them, bounded."""
    from cluster.scaling_signals import MAX_SAMPLES_HELD

    recorder = OutcomeRecorder("r1")
    timer = recorder.timer(0.0)
    timer.tokens(1, 0.4)
    timer.end("ok", 0.4)
    recorder.rejected(ttft_missed=True, tbt_missed=True)
    recorder.routed(["p0", "d0"])
    lost = recorder.report([])
    later = recorder.timer(1.0)
    later.tokens(1, 1.2)
    later.end("ok", 1.2)
    recorder.put_back(lost)
    report = recorder.report([])
    assert report.ttft_s == (0.4, pytest.approx(0.2)) and (report.num_rejected_ttft, report.num_rejected_tbt) == (1, 1)
    assert report.routed == {"p0": 1, "d0": 1}
    recorder.put_back(dataclasses.replace(report, ttft_s=(1.0,) * (MAX_SAMPLES_HELD + 5)))
    assert len(recorder.report([]).ttft_s) == MAX_SAMPLES_HELD


def test_outcomes_held_longer_than_the_window_are_not_reported_as_now():
    """Found by a review: held through an outage of minutes, they were stamped
    with the report's arrival, and an idle pool scaled up on an overload long over."""
    now = [10.0]
    recorder = OutcomeRecorder("r1", ttft_slo_s=1.0, hold_s=30.0, clock=lambda: now[0])
    for _ in range(40):
        recorder.record_ttft(5.0)
    recorder.rejected(ttft_missed=True, tbt_missed=False)
    lost = recorder.report([])
    assert len(lost.ttft_s) == 40 and lost.num_rejected_ttft == 1
    now[0] = 20.0
    recorder.put_back(lost)
    again = recorder.report([])
    assert len(again.ttft_s) == 40  # (within the window still: carried)
    recorder.put_back(again)  # (lost too)
    now[0] = 600.0
    recorder.record_ttft(0.5)
    late = recorder.report([])
    assert late.ttft_s == (0.5,) and late.num_rejected_ttft == 0


def test_counts_put_back_are_whole():
    """Found by a review of the session's own change: the rejections' times were
    bounded as the latencies are, and 15,000 put back were counted as 10,000."""
    recorder = OutcomeRecorder("r1")
    for _ in range(15_000):
        recorder.rejected(ttft_missed=True, tbt_missed=False)
    recorder.put_back(recorder.report([]))
    recorder.rejected(ttft_missed=True, tbt_missed=False)
    assert recorder.report([]).num_rejected_ttft == 15_001
