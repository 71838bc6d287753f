"""Admission's predictions around the requests already in flight (no Ray): which
D a P is paired with, the prefix a request in prefill leaves cached, whom D's
batch holds when a new request joins it, and when a request that waited in D's
line is due. Each once refused a request (429) that a pair could serve."""

from __future__ import annotations

import pytest

from actors.block_pool import block_hashes
from actors.messages import ChunkTiming
from cluster.admission import InFlight, SloRejected
from tests.scheduler_setup import idle_stats, make_scheduler


def test_a_p_is_paired_with_the_d_that_meets_the_slo_not_the_least_busy_one():
    """d0 is idle but its link from p0 is slow (0.4 s a chunk); d1 decodes one
    request and takes p0's chunks in 1 ms: only p0 -> d1 meets the TTFT SLO."""
    scheduler = make_scheduler(ttft_ms=500, decodes=("d0", "d1"))
    models = scheduler.view.models
    models.seed_from("d0", "d1")
    models.transfers.observe("p0", "d0", [ChunkTiming(0, 2, 0, 0.0, 0, 0.4)])
    models.transfers.observe("p0", "d1", [ChunkTiming(0, 2, 0, 0.0, 0, 0.001)])
    decoding = InFlight("x", "p0", "d1", 16, 1000, predicted_ttft_s=0.0)
    decoding.reserved_s = decoding.first_token_s = 0.0
    models.inflight["x"] = decoding
    prompt = list(range(300))  # 0.3 s of prefill on p0
    assert not models.predict("p0", "d0", len(prompt), 0).meets(0.5, 1.0)
    choice = scheduler.plan(prompt)
    assert (choice.prefill_id, choice.decode_id) == ("p0", "d1") and choice.ttft_s < 0.5


def test_a_prompt_waiting_in_a_ds_line_is_not_read_as_cached_on_its_p():
    """A waits 20 s in d0's line, so p0 has not begun its prompt: B, the same
    2000-token prompt (2 s of prefill) for d1, which has room, computes all of it."""
    scheduler = make_scheduler(ttft_ms=1000, decodes=("d0", "d1"))
    scheduler.view.models.seed_from("d0", "d1")
    prompt = list(range(2000))
    usable = scheduler._usable(block_hashes(prompt, 16, b""), len(prompt))
    scheduler.view.stats["d0"] = idle_stats("d0", num_used_blocks=1000, num_waiting_handshakes=5)
    waiting = InFlight("A", "p0", "d0", len(prompt), 100, predicted_ttft_s=22.0, line_wait_s=20.0,
                       prefix_hashes=tuple(usable))
    scheduler.view.models.inflight["A"] = waiting
    assert scheduler.view.cached_tokens("p0", usable) == 0
    with pytest.raises(SloRejected, match="predicted TTFT 2000 ms"):
        scheduler.plan(prompt)
    waiting.reserved_s = waiting.admitted_s  # D reserved it: p0 computes it now, B will find it cached
    assert scheduler.view.cached_tokens("p0", usable) == len(usable) * 16


def test_requests_in_prefill_that_end_before_a_new_one_joins_are_not_in_its_batch():
    """20 requests of 4 tokens, due on d0 within 50 ms, are long done when a prompt
    of 3 s of prefill joins d0's batch: its TBT is the same whether they are still
    in prefill or already decoding."""
    prompt = list(range(3000))
    for decoding in (False, True):
        scheduler = make_scheduler(ttft_ms=10_000, tbt_ms=100)
        for index in range(20):
            short = InFlight(f"r{index}", "p0", "d0", 32, 4, predicted_ttft_s=0.05)
            if decoding:
                short.reserved_s = short.first_token_s = short.admitted_s
                short.num_generated = 1
            scheduler.view.models.inflight[short.request_id] = short
        assert scheduler.view.models.tbt_at("d0", 3.0, len(prompt)) == pytest.approx(0.01)
        assert scheduler.plan(prompt).tbt_s == pytest.approx(0.01)


def test_a_request_reserved_after_its_wait_in_line_is_due_after_its_own_prefill_not_the_old_queue_again():
    """A was admitted at t=100 behind 2 s of p0's queue, predicted to wait 5 s in
    d0's line; D reserves it at t=105, when that queue is long done: p0 is busy
    0.3 s more with A's own prefill, not 2.3 s."""
    now = [105.0]
    scheduler = make_scheduler(ttft_ms=2000)
    models = scheduler.view.models
    models.clock = lambda: now[0]
    waited = InFlight("A", "p0", "d0", 300, 10, predicted_ttft_s=7.3, line_wait_s=5.0, own_s=0.3, admitted_s=100.0)
    waited.reserved_s = 105.0
    models.inflight["A"] = waited
    assert waited.first_token_due_s == pytest.approx(105.3)
    assert models.queued_prefill_s("p0") == pytest.approx(0.3)
    assert scheduler.plan(list(range(300))).ttft_s == pytest.approx(0.6)
    waited.reserved_s = 101.0  # reserved sooner than predicted, while p0's queue still ran: due after it
    assert waited.first_token_due_s == pytest.approx(102.3)
