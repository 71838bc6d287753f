"""The learned biases (cluster/learned_bias.py): P's TTFT bias
(`WorkerModels.observe_ttft`), what it learns, how it fades, and where it counts:
in admission's SLO check, not in cache-aware routing's ranking; D's TBT bias
(`WorkerModels.observe_tbt`), learned from finished requests' mean gaps, in the
SLO check and the choice of D (no Ray)."""

from __future__ import annotations

import time

import pytest

from actors.block_pool import block_hashes
from cluster.admission import WorkerModels
from cluster.pool_manager import Member
from cluster.router import PrefixIndex
from tests.scheduler_setup import fitted_models, idle_stats, make_scheduler


def test_ttft_bias_learns_the_systematic_error_without_compounding():
    models = fitted_models()
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
    models, median = fitted_models(), WorkerModels(block_size=16, bias_quantile=0.5)
    for built in (models, median):
        for i in range(60):
            prediction = built.predict("p0", "d0", num_prompt_tokens=200, cached_tokens=0)
            error = 0.5 if i % 5 == 0 else -0.1
            built.observe_ttft(prediction, observed_s=prediction.ttft_s - prediction.ttft_bias_s + error)
    assert models.ttft_bias("p0") == pytest.approx(0.5, abs=0.01)
    assert median.ttft_bias("p0") == 0.0  # the median error is negative: no bias (never below zero)


def test_a_ttft_bias_fades_without_observations_so_early_rejection_cannot_lock_everyone_out(monkeypatch):
    """Only admitted requests are observed: a bias that puts every prediction past
    the SLO would reject every request for good if it did not fade. Whole for a
    half-life, it halves every half-life after that."""
    import cluster.admission as admission
    from cluster.learned_bias import HALF_LIFE_S

    models = fitted_models()
    prediction = models.predict("p0", "d0", num_prompt_tokens=200, cached_tokens=0)
    models.observe_ttft(prediction, observed_s=prediction.ttft_s + 8.0)  # a bad spell: 8 s late
    assert models.predict("p0", "d0", 200, 0).ttft_s == pytest.approx(0.2 + 8.0, rel=0.05)
    soon = time.monotonic() + 0.9 * HALF_LIFE_S
    monkeypatch.setattr(admission.time, "monotonic", lambda: soon)
    assert models.ttft_bias("p0") == pytest.approx(8.0, rel=0.01)
    later = soon + 3.1 * HALF_LIFE_S
    monkeypatch.setattr(admission.time, "monotonic", lambda: later)
    assert models.ttft_bias("p0") == pytest.approx(1.0, rel=0.01)
    assert models.predict("p0", "d0", 200, 0).ttft_s == pytest.approx(0.2 + 1.0, rel=0.05)
    prediction = models.predict("p0", "d0", 200, 0)
    models.observe_ttft(prediction, observed_s=prediction.ttft_s - prediction.ttft_bias_s + 0.3)
    # Learning goes on from there: the 90th percentile of the faded 1.0 and the new 0.3.
    assert models.ttft_bias("p0") == pytest.approx(0.3 + 0.9 * (1.0 - 0.3), rel=1e-3)


def test_residuals_younger_than_a_half_life_count_whole(monkeypatch):
    """A window of residuals observed over the last few seconds is their plain
    quantile. Each faded from when it came, the older part counted shrunken and
    the bias sat below its quantile: 28-31% of first tokens later than predicted
    where 10% were asked, in a review's simulation of a steady load."""
    import cluster.learned_bias as learned_bias

    clock = [1000.0]
    monkeypatch.setattr(learned_bias.time, "monotonic", lambda: clock[0])
    bias = learned_bias.LearnedBias(0.9)
    residuals = [((i * 37) % 64) / 320 for i in range(64)]  # 0 to 0.2 s, in no order
    for residual in residuals:
        clock[0] += 0.15  # the window spans 9.6 s, under the half-life
        bias.observe("p0", residual)
    assert bias("p0") == pytest.approx(learned_bias.quantile(residuals, 0.9), rel=1e-9)


PROMPT = list(range(300))  # 0.3 s of prefill on either P; 0.012 s on p0, which holds 288 tokens


def _two_prefill_workers_p0_cold(ttft_ms: float):
    """p0 and p1 alike, but p0's first request paid a cold start: a 0.5 s residual,
    so a 0.5 s bias; p0 holds the first 288 tokens of `PROMPT`."""
    scheduler = make_scheduler(ttft_ms=ttft_ms)
    scheduler.view.members["p1"] = Member("p1", "prefill", handle=None)
    scheduler.view.stats["p1"] = idle_stats("p1")
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


def _tbt_errors(models: WorkerModels, decode_id: str, errors) -> None:
    """Finished requests on D whose mean gap between tokens was the model's prediction plus each error."""
    for error in errors:
        prediction = models.predict("p0", decode_id, num_prompt_tokens=32, cached_tokens=0)
        models.observe_tbt(prediction, observed_s=prediction.tbt_s - prediction.tbt_bias_s + error)


def test_a_tbt_bias_is_the_attainment_quantile_of_finished_requests_errors():
    """D's step model is a mean (0.01 s a step at batch 1 here): with one request
    in five 15 ms slower than that, a request admitted at the mean would miss a
    TBT SLO just above it one time in five; the 90th percentile is added."""
    models = fitted_models()
    assert models.predict("p0", "d0", 32, 0).tbt_s == pytest.approx(0.01, rel=0.01)
    _tbt_errors(models, "d0", [0.015 if i % 5 == 0 else -0.001 for i in range(60)])
    prediction = models.predict("p0", "d0", 32, 0)
    assert prediction.tbt_bias_s == pytest.approx(models.tbt_bias("d0"), rel=1e-3)
    assert prediction.tbt_bias_s == pytest.approx(0.015, abs=1e-3)
    assert prediction.tbt_s == pytest.approx(0.01 + 0.015, abs=1e-3)
    assert models.ttft_bias("p0") == 0.0 and prediction.ttft_bias_s == 0.0  # the TTFT bias is P's own
    _tbt_errors(models, "d0", [-0.004] * 64)  # D got faster than its model: no bias below zero
    assert models.tbt_bias("d0") == 0.0


def test_a_tbt_bias_past_the_slo_sends_the_request_to_another_d_or_rejects_it():
    from cluster.admission import SloRejected

    one_d = make_scheduler(ttft_ms=5000, tbt_ms=20)
    assert one_d.plan(PROMPT).decode_id == "d0"  # 10 ms predicted: inside 20 ms
    _tbt_errors(one_d.view.models, "d0", [0.015] * 8)
    with pytest.raises(SloRejected, match=r"^predicted TBT 25 ms exceeds the SLO of 20 ms$"):
        one_d.plan(PROMPT)

    two_ds = make_scheduler(ttft_ms=5000, tbt_ms=20, decodes=("d0", "d1"))
    two_ds.view.models.decode["d1"] = fitted_models().decode_model("d0")  # d1 as fast as d0
    _tbt_errors(two_ds.view.models, "d0", [0.015] * 8)
    choice = two_ds.plan(PROMPT)
    assert choice.decode_id == "d1" and choice.tbt_s == pytest.approx(0.01, rel=0.01)


def test_the_quantile_interpolates_between_ranks_as_numpy_does():
    import numpy as np

    from cluster.learned_bias import quantile

    rng = np.random.default_rng(0)
    for size in (1, 2, 5, 64):
        values = list(rng.normal(size=size))
        for q in (0.0, 0.1, 0.5, 0.9, 1.0):
            assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)), abs=1e-12)
