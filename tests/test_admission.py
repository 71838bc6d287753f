"""Cost models, early-rejection predictions and routing policies (no Ray)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from actors.messages import TokenEvent
from actors.sampling_params import SamplingParams
from cluster.admission import InFlight, Prediction, SloRejected, WorkerModels
from cluster.cost_model import LinearCostModel, prefill_features
from cluster.router import CacheAware, LeastLoad, PrefixIndex, RoundRobin, make_policy
from tests.scheduler_setup import fitted_models, idle_stats, make_scheduler


def test_cost_model_recovers_a_linear_law():
    model = LinearCostModel(2)
    for new in (16, 64, 256, 512):
        for cached in (0, 128):
            features = prefill_features(new, cached)
            model.observe(features, 0.01 + 0.001 * features[0] + 0.002 * features[1])
    assert model.predict(prefill_features(300, 64)) == pytest.approx(0.01 + 0.3 + 0.002 * 300 * 364 / 1e3, rel=1e-6)


def test_cost_model_fits_the_best_non_negative_law_not_a_clipped_one():
    """Token gaps that fall slightly with the batch (overheads shared by a batch):
    the plain fit's batch coefficient is negative. The model's coefficients are
    the best fit with none below zero, not the plain fit's with that one zeroed."""
    rows = [((batch, kv / 1e3), 0.004 - 0.0001 * batch + 0.001 * kv / 1e3)
            for batch in (1, 2, 4, 8, 16) for kv in (100 * batch, 300 * batch + 500)]
    model = LinearCostModel(2)
    for features, seconds in rows:
        model.observe(features, seconds)
    x = np.array([(1.0, *f) for f, _ in rows])
    y = np.array([s for _, s in rows])
    plain, *_ = np.linalg.lstsq(x, y, rcond=None)
    assert plain[1] < 0
    clipped_error = float(np.sum((x @ np.maximum(plain, 0) - y) ** 2))
    predicted = np.array([model.predict(f) for f, _ in rows])
    assert float(np.sum((predicted - y) ** 2)) < 0.5 * clipped_error
    assert model.fixed_s() >= 0 and abs(model.predict((1, 0.1)) - 0.0041) < 0.001


def test_cost_model_needs_observations():
    with pytest.raises(RuntimeError):
        LinearCostModel(2).predict((1.0, 1.0))


def test_queued_prefill_counts_only_that_workers_unfinished_prefills():
    models = fitted_models()
    models.inflight["a"] = InFlight("a", "p0", "d0", 100, 10, predicted_ttft_s=1.0)
    models.inflight["b"] = InFlight("b", "p1", "d0", 100, 10, predicted_ttft_s=5.0)
    done = InFlight("c", "p0", "d0", 100, 10, predicted_ttft_s=9.0, first_token_s=time.monotonic())
    models.inflight["c"] = done
    assert models.queued_prefill_s("p0") == pytest.approx(1.0, abs=0.3)  # less the (wall) time the test took so far
    prediction = models.predict("p0", "d0", num_prompt_tokens=200, cached_tokens=0)
    assert prediction.ttft_s == pytest.approx(1.0 + 0.2, abs=0.3)


def test_queued_prefill_ends_with_the_last_predicted_first_token():
    """Each TTFT prediction includes the queue ahead of it: three requests admitted
    back to back end when the last one does, not after the sum of their TTFTs."""
    now = time.monotonic()
    models = fitted_models(now)
    for name, ttft in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        models.inflight[name] = InFlight(name, "p0", "d0", 100, 10, predicted_ttft_s=ttft, admitted_s=now)
    assert models.queued_prefill_s("p0") == pytest.approx(3.0, abs=0.3)


