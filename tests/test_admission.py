"""Cost models, early-rejection predictions and routing policies (no Ray)."""

from __future__ import annotations

import time

import pytest

from cluster.admission import InFlight, Prediction, SloRejected, WorkerModels
from cluster.cost_model import LinearCostModel, decode_features, prefill_features
from cluster.router import CacheAware, LeastLoad, PrefixIndex, RoundRobin, make_policy


def test_cost_model_recovers_a_linear_law():
    model = LinearCostModel(2)
    for new in (16, 64, 256, 512):
        for cached in (0, 128):
            features = prefill_features(new, cached)
            model.observe(features, 0.01 + 0.001 * features[0] + 0.002 * features[1])
    assert model.predict(prefill_features(300, 64)) == pytest.approx(0.01 + 0.3 + 0.002 * 300 * 364 / 1e3, rel=1e-6)


def test_cost_model_needs_observations():
    with pytest.raises(RuntimeError):
        LinearCostModel(2).predict((1.0, 1.0))


def _models() -> WorkerModels:
    models = WorkerModels(block_size=16)
    for new in (16, 64, 256):
        models.prefill_model("p0").observe(prefill_features(new, 0), 0.001 * new)
        models.prefill_model("p1").observe(prefill_features(new, 0), 0.001 * new)
    for batch in (1, 4, 16):
        models.decode_model("d0").observe(decode_features(batch, 0), 0.01 * batch)
    return models


def test_queued_prefill_counts_only_that_workers_unfinished_prefills():
    models = _models()
    models.inflight["a"] = InFlight("a", "p0", "d0", 100, 10, predicted_prefill_s=1.0)
    models.inflight["b"] = InFlight("b", "p1", "d0", 100, 10, predicted_prefill_s=5.0)
    done = InFlight("c", "p0", "d0", 100, 10, predicted_prefill_s=9.0, first_token_s=time.monotonic())
    models.inflight["c"] = done
    assert models.queued_prefill_s("p0") == pytest.approx(1.0, abs=0.05)
    prediction = models.predict("p0", "d0", num_prompt_tokens=200, cached_tokens=0)
    assert prediction.ttft_s == pytest.approx(1.0 + 0.2, abs=0.05)


def test_prefix_hits_lower_the_predicted_ttft():
    models = _models()
    cold = models.predict("p0", "d0", 256, cached_tokens=0)
    warm = models.predict("p0", "d0", 256, cached_tokens=240)
    assert warm.ttft_s < cold.ttft_s / 5 and warm.uncached_tokens == 16


def test_tbt_prediction_drops_requests_that_finish_before_the_prefill():
    models = _models()
    now = time.monotonic()
    # One request decoding with 2 tokens left (~0.02 s), one with 1000 left.
    models.inflight["short"] = InFlight("short", "p0", "d0", 10, 12, 0.0, admitted_s=now, first_token_s=now, num_generated=10)
    models.inflight["long"] = InFlight("long", "p0", "d0", 10, 1010, 0.0, admitted_s=now, first_token_s=now, num_generated=10)
    soon = models.tbt_at("d0", at_s=0.0, extra_kv_tokens=0)
    later = models.tbt_at("d0", at_s=1.0, extra_kv_tokens=0)
    assert soon == pytest.approx(0.03, rel=0.05)  # batch of 3
    assert later == pytest.approx(0.02, rel=0.05)  # the short one is done by then


def test_slo_rejection_says_prediction_and_target():
    error = SloRejected(Prediction("p0", "d0", ttft_s=3.2, tbt_s=0.05, uncached_tokens=100), 2.0, 0.1)
    assert "predicted TTFT 3200 ms exceeds the SLO of 2000 ms" in str(error)
    assert error.retry_after_s == 2


def test_prefix_index_is_lru_bounded():
    index = PrefixIndex(capacity_blocks=3)
    index.insert([b"a", b"b", b"c"])
    assert index.match([b"a", b"b", b"x"]) == 2
    index.insert([b"d"])
    assert index.match([b"a"]) == 0  # the least recently used went first
    assert index.match([b"b", b"c", b"d"]) == 3


def test_policies_pick_as_documented():
    fast = Prediction("p0", "d0", 0.5, 0.01, 10)
    slow = Prediction("p1", "d0", 2.0, 0.01, 500)
    assert CacheAware().choose([slow, fast], {}) is fast
    assert LeastLoad().choose([fast, slow], {"p0": 3.0, "p1": 1.0}) is slow
    turns = RoundRobin()
    assert [turns.choose([fast, slow], {}).prefill_id for _ in range(3)] == ["p0", "p1", "p0"]
    with pytest.raises(ValueError, match="routing policy"):
        make_policy("random")


def test_prefix_index_follows_worker_cache_events():
    index = PrefixIndex(capacity_blocks=10)
    index.apply([(True, b"a"), (True, b"b"), (True, b"c")])
    assert index.match([b"a", b"b", b"c"]) == 3
    index.apply([(False, b"b")])
    assert index.match([b"a", b"b", b"c"]) == 1
