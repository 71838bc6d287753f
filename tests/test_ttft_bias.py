"""The learned TTFT bias (cluster/admission.py, `WorkerModels.observe_ttft`): what
it learns, how it fades, and where it counts: in admission's SLO check, not in
cache-aware routing's ranking (no Ray)."""

from __future__ import annotations

import time

import pytest

from actors.block_pool import block_hashes
from cluster.admission import WorkerModels
from cluster.pool_manager import Member
from cluster.router import PrefixIndex
from tests.test_admission import _idle_stats, _models, _scheduler


def test_ttft_bias_learns_the_systematic_error_without_compounding():
    models = _models()
    for _ in range(50):
        prediction = models.predict("p0", "d0", num_prompt_tokens=200, cached_tokens=0)
        models.observe_ttft(prediction, observed_s=prediction.ttft_s - prediction.ttft_bias_s + 0.3)
    assert models.ttft_bias("p0") == pytest.approx(0.3, rel=0.01)
    assert models.predict("p0", "d0", 200, 0).ttft_s == pytest.approx(0.2 + 0.3, rel=0.05)
    assert models.ttft_bias("p1") == 0.0


def test_the_ttft_bias_is_the_attainment_quantile_of_the_errors_not_their_mean():
    """Predictions mostly right or pessimistic, one in five 0.5 s short: a mean
    (about 0.04 s) would leave the requests predicted just inside the SLO missing it
    whenever theirs was short; the 90th percentile covers them."""
    models, median = _models(), WorkerModels(block_size=16, ttft_quantile=0.5)
    for built in (models, median):
        for i in range(60):
            prediction = built.predict("p0", "d0", num_prompt_tokens=200, cached_tokens=0)
            error = 0.5 if i % 5 == 0 else -0.1
            built.observe_ttft(prediction, observed_s=prediction.ttft_s - prediction.ttft_bias_s + error)
    assert models.ttft_bias("p0") == pytest.approx(0.5, abs=0.01)
    assert median.ttft_bias("p0") == 0.0  # the median error is negative: no bias (never below zero)


def test_a_ttft_bias_fades_without_observations_so_early_rejection_cannot_lock_everyone_out(monkeypatch):
    """Only admitted requests are observed: a bias that puts every prediction past
    the SLO would reject every request for good if it did not fade."""
    import cluster.admission as admission

    models = _models()
    prediction = models.predict("p0", "d0", num_prompt_tokens=200, cached_tokens=0)
    models.observe_ttft(prediction, observed_s=prediction.ttft_s + 8.0)  # a bad spell: 8 s late
    assert models.predict("p0", "d0", 200, 0).ttft_s == pytest.approx(0.2 + 8.0, rel=0.05)
    later = time.monotonic() + 3 * admission.BIAS_HALF_LIFE_S
    monkeypatch.setattr(admission.time, "monotonic", lambda: later)
    assert models.ttft_bias("p0") == pytest.approx(1.0, rel=0.01)
    assert models.predict("p0", "d0", 200, 0).ttft_s == pytest.approx(0.2 + 1.0, rel=0.05)
    prediction = models.predict("p0", "d0", 200, 0)
    models.observe_ttft(prediction, observed_s=prediction.ttft_s - prediction.ttft_bias_s + 0.3)
    # Learning goes on from there: the 90th percentile of the faded 1.0 and the new 0.3.
    assert models.ttft_bias("p0") == pytest.approx(0.3 + 0.9 * (1.0 - 0.3), rel=1e-3)


PROMPT = list(range(300))  # 0.3 s of prefill on either P; 0.012 s on p0, which holds 288 tokens


def _two_prefill_workers_p0_cold(ttft_ms: float):
    """p0 and p1 alike, but p0's first request paid a cold start: a 0.5 s residual,
    so a 0.5 s bias; p0 holds the first 288 tokens of `PROMPT`."""
    scheduler = _scheduler(ttft_ms=ttft_ms)
    scheduler.view.members["p1"] = Member("p1", "prefill", handle=None)
    scheduler.view.stats["p1"] = _idle_stats("p1")
    scheduler.view.prefix["p1"] = PrefixIndex(1000)
    scheduler.view.profiled.add("p1")
    cold = scheduler.view.models.predict("p0", "d0", num_prompt_tokens=32, cached_tokens=0)
    scheduler.view.models.observe_ttft(cold, observed_s=cold.ttft_s + 0.5)
    scheduler.view.prefix["p0"].insert(block_hashes(PROMPT, 16, b""))
    return scheduler


def test_cache_aware_routing_ranks_without_a_cold_start_bias():
    """The prefix hit decides (with p0's bias ranked, p1 took the request: 0.3 s
    against 0.512 s); the SLO check counts the bias, so when it puts p0 past the
    SLO the request goes to p1, which meets it."""
    choice = _two_prefill_workers_p0_cold(ttft_ms=1000).plan(PROMPT)
    assert choice.prefill_id == "p0" and choice.uncached_tokens == 12
    assert choice.ttft_s == pytest.approx(0.012 + 0.5, abs=0.02)
    assert _two_prefill_workers_p0_cold(ttft_ms=400).plan(PROMPT).prefill_id == "p1"