def test_a_first_token_sooner_than_predicted_moves_the_queue_behind_it_as_much():
    """Three requests each predicted behind the one before (`ahead_id`): the
    first one's token came 0.9 s early, so the two behind it are due 0.9 s sooner;
    the second one's, on time for its corrected due, moves nothing more. Without
    it, a steady load's queue crept up to the TTFT SLO (WorkerModels.first_token_came)."""
    now = time.monotonic()
    models = fitted_models(now)
    for name, ttft, ahead in (("a", 1.0, None), ("b", 2.0, "a"), ("c", 3.0, "b")):
        models.inflight[name] = InFlight(name, "p0", "d0", 100, 10, predicted_ttft_s=ttft, admitted_s=now,
                                         ahead_id=ahead)
    assert models.queued_prefill_s("p0") == pytest.approx(3.0, abs=0.1)
    a, b, c = (models.inflight[name] for name in "abc")
    models.first_token_came(a, now + 0.1)
    a.first_token_s = now + 0.1
    assert (b.first_token_due_s - now, c.first_token_due_s - now) == pytest.approx((1.1, 2.1))
    models.first_token_came(b, now + 1.1)  # on time
    b.first_token_s = now + 1.1
    assert c.first_token_due_s - now == pytest.approx(2.1)
    assert models.queued_prefill_s("p0") == pytest.approx(2.1, abs=0.1)
    following = models.predict("p0", "d0", num_prompt_tokens=200, cached_tokens=0)
    assert following.ahead_id == "c" and following.ttft_s == pytest.approx(2.1 + 0.2, abs=0.1)
    # One admitted to wait in a D's line is due from its reservation: not moved.
    models.inflight["in_line"] = InFlight("in_line", "p0", "d0", 100, 10, predicted_ttft_s=4.0, admitted_s=now,
                                          ahead_id="c", line_wait_s=1.0, reserved_s=now + 1.0, own_s=0.1)
    due_s = models.inflight["in_line"].first_token_due_s
    models.first_token_came(c, now + 1.1)
    assert models.inflight["in_line"].first_token_due_s == due_s


def _admitted_burst(models: WorkerModels, now: float) -> list[InFlight]:
    """Ten 100-token prompts admitted to p0 at `now`, each behind the one before,
    as the scheduler admits them (its prediction's bias, queue and own work)."""
    burst = []
    for index in range(10):
        prediction = models.predict("p0", "d0", 100, 0)
        burst.append(InFlight(f"r{index}", "p0", "d0", 100, 10, prediction.ttft_s, admitted_s=now, reserved_s=now,
                              ttft_bias_s=prediction.ttft_bias_s, ahead_id=prediction.ahead_id,
                              own_s=prediction.own_s))
        models.inflight[burst[-1].request_id] = burst[-1]
    return burst


def test_a_first_token_within_its_bias_does_not_move_the_queue_behind_it():
    """P's model is exact and its learned bias 0.3 s (the way back, and spread).
    In a burst of ten 100-token prompts, the first one's token came 50 ms after
    P finished it: on time for P's part, early only against the bias. Measured
    against the bias too, the queue behind moved by 0.25 s and then lost the
    bias in `_queue` again: it read 0.6 s with 0.85 s of P's work left."""
    now = time.monotonic()
    models = fitted_models(now)
    models.observe_ttft(models.predict("p0", "d0", 100, 0), observed_s=0.1 + 0.3)
    burst = _admitted_burst(models, now)
    models.first_token_came(burst[0], now + 0.15)
    burst[0].first_token_s = now + 0.15
    assert all(r.early_s == 0 for r in burst)
    assert burst[-1].first_token_due_s - now == pytest.approx(1.0 + 0.3, abs=0.01)  # P's end, and the bias


def test_requests_gone_before_their_first_token_take_their_work_off_the_queue():
    """Five of a burst of ten 0.1 s prompts were cancelled before P came to them:
    the queue read 1 s, for 0.5 s of P's work left, until the next first token."""
    now = time.monotonic()
    models = fitted_models(now)
    burst = _admitted_burst(models, now)
    assert burst[0].own_s == pytest.approx(0.1, abs=0.01)
    for gone in burst[2:7]:
        del models.inflight[gone.request_id]
        models.gone_before_its_first_token(gone, now)
    assert burst[-1].first_token_due_s - now == pytest.approx(0.5, abs=0.01)
    assert models.queued_prefill_s("p0") == pytest.approx(0.5, abs=0.05)


def test_a_full_decode_worker_within_the_tbt_slo_is_chosen_over_one_with_room_past_it():
    """d0 has room but ten long decodes (110 ms steps, over a 50 ms TBT SLO); d1 is
    full, idle, and grants 10 reservations a second. Ds without room were left
    out wherever one had room: the request was rejected for d0's TBT, though
    (p0, d1) meets both SLOs."""
    scheduler = make_scheduler(ttft_ms=2000, tbt_ms=50, decodes=("d0", "d1"))
    view = scheduler.view
    view.models.seed_from("d0", "d1")
    now = time.monotonic()
    for index in range(10):
        view.models.inflight[f"r{index}"] = InFlight(f"r{index}", "p0", "d0", 10, 1000, 0.0, admitted_s=now - 5,
                                                     reserved_s=now - 5, first_token_s=now)
    view.stats["d1"] = idle_stats("d1", num_used_blocks=1000)
    view.lines.observe("d1", num_granted=0, num_waiting=1, now_s=now - 2.0)
    view.lines.observe("d1", num_granted=20, num_waiting=0, now_s=now)
    view.lines.observe("d0", num_granted=0, num_waiting=0, now_s=now)
    choice = scheduler.plan(list(range(32)))
    assert choice.decode_id == "d1" and choice.line_wait_s == pytest.approx(0.1) and choice.tbt_s <= 0.05


def test_a_full_decode_worker_whose_wait_nothing_predicts_is_no_candidate_beside_one_with_room():
    """d1 is full and no reading has shown its line, nor has this replica a request
    there: its wait is unknown. Read as none, it beat d0, which has room, and the
    request sat in d1's line up to the handshake's wait (found by a second read)."""
    scheduler = make_scheduler(ttft_ms=2000, tbt_ms=50, decodes=("d0", "d1"))
    view = scheduler.view
    view.models.seed_from("d0", "d1")
    now = time.monotonic()
    for index in range(10):  # d0's TBT past the SLO
        view.models.inflight[f"r{index}"] = InFlight(f"r{index}", "p0", "d0", 10, 1000, 0.0, admitted_s=now - 5,
                                                     reserved_s=now - 5, first_token_s=now)
    view.stats["d1"] = idle_stats("d1", num_used_blocks=1000)
    with pytest.raises(SloRejected, match="TBT"):
        scheduler.plan(list(range(32)))
    view.stats["d0"] = idle_stats("d0", num_used_blocks=1000)  # both full, neither's wait known: both candidates
    assert scheduler.plan(list(range(32))).decode_id == "d1"  # (within the TBT SLO)


def test_a_learned_ttft_bias_counts_once_not_once_for_every_request_ahead():
    """P's first tokens came 0.3 s later than its model says (the way there and
    back, side by side for concurrent requests): a burst of 16 short prompts,
    admitted back to back, has its last predicted at 16 prefills plus one bias.
    With the bias in the queue it was 16 of each, 5 s on an idle cluster."""
    now = time.monotonic()
    models = fitted_models(now)
    models.observe_ttft(models.predict("p0", "d0", 20, 0), observed_s=0.02 + 0.3)
    for index in range(16):
        prediction = models.predict("p0", "d0", num_prompt_tokens=20, cached_tokens=0)
        models.inflight[f"r{index}"] = InFlight(f"r{index}", "p0", "d0", 20, 10, prediction.ttft_s,
                                                admitted_s=now, ttft_bias_s=prediction.ttft_bias_s)
    assert prediction.ttft_bias_s == pytest.approx(0.3, abs=0.01)
    assert prediction.ttft_s == pytest.approx(16 * 0.02 + 0.3, abs=0.05)


def test_a_request_late_for_its_first_token_delays_the_queue_by_its_lateness_alone():
    """Past its predicted first token (bias included) a request is late; before
    it, though P's part may be done, it is not: the queue behind waits for P's
    work only."""
    now = time.monotonic()
    models = fitted_models(now)
    models.inflight["on_its_way"] = InFlight("on_its_way", "p0", "d0", 100, 10, predicted_ttft_s=1.0,
                                             admitted_s=now - 0.8, ttft_bias_s=0.5, reserved_s=now - 0.8)
    assert models.queued_prefill_s("p0") == 0.0  # P's 0.5 s of work are over; its token is on its way
    models.inflight["late"] = InFlight("late", "p0", "d0", 100, 10, predicted_ttft_s=1.0, admitted_s=now - 3.0,
                                       ttft_bias_s=0.5, reserved_s=now - 3.0)
    assert models.queued_prefill_s("p0") == pytest.approx(2.0, abs=0.1)
    # Found by a review: one still in its handshake (D full, say) is D's delay, not P's: it
    # made every request through P a 429 (and a prefill-pool miss)
    del models.inflight["late"]
    models.inflight["in_line"] = InFlight("in_line", "p0", "d0", 100, 10, predicted_ttft_s=1.0, admitted_s=now - 3.0)
    assert models.inflight["in_line"].in_line and models.queued_prefill_s("p0") == 0.0


def test_an_overdue_prefill_delays_the_queue_behind_it():
    """A request 2 s past its predicted first token is not done: the queue behind it
    (predicted to end 1 s from now) moves back by those 2 s."""
    now = time.monotonic()
    models = fitted_models(now)
    for name, ttft_s in (("late", 1.0), ("next", 4.0)):
        models.inflight[name] = InFlight(name, "p0", "d0", 100, 10, predicted_ttft_s=ttft_s, admitted_s=now - 3.0,
                                         reserved_s=now - 3.0)
    assert models.queued_prefill_s("p0") == pytest.approx(1.0 + 2.0, abs=0.3)


def test_colocated_workers_count_their_own_queue():
    models = fitted_models()
    models.inflight["a"] = InFlight("a", None, "c0", 100, 10, predicted_ttft_s=2.0)
    assert models.queued_prefill_s("c0") == pytest.approx(2.0, abs=0.3)


def test_prefix_hits_lower_the_predicted_ttft():
    models = fitted_models()
    cold = models.predict("p0", "d0", 256, cached_tokens=0)
    warm = models.predict("p0", "d0", 256, cached_tokens=240)
    assert warm.ttft_s < cold.ttft_s / 5 and warm.uncached_tokens == 16


def test_tbt_prediction_drops_requests_that_finish_before_the_prefill():
    now = time.monotonic()
    models = fitted_models(now)
    # One request decoding with 2 tokens left (~0.02 s), one with 1000 left.
    models.inflight["short"] = InFlight("short", "p0", "d0", 10, 12, 0.0, admitted_s=now, first_token_s=now,
                                       num_generated=10)
    models.inflight["long"] = InFlight("long", "p0", "d0", 10, 1010, 0.0, admitted_s=now, first_token_s=now,
                                       num_generated=10)
    soon = models.tbt_at("d0", at_s=0.0, extra_kv_tokens=0)
    later = models.tbt_at("d0", at_s=1.0, extra_kv_tokens=0)
    assert soon == pytest.approx(0.03, rel=0.05)  # batch of 3
    assert later == pytest.approx(0.02, rel=0.05)  # the short one is done by then


def test_observed_token_gaps_refit_the_decode_model():
    """The profile says 10 ms per step at batch 1; clients see 40 ms: predictions follow."""
    now = time.monotonic()
    models = fitted_models(now)
    models.inflight["r"] = InFlight("r", "p0", "d0", 100, 500, 0.0, admitted_s=now, first_token_s=now)
    assert models.tbt_at("d0", 0.0, 0) == pytest.approx(0.02, rel=0.05)  # batch of 2 by the profile
    for _ in range(300):  # the window forgets the profile
        models.observe_token_gap("d0", 0.040)
    assert models.decode_load("d0") == (1, 100)
    assert models.tbt_at("d0", 0.0, 0) >= 0.040


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


def test_routed_blocks_count_until_the_worker_says_or_for_a_while():
    """A prompt routed to a worker counts as held until the worker's events say it
    stored it (then for good) or for `ROUTED_S`; one it never cached (prefix cache
    off, a retry elsewhere, an abort) stayed until LRU pushed it out."""
    from cluster.router import ROUTED_S

    now = [100.0]
    index = PrefixIndex(capacity_blocks=10, clock=lambda: now[0])
    index.route([b"a", b"b"])
    index.route([b"c"])
    assert index.match([b"a", b"b"]) == 2 and b"c" in index
    index.apply([(True, b"a")])  # the worker stored a; b it never did
    now[0] += ROUTED_S + 0.1
    assert index.match([b"a", b"b"]) == 1 and b"c" not in index
    index.route([b"d"])  # (the expired go on the next route)
    assert index._routed == {b"d": now[0] + ROUTED_S}


def test_routed_blocks_never_push_out_the_workers_own():
    """LRU-bounded by the worker's block count, routed chains pushed the index over
    it and dropped the first blocks of a chain the worker holds (the worker keeps a
    chain's first blocks longest)."""
    index = PrefixIndex(capacity_blocks=3)
    index.apply([(True, b"a"), (True, b"b")])
    index.route([b"x", b"y", b"z", b"w"])
    assert index.match([b"a", b"b"]) == 2
    assert sum(h in index for h in (b"x", b"y", b"z", b"w")) == 3  # (routed: bounded by the capacity too)


def test_a_prompt_routed_where_the_prefix_cache_is_off_leaves_no_hit():
    """The workers never cache it (nor say so): the routed prompt's blocks were a
    hit for every later request of that prefix."""
    async def one_token(request, choice, inflight):  # (the workers' events, scripted)
        yield TokenEvent(request.request_id, [5], "a", None, True, "length", time.time(), 0)

    prompt = list(range(256))
    for enabled, uncached in ((False, 256), (True, 16)):  # (on: routed there, the rest a hit until P says)
        scheduler = make_scheduler(ttft_ms=10_000, enable_prefix_cache=enabled)
        scheduler._events = one_token

        async def run():
            return [event async for event in scheduler.generate(prompt, SamplingParams(max_new_tokens=1))]

        assert len(asyncio.run(run())) == 1
        assert scheduler.plan(prompt).uncached_tokens == uncached


def test_policies_pick_as_documented():
    fast = Prediction("p0", "d0", 0.5, 0.01, 10)
    slow = Prediction("p1", "d0", 2.0, 0.01, 500)
    assert CacheAware().choose([slow, fast], {}, {}) is fast
    assert LeastLoad().choose([fast, slow], {"p0": 3.0, "p1": 1.0}, {}) is slow
    turns = RoundRobin()
    assert [turns.choose([fast, slow], {}, {}).prefill_id for _ in range(3)] == ["p0", "p1", "p0"]


def test_a_busy_colocated_worker_never_ties_with_an_idle_one():
    """Colocated candidates have no P; equal predictions fall to the in-flight count."""
    busy = Prediction(None, "c0", 0.1, 0.01, 50)
    idle = Prediction(None, "c1", 0.1, 0.01, 50)
    for policy in (CacheAware(), LeastLoad()):
        assert policy.choose([busy, idle], {}, {"c0": 3}) is idle
    with pytest.raises(ValueError, match="routing policy"):
        make_policy("random")


def test_prefix_index_follows_worker_cache_events():
    index = PrefixIndex(capacity_blocks=10)
    index.apply([(True, b"a"), (True, b"b"), (True, b"c")])
    assert index.match([b"a", b"b", b"c"]) == 3
    index.apply([(False, b"b")])
    assert index.match([b"a", b"b", b"c"]) == 1
