"""Cost models, early-rejection predictions and routing policies (no Ray)."""

from __future__ import annotations

import asyncio
import re
import time

import numpy as np
import pytest

from actors.messages import TokenEvent
from actors.sampling_params import SamplingParams
from cluster.admission import InFlight, Prediction, SloRejected, WorkerModels
from cluster.cost_model import LinearCostModel, decode_features, prefill_features
from cluster.router import CacheAware, LeastLoad, PrefixIndex, RoundRobin, make_policy
from cluster.scaling_signals import PeerLoad


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


def _models(now: float | None = None) -> WorkerModels:
    """Fitted models; with `now`, their clock stands still there (a slow machine's
    time between the test's calls does not move the predictions it compares)."""
    models = WorkerModels(block_size=16) if now is None else WorkerModels(block_size=16, clock=lambda: now)
    for new in (16, 64, 256):
        models.prefill_model("p0").observe(prefill_features(new, 0), 0.001 * new)
        models.prefill_model("p1").observe(prefill_features(new, 0), 0.001 * new)
    for batch in (1, 4, 16):
        models.decode_model("d0").observe(decode_features(batch, 0), 0.01 * batch)
    return models


def test_queued_prefill_counts_only_that_workers_unfinished_prefills():
    models = _models()
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
    models = _models(now)
    for name, ttft in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        models.inflight[name] = InFlight(name, "p0", "d0", 100, 10, predicted_ttft_s=ttft, admitted_s=now)
    assert models.queued_prefill_s("p0") == pytest.approx(3.0, abs=0.3)


def test_a_first_token_sooner_than_predicted_moves_the_queue_behind_it_as_much():
    """Three requests each predicted behind the one before (`ahead_id`): the
    first one's token came 0.9 s early, so the two behind it are due 0.9 s sooner;
    the second one's, on time for its corrected due, moves nothing more. Without
    it, a steady load's queue crept up to the TTFT SLO (WorkerModels.first_token_came)."""
    now = time.monotonic()
    models = _models(now)
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
                                          ahead_id="c", line_wait_s=1.0, reserved_s=now + 1.0)
    models.first_token_came(c, now + 1.1)
    assert models.inflight["in_line"].first_token_due_s - now == pytest.approx(4.0)


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
    models = _models(now)
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
    models = _models(now)
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
    scheduler = _scheduler(ttft_ms=2000, tbt_ms=50, decodes=("d0", "d1"))
    view = scheduler.view
    view.models.seed_from("d0", "d1")
    now = time.monotonic()
    for index in range(10):
        view.models.inflight[f"r{index}"] = InFlight(f"r{index}", "p0", "d0", 10, 1000, 0.0, admitted_s=now - 5,
                                                     reserved_s=now - 5, first_token_s=now)
    view.stats["d1"] = _idle_stats("d1", num_used_blocks=1000)
    view.lines.observe("d1", num_granted=0, num_waiting=1, now_s=now - 2.0)
    view.lines.observe("d1", num_granted=20, num_waiting=0, now_s=now)
    view.lines.observe("d0", num_granted=0, num_waiting=0, now_s=now)
    choice = scheduler.plan(list(range(32)))
    assert choice.decode_id == "d1" and choice.line_wait_s == pytest.approx(0.1) and choice.tbt_s <= 0.05


def test_a_full_decode_worker_whose_wait_nothing_predicts_is_no_candidate_beside_one_with_room():
    """d1 is full and no reading has shown its line, nor has this replica a request
    there: its wait is unknown. Read as none, it beat d0, which has room, and the
    request sat in d1's line up to the handshake's wait (found by a second read)."""
    scheduler = _scheduler(ttft_ms=2000, tbt_ms=50, decodes=("d0", "d1"))
    view = scheduler.view
    view.models.seed_from("d0", "d1")
    now = time.monotonic()
    for index in range(10):  # d0's TBT past the SLO
        view.models.inflight[f"r{index}"] = InFlight(f"r{index}", "p0", "d0", 10, 1000, 0.0, admitted_s=now - 5,
                                                     reserved_s=now - 5, first_token_s=now)
    view.stats["d1"] = _idle_stats("d1", num_used_blocks=1000)
    with pytest.raises(SloRejected, match="TBT"):
        scheduler.plan(list(range(32)))
    view.stats["d0"] = _idle_stats("d0", num_used_blocks=1000)  # both full, neither's wait known: both candidates
    assert scheduler.plan(list(range(32))).decode_id == "d1"  # (within the TBT SLO)


def test_a_learned_ttft_bias_counts_once_not_once_for_every_request_ahead():
    """P's first tokens came 0.3 s later than its model says (the way there and
    back, side by side for concurrent requests): a burst of 16 short prompts,
    admitted back to back, has its last predicted at 16 prefills plus one bias.
    With the bias in the queue it was 16 of each, 5 s on an idle cluster."""
    now = time.monotonic()
    models = _models(now)
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
    models = _models(now)
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
    models = _models(now)
    for name, ttft_s in (("late", 1.0), ("next", 4.0)):
        models.inflight[name] = InFlight(name, "p0", "d0", 100, 10, predicted_ttft_s=ttft_s, admitted_s=now - 3.0,
                                         reserved_s=now - 3.0)
    assert models.queued_prefill_s("p0") == pytest.approx(1.0 + 2.0, abs=0.3)


def test_colocated_workers_count_their_own_queue():
    models = _models()
    models.inflight["a"] = InFlight("a", None, "c0", 100, 10, predicted_ttft_s=2.0)
    assert models.queued_prefill_s("c0") == pytest.approx(2.0, abs=0.3)


def test_prefix_hits_lower_the_predicted_ttft():
    models = _models()
    cold = models.predict("p0", "d0", 256, cached_tokens=0)
    warm = models.predict("p0", "d0", 256, cached_tokens=240)
    assert warm.ttft_s < cold.ttft_s / 5 and warm.uncached_tokens == 16


def test_tbt_prediction_drops_requests_that_finish_before_the_prefill():
    now = time.monotonic()
    models = _models(now)
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
    models = _models(now)
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
        scheduler = _scheduler(ttft_ms=10_000, enable_prefix_cache=enabled)
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


class _Tokenizer:
    def __len__(self):
        return 1000


def _idle_stats(worker_id: str, **figures):
    from actors.worker_base import WorkerStats

    idle = dict(num_blocks=1000, num_used_blocks=0, num_cached_blocks=0, num_running=0, num_waiting=0,
                num_reserved=0, num_channels=0, last_step_s=0.0)
    return WorkerStats(worker_id, **{**idle, **figures})


def _scheduler(ttft_ms: float, tbt_ms: float = 1000.0, decodes: tuple[str, ...] = ("d0",), **engine):
    """A GlobalScheduler with one P and the given Ds whose cost models are known
    (`engine`: engine settings besides a block size of 16)."""
    from cluster.config import AppSettings
    from cluster.pool_manager import Member
    from cluster.service import GlobalScheduler

    settings = AppSettings.model_validate({"model": {"preset": "tiny"}, "slo": {"ttft_ms": ttft_ms, "tbt_ms": tbt_ms},
                                           "engine": {"block_size": 16, **engine}})
    scheduler = GlobalScheduler(settings, _Tokenizer(), pool=None, max_model_len=2048, kv_seed=b"")
    scheduler.view.models = _models()
    for worker_id, role in (("p0", "prefill"), *((d, "decode") for d in decodes)):
        scheduler.view.members[worker_id] = Member(worker_id, role, handle=None)
        scheduler.view.stats[worker_id] = _idle_stats(worker_id)
        scheduler.view.prefix[worker_id] = PrefixIndex(1000)
        scheduler.view.profiled.add(worker_id)
    return scheduler


def test_a_queue_that_breaks_the_slo_rejects_and_a_relaxed_slo_admits():
    prompt = list(range(300))  # predicted prefill: 0.3 s on p0
    strict = _scheduler(ttft_ms=1000)
    strict.view.models.inflight["queued"] = InFlight("queued", "p0", "d0", 900, 10, predicted_ttft_s=2.0)
    with pytest.raises(SloRejected) as rejected:
        strict.plan(prompt)
    assert rejected.value.best.ttft_s == pytest.approx(2.3, abs=0.3)
    said = re.fullmatch(r"predicted TTFT (\d+) ms exceeds the SLO of 1000 ms", str(rejected.value))
    assert said and int(said.group(1)) == pytest.approx(2300, abs=300)  # (the queue's wait shrinks as time passes)

    relaxed = _scheduler(ttft_ms=5000)
    relaxed.view.models.inflight["queued"] = InFlight("queued", "p0", "d0", 900, 10, predicted_ttft_s=2.0)
    choice = relaxed.plan(prompt)
    assert (choice.prefill_id, choice.decode_id) == ("p0", "d0")


def test_a_full_decode_workers_line_counts_in_the_ttft_and_a_long_wait_rejects():
    """D has no headroom, 4 handshakes wait, and it granted 2 reservations a second:
    a request joining the line waits about 2.5 s (cluster/decode_lines.py)."""
    prompt = list(range(300))  # predicted prefill: 0.3 s on p0

    def full_d(ttft_ms: float):
        scheduler = _scheduler(ttft_ms=ttft_ms)
        scheduler.view.stats["d0"] = _idle_stats("d0", num_used_blocks=1000, num_waiting_handshakes=4)
        scheduler.view.lines.observe("d0", num_granted=10, num_waiting=4, now_s=0.0)
        scheduler.view.lines.observe("d0", num_granted=14, num_waiting=4, now_s=2.0)
        return scheduler

    with pytest.raises(SloRejected, match=r"predicted TTFT \d+ ms \(of which 2500 ms waiting for a decode worker's "
                                          r"KV blocks\) exceeds the SLO of 2000 ms"):
        full_d(2000).plan(prompt)
    choice = full_d(5000).plan(prompt)
    assert choice.line_wait_s == pytest.approx(2.5) and choice.ttft_s == pytest.approx(2.8, abs=0.1)
    burst = full_d(5000)  # two of this replica's requests sent to d0 since the reading, still in the handshake
    for name in ("mine-1", "mine-2"):
        burst.view.models.inflight[name] = InFlight(name, "p0", "d0", 100, 10, predicted_ttft_s=0.1)
    assert burst.plan(prompt).line_wait_s == pytest.approx(3.5)
    roomy = _scheduler(ttft_ms=2000)  # the same D with room and nobody waiting: no wait
    roomy.view.lines.observe("d0", num_granted=10, num_waiting=0, now_s=0.0)
    roomy.view.lines.observe("d0", num_granted=14, num_waiting=0, now_s=2.0)
    assert roomy.plan(prompt).line_wait_s == 0.0


def test_among_full_decode_workers_the_shortest_line_gets_the_request():
    scheduler = _scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    scheduler.view.models.seed_from("d0", "d1")
    for d, waiting in (("d0", 4), ("d1", 1)):  # both full, granting 2 a second: 2.5 s and 1 s
        scheduler.view.stats[d] = _idle_stats(d, num_used_blocks=1000, num_waiting_handshakes=waiting)
        scheduler.view.lines.observe(d, num_granted=10, num_waiting=waiting, now_s=0.0)
        scheduler.view.lines.observe(d, num_granted=14, num_waiting=waiting, now_s=2.0)
    choice = scheduler.plan(list(range(32)))
    assert (choice.decode_id, choice.line_wait_s) == ("d1", pytest.approx(1.0))


def test_a_burst_joins_the_line_only_past_the_room_it_found():
    """D had a line a moment ago (2 grants a second) and none now, and room for 3
    of this replica's 5 requests sent since the reading: the 2 it did not hold
    are ahead of a new request in the line, the 3 it held are not."""
    scheduler = _scheduler(ttft_ms=5000)
    scheduler.view.stats["d0"] = _idle_stats("d0", num_used_blocks=1000 - 3 * 7)  # 7 blocks a request below
    scheduler.view.lines.observe("d0", num_granted=10, num_waiting=2, now_s=0.0)
    scheduler.view.lines.observe("d0", num_granted=14, num_waiting=0, now_s=2.0)
    for index in range(5):  # 100 prompt tokens and 10 out: 7 blocks each, none reserved yet
        scheduler.view.models.inflight[f"mine-{index}"] = InFlight(f"mine-{index}", "p0", "d0", 100, 10, 0.1)
    assert scheduler.view.rooms.num_joined_line("d0") == 2
    assert scheduler.plan(list(range(300))).line_wait_s == pytest.approx((0 + 2 + 1) / 2)


def test_before_a_line_was_read_a_full_ds_wait_is_when_its_requests_finish():
    """D is full and no reading has shown a line on it. This replica's three
    requests there (8 blocks each, no growth kept) have 10, 20 and 30 tokens to
    go, at 10 ms a step: 10 blocks come free with the second, at 0.2 s; 40, past
    the 24 they hold, at their pace: 0.3 s * 40 / 24."""
    scheduler = _scheduler(ttft_ms=10_000, decode_reserve_tokens=0)
    view = scheduler.view
    view.stats["d0"] = _idle_stats("d0", num_used_blocks=1000)
    now = time.monotonic()
    view.lines.observe("d0", num_granted=10, num_waiting=0, now_s=now - 2.0)
    view.lines.observe("d0", num_granted=14, num_waiting=0, now_s=now - 1.0)
    for index, left in enumerate((30, 10, 20)):
        view.models.inflight[f"mine-{index}"] = InFlight(f"mine-{index}", "p0", "d0", 127, left, 0.1,
                                                         admitted_s=now - 5, reserved_s=now - 4, first_token_s=now - 3)
    assert view.rooms.release_wait_s("d0", needed_blocks=10, step_s=0.01) == pytest.approx(0.2)
    assert view.rooms.release_wait_s("d0", needed_blocks=40, step_s=0.01) == pytest.approx(0.5)
    choice = scheduler.plan(list(range(300)))  # 19 blocks: when the third finishes, at D's step time now
    step_s = view.models.tbt_at("d0", 0.0, 0)
    assert step_s > 0 and choice.line_wait_s == pytest.approx(30 * step_s)


def test_a_request_waiting_in_a_decode_workers_line_is_not_its_prefill_workers_work_yet():
    now = time.monotonic()
    models = _models(now)
    waiting = InFlight("waiting", "p0", "d0", 100, 10, predicted_ttft_s=5.5, admitted_s=now, line_wait_s=5.0)
    models.inflight["waiting"] = waiting
    assert models.queued_prefill_s("p0") == 0.0  # P is free while it waits (it was predicted to)
    waiting.reserved_s = now + 1.0  # through the line early: P's from then, 0.5 s of its work
    assert models.queued_prefill_s("p0") == pytest.approx(1.5, abs=0.05)


def test_a_decode_worker_too_busy_for_the_tbt_slo_rejects():
    scheduler = _scheduler(ttft_ms=10_000, tbt_ms=50)
    for index in range(10):  # ten long decodes on d0: batch 11 -> ~0.11 s per step
        scheduler.view.models.inflight[f"r{index}"] = InFlight(
            f"r{index}", "p0", "d0", 10, 1000, 0.0, first_token_s=time.monotonic())
    with pytest.raises(SloRejected, match="predicted TBT"):
        scheduler.plan(list(range(32)))


def test_other_replicas_load_counts_in_the_predictions_and_the_routing():
    """Another scheduler replica's prefills queue on p0 and its decodes batch on d0:
    a prediction adds them to this replica's own, and the tie-break counts them."""
    alone = _scheduler(ttft_ms=10_000, tbt_ms=1000, decodes=("d0", "d1"))
    shared = _scheduler(ttft_ms=10_000, tbt_ms=1000, decodes=("d0", "d1"))
    for scheduler in (alone, shared):
        for batch in (1, 4, 16):  # d1 as fast as d0
            scheduler.view.models.decode_model("d1").observe(decode_features(batch, 0), 0.01 * batch)
    shared.view.models.peers = PeerLoad(backlog_tokens={"p0": 2000}, decoding={"d0": 9}, decoding_kv_tokens={"d0": 900},
                                   inflight={"p0": 3, "d0": 12})
    prompt = list(range(300))
    assert alone.view.models.queued_prefill_s("p0") == 0.0
    assert shared.view.models.queued_prefill_s("p0") == pytest.approx(2.0, abs=0.1)  # 2000 tokens at 1 ms a token
    assert shared.view.models.decode_load("d0") == (9, 900)
    assert shared.view.models.tbt_at("d0", 0.0, 300) == pytest.approx(0.1, abs=0.01)  # batch 10
    assert alone.view.models.tbt_at("d0", 0.0, 300) == pytest.approx(0.01, abs=0.01)
    assert alone.plan(prompt).decode_id == "d0"  # idle equals: the first
    assert shared.plan(prompt).decode_id == "d1"  # d0 is busy with the other replica's requests
    assert shared.plan(prompt).ttft_s == pytest.approx(alone.plan(prompt).ttft_s + 2.0, abs=0.1)
    with pytest.raises(SloRejected, match="predicted TTFT"):
        strict = _scheduler(ttft_ms=1000)
        strict.view.models.peers = shared.view.models.peers
        strict.plan(prompt)


def test_other_replicas_backlog_counts_once_in_a_burst_of_this_ones():
    """Each prediction held the other replicas' backlog on P, and the queue ended
    at the latest request's prediction and added it again: with 2 s of theirs, four
    300-token prompts (0.3 s each) were predicted 2.3, 4.6, 6.9 and 9.2 s, for
    about 3.2 s at the last, and refused past a 5 s SLO."""
    scheduler = _scheduler(ttft_ms=5000)
    models = scheduler.view.models
    models.peers = PeerLoad(backlog_tokens={"p0": 2000}, backlog_prompts={"p0": 1})
    predicted = []
    for index in range(4):
        choice = scheduler.plan(list(range(1000 * index, 1000 * index + 300)))
        predicted.append(choice.ttft_s)
        request = InFlight(f"r{index}", choice.prefill_id, choice.decode_id, 300, 10, choice.ttft_s,
                           ttft_bias_s=choice.ttft_bias_s, ahead_id=choice.ahead_id, own_s=choice.own_s,
                           peers_s=choice.peers_s)
        request.reserved()
        models.inflight[request.request_id] = request
    assert predicted == pytest.approx([2.3, 2.6, 2.9, 3.2], abs=0.1)


def test_the_decode_step_that_ends_ds_requests_counts_their_kv():
    """Which of D's requests are done by the time a new one joins was reckoned
    from a step without their KV: 32 requests of 6,000 tokens with 40 to go, at
    47 ms a step on a D bound by its KV, read as done in 0.33 s, and a request
    joining at 0.5 s was predicted 5 ms a step."""
    now = time.monotonic()
    models = WorkerModels(16, clock=lambda: now)
    for batch in (1, 8, 32):
        for kv_tokens in (0, 50_000, 200_000):
            models.decode_model("d0").observe(decode_features(batch, kv_tokens),
                                              0.005 + 0.0001 * batch + 0.0002 * kv_tokens / 1e3)
    for index in range(32):
        models.inflight[f"r{index}"] = InFlight(f"r{index}", "p0", "d0", 6000, 100, 0.1, admitted_s=now - 10,
                                                reserved_s=now - 10, first_token_s=now - 9, num_generated=60)
    full_step_s = models.decode_model("d0").predict(decode_features(33, 32 * 6060 + 100))
    assert full_step_s == pytest.approx(0.047, abs=0.002)
    assert models.tbt_at("d0", 0.5, 100) == pytest.approx(full_step_s, rel=0.01)  # all 32 still running then


def test_a_worker_found_dead_before_its_profile_ran_leaves_nothing_behind():
    """Out of `stats` and never `profiled`, it was not among the workers a refresh
    forgets: its prefix index, its cursor and its gauges stayed for good (a worker
    crashing as it starts, again and again, piled them up)."""
    from cluster.pool_manager import Member

    scheduler = _scheduler(ttft_ms=1000)
    view = scheduler.view
    view.members["p1"] = Member("p1", "prefill", handle=None)
    view.stats["p1"] = _idle_stats("p1")
    view.prefix["p1"] = PrefixIndex(1000)
    view.cache_cursors["p1"] = ("log", 3)
    view.metrics.set("kv_blocks_used", "KV blocks in use per worker", 5, worker="p1", role="prefill")
    told = []

    class PoolManager:  # (its answer: the thing under test is the view's own)
        class report_dead:
            @staticmethod
            async def remote(worker_id):
                told.append(worker_id)

    view.pool = PoolManager()
    asyncio.run(view.report_dead("p1"))
    assert told == ["p1"] and "p1" not in view.members and "p1" not in view.stats
    assert "p1" not in view.prefix and "p1" not in view.cache_cursors and 'worker="p1"' not in view.metrics.render()


def test_a_request_past_its_deadline_ends_with_an_error_and_is_closed():
    import asyncio

    from cluster.service import _until

    closed = []

    async def slow():
        try:
            while True:
                await asyncio.sleep(0.05)
                yield "tick"
        finally:
            closed.append(True)

    async def run():
        return [e async for e in _until(slow(), time.monotonic() + 0.3, "r1")]

    events = asyncio.run(run())
    assert events[:-1] == ["tick"] * (len(events) - 1) and len(events) >= 3
    assert events[-1].error == "request timed out" and events[-1].finished
    assert closed == [True]


def test_decode_choice_within_the_slo_is_the_least_busy_not_the_fastest_profile():
    """A new decode worker whose start-up profile came out slower still takes
    requests while the busy one is within the SLO; past the SLO, speed decides."""
    scheduler = _scheduler(ttft_ms=10_000, tbt_ms=200, decodes=("d0", "d1"))
    for batch in (1, 4, 16):  # d1 profiled twice as slow as d0
        scheduler.view.models.decode_model("d1").observe(decode_features(batch, 0), 0.02 * batch)
    for index in range(3):  # three decodes on d0
        scheduler.view.models.inflight[f"r{index}"] = InFlight(
            f"r{index}", "p0", "d0", 10, 1000, 0.0, first_token_s=time.monotonic())
    assert scheduler.plan(list(range(32))).decode_id == "d1"
    strict = _scheduler(ttft_ms=10_000, tbt_ms=30, decodes=("d0", "d1"))  # d1 alone: ~0.04 s per step
    for batch in (1, 4, 16):
        strict.view.models.decode_model("d1").observe(decode_features(batch, 0), 0.04 * batch)
    assert strict.plan(list(range(32))).decode_id == "d0"


def test_a_scaled_up_worker_starts_from_a_peers_models_and_takes_the_next_request():
    """No start-up profile for a second worker of a role (its handle here cannot
    even be called): it copies p0's models, and with p0 queued it gets the request."""
    import asyncio

    from cluster.pool_manager import Member

    scheduler = _scheduler(ttft_ms=10_000)
    scheduler.view.models.inflight["queued"] = InFlight("queued", "p0", "d0", 900, 10, predicted_ttft_s=3.0)
    scheduler.view.members["p1"] = Member("p1", "prefill", handle=None)
    scheduler.view.stats["p1"] = _idle_stats("p1")
    scheduler.view.prefix["p1"] = PrefixIndex(1000)
    asyncio.run(scheduler.view._profile_new(list(scheduler.view.members.values())))
    assert "p1" in scheduler.view.profiled
    assert scheduler.view.models.prefill_s("p1", 300, 0) == pytest.approx(scheduler.view.models.prefill_s("p0", 300, 0))
    assert scheduler.plan(list(range(300))).prefill_id == "p1"


def test_a_later_choice_goes_to_its_first_choices_pair_unless_that_misses_the_slo():
    """`pair` (a prompt's later choices, cluster/completions.py) is taken though
    the other P is idle and predicted faster; not where it misses the SLO and the
    other P does not, nor where it may take no request."""
    from cluster.pool_manager import Member

    def two_prefills(queued_s: float):
        scheduler = _scheduler(ttft_ms=2000)
        scheduler.view.members["p1"] = Member("p1", "prefill", handle=None)
        scheduler.view.stats["p1"] = _idle_stats("p1")
        scheduler.view.prefix["p1"] = PrefixIndex(1000)
        scheduler.view.profiled.add("p1")
        scheduler.view.models.inflight["queued"] = InFlight("queued", "p0", "d0", 900, 10, predicted_ttft_s=queued_s)
        return scheduler

    prompt = list(range(300))  # predicted prefill: 0.3 s on either P
    scheduler = two_prefills(queued_s=1.0)
    assert scheduler.plan(prompt).prefill_id == "p1"
    pinned = scheduler.plan(prompt, pair=("p0", "d0"))
    assert pinned.prefill_id == "p0" and pinned.ttft_s == pytest.approx(1.3, abs=0.3)
    assert scheduler.plan(prompt, exclude={"p0"}, pair=("p0", "d0")).prefill_id == "p1"
    assert two_prefills(queued_s=3.0).plan(prompt, pair=("p0", "d0")).prefill_id == "p1"  # p0: 3.3 s, past the SLO


def test_a_replaced_pool_manager_starts_the_scheduler_from_nothing():
    """The new pool's workers reuse ids (p0, d0) but are new processes: no cost
    model, prefix index or stats of the old ones may carry over."""
    scheduler = _scheduler(ttft_ms=10_000)
    scheduler.view.ready = True
    told = []

    class NewPool:  # (its answer: the thing under test is the view's own)
        class report_dead:
            @staticmethod
            async def remote(worker_id):
                told.append(worker_id)

    new_pool = NewPool()
    scheduler.view.replace_pool(new_pool)
    assert scheduler.view.pool is new_pool and not scheduler.view.ready
    assert not (scheduler.view.members or scheduler.view.stats or scheduler.view.prefix or scheduler.view.profiled)
    models = scheduler.view.models
    assert not models.prefill_model("p0").is_fitted and not models.decode_model("d0").is_fitted
    asyncio.run(scheduler.view.report_dead("d0"))  # a request on the old d0 failing now
    assert told == []  # (the new pool's d0 lives)


def test_idle_decode_workers_take_turns_so_a_new_one_serves_the_next_request():
    scheduler = _scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    scheduler.view.models.seed_from("d0", "d1")
    scheduler.view.num_routed["d0"] = 5  # d0 has served before; both idle now
    assert scheduler.plan(list(range(32))).decode_id == "d1"


def test_a_decode_worker_whose_line_asks_for_its_free_blocks_has_no_headroom():
    """Handshakes waiting for a D's blocks (actors/reservation_queue.py) will take
    what it frees: another D with room gets the request."""
    scheduler = _scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    scheduler.view.models.seed_from("d0", "d1")
    assert scheduler.plan(list(range(32))).decode_id == "d0"  # equals: the first
    scheduler.view.stats["d0"] = _idle_stats("d0", num_used_blocks=900, num_waiting_handshakes=2,
                                             num_waiting_blocks=100)
    assert scheduler.plan(list(range(32))).decode_id == "d1"


def test_handshakes_passing_through_an_idle_decode_workers_line_predict_no_wait():
    """A burst's handshakes are in D's line for a call onto its engine thread each,
    and D has room for all of them and for the next: no wait is predicted,
    however few reservations D granted lately (CI once saw 4.7 s predicted on an
    idle cluster, and a 429, from such a reading)."""
    scheduler = _scheduler(ttft_ms=1000)
    scheduler.view.stats["d0"] = _idle_stats("d0", num_waiting_handshakes=3, num_waiting_blocks=6)
    scheduler.view.lines.observe("d0", num_granted=10, num_waiting=3, now_s=time.monotonic() - 5.0)
    scheduler.view.lines.observe("d0", num_granted=11, num_waiting=3, now_s=time.monotonic())
    choice = scheduler.plan(list(range(32)))
    assert choice.line_wait_s == 0.0 and choice.ttft_s < 1.0


def test_requests_sent_to_a_decode_worker_since_its_stats_were_read_use_its_room():
    """d0 had 20 free blocks at the last reading, d1 10; this replica has sent d0
    two prompts of 150 tokens since (10 blocks each), d1 two of 10 (1 each): d0
    has no room left, and the next request goes to d1."""
    scheduler = _scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    scheduler.view.models.seed_from("d0", "d1")
    scheduler.view.stats["d0"] = _idle_stats("d0", num_used_blocks=980)
    scheduler.view.stats["d1"] = _idle_stats("d1", num_used_blocks=990)
    for d in ("d0", "d1"):
        scheduler.view.lines.observe(d, num_granted=0, num_waiting=0, now_s=time.monotonic())
    assert scheduler.plan(list(range(32))).decode_id == "d0"  # none in flight on either: the most headroom
    inflight = scheduler.view.models.inflight
    for name in ("sent-1", "sent-2"):
        inflight[name] = InFlight(name, "p0", "d0", 150, 10, predicted_ttft_s=0.2, first_token_s=1.0)
    inflight["d1-1"] = InFlight("d1-1", "p0", "d1", 10, 10, predicted_ttft_s=0.2, first_token_s=1.0)
    inflight["d1-2"] = InFlight("d1-2", "p0", "d1", 10, 10, predicted_ttft_s=0.2, first_token_s=1.0)
    assert scheduler.plan(list(range(32))).decode_id == "d1"


def test_a_decode_worker_whose_batch_is_full_has_no_headroom_whatever_blocks_are_free():
    """A D holding `max_num_seqs` requests grants the next reservation only as one
    ends (`Engine.batch_full`). d0 had places for 2 more at the last reading and
    free blocks for all; this replica has sent it 2 since: the next request goes
    to d1, and with d0 alone it is predicted to wait for d0's first request to end."""
    scheduler = _scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    view = scheduler.view
    view.models.seed_from("d0", "d1")
    view.stats["d0"] = _idle_stats("d0", num_free_seqs=2)
    view.stats["d1"] = _idle_stats("d1", num_used_blocks=900, num_free_seqs=50)
    now = time.monotonic()
    for d in ("d0", "d1"):
        view.lines.observe(d, num_granted=0, num_waiting=0, now_s=now - 1.0)
    assert scheduler.plan(list(range(32))).decode_id == "d0"  # the most headroom
    for index, left in enumerate((30, 10)):
        view.models.inflight[f"mine-{index}"] = InFlight(f"mine-{index}", "p0", "d0", 100, left, 0.1, admitted_s=now,
                                                         reserved_s=now, first_token_s=now)
    assert view.rooms.headroom("d0") == 0 and view.rooms.headroom("d1") == 100
    assert scheduler.plan(list(range(32))).decode_id == "d1"
    assert view.rooms.release_wait_s("d0", needed_blocks=1, step_s=0.01) == pytest.approx(0.1)  # the 10 tokens to go

    alone = _scheduler(ttft_ms=10_000, decode_reserve_tokens=0)
    alone.view.stats["d0"] = _idle_stats("d0", num_free_seqs=2, num_waiting_handshakes=1)  # one place left
    alone.view.lines.observe("d0", num_granted=0, num_waiting=0, now_s=now - 1.0)
    assert alone.view.rooms.headroom("d0") > 0
    for index in range(3):  # sent since the reading, the last two past D's places, in its line
        alone.view.models.inflight[f"mine-{index}"] = InFlight(f"mine-{index}", "p0", "d0", 100, 10, 0.1,
                                                               admitted_s=now)
    assert alone.view.rooms.headroom("d0") == 0 and alone.view.rooms.num_joined_line("d0") == 2


def test_draining_workers_get_no_new_requests():
    from dataclasses import replace

    scheduler = _scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    scheduler.view.models.decode_model("d1").observe(decode_features(1, 0), 0.01)
    scheduler.view.models.decode_model("d1").observe(decode_features(16, 0), 0.16)
    scheduler.view.members["d0"] = replace(scheduler.view.members["d0"], draining=True)
    assert {scheduler.plan(list(range(i, i + 40))).decode_id for i in range(10)} == {"d1"}


def test_a_decode_workers_room_counts_what_its_requests_and_the_new_one_will_grow_to():
    """D keeps room for each request's next tokens (actors/decode_room.py): 50
    blocks free at the last reading, 24 of them kept for this replica's two
    requests decoding there (300 tokens each at their end, 110 now), leave room
    for a request of 132 tokens at its end (9 blocks) but not of 532 (34): that one
    waits in D's line."""
    scheduler = _scheduler(ttft_ms=10_000)
    scheduler.view.stats["d0"] = _idle_stats("d0", num_used_blocks=950)
    scheduler.view.lines.observe("d0", num_granted=10, num_waiting=1, now_s=time.monotonic() - 2.0)  # a line,
    scheduler.view.lines.observe("d0", num_granted=14, num_waiting=0, now_s=time.monotonic() - 1.0)  # gone since
    for name in ("a", "b"):
        scheduler.view.models.inflight[name] = InFlight(name, "p0", "d0", 100, 200, predicted_ttft_s=0.1,
                                                   admitted_s=time.monotonic() - 5.0, first_token_s=time.monotonic(),
                                                   num_generated=10)
    assert scheduler.view.rooms.headroom("d0") == 50 - 2 * 12
    assert scheduler.plan(list(range(32)), max_new_tokens=100).line_wait_s == 0.0
    waiting = scheduler.plan(list(range(32)), max_new_tokens=500)
    assert waiting.line_wait_s == pytest.approx(0.25, rel=1e-3)  # 1 / the 4 grants a second with a line


def _fixed_cost_models(now: float) -> WorkerModels:
    """p0's prefill: 10 ms a step whatever its size, and 0.1 ms a token; the clock stands at `now`."""
    models = WorkerModels(block_size=16, max_num_batched_tokens=1024, clock=lambda: now)
    for new in (16, 64, 256, 512):
        models.prefill_model("p0").observe(prefill_features(new, 0), 0.010 + 0.0001 * new)
    for batch in (1, 4, 16):
        models.decode_model("d0").observe(decode_features(batch, 0), 0.01 * batch)
    return models


def test_prompts_that_share_the_queues_steps_add_their_tokens_alone():
    """A burst of 16 prompts of 24 tokens fits in one 1024-token step: the first
    pays the step's 10 ms, the others 2.4 ms each (charged a step each, the last
    was predicted at 16 x 12.4 ms)."""
    now = time.monotonic()
    models = _fixed_cost_models(now)
    for index in range(16):
        prediction = models.predict("p0", "d0", num_prompt_tokens=24, cached_tokens=0)
        models.inflight[f"r{index}"] = InFlight(f"r{index}", "p0", "d0", 24, 10, prediction.ttft_s, admitted_s=now)
    assert prediction.ttft_s == pytest.approx(0.0124 + 15 * 0.0024, abs=0.005)


def test_a_prompt_past_the_queues_steps_pays_a_step_of_its_own():
    now = time.monotonic()
    models = _fixed_cost_models(now)
    models.inflight["long"] = InFlight("long", "p0", "d0", 1000, 10, predicted_ttft_s=0.11, admitted_s=now)
    assert models.own_prefill_s("p0", 20, 0) == pytest.approx(0.0020)  # 1000 + 20 tokens: in the queue's one step
    assert models.own_prefill_s("p0", 100, 0) == pytest.approx(0.0200)  # 1100: a second step
    models.inflight.clear()
    assert models.own_prefill_s("p0", 20, 0) == pytest.approx(0.0120)  # alone: its own step


def test_a_request_in_flight_knows_the_prefix_its_p_had_cached():
    """What the prefill pool's backlog leaves out (cluster/scaling_signals.py): the
    cached prompt tokens admission predicted on the P it chose."""
    from actors.block_pool import block_hashes

    prompt = list(range(320))
    scheduler = _scheduler(ttft_ms=10_000)
    scheduler.view.prefix["p0"].insert(block_hashes(prompt, 16, b"")[:16])  # 256 tokens
    seen = []

    async def first_token(request, choice, inflight):
        seen.append(inflight.num_cached_tokens)
        yield TokenEvent(request.request_id, [7], "x", None, True, "length", time.time())

    scheduler._events = first_token

    async def run():
        async for _ in scheduler.generate(prompt, SamplingParams(max_new_tokens=1), "r"):
            pass

    asyncio.run(run())
    assert seen == [256]


def test_a_ds_room_is_asked_only_for_the_blocks_its_prefix_cache_does_not_hold():
    """Found by a review: D held a shared 1024-token prefix and had 10 free blocks;
    its reservation needed 2 new ones, but the scheduler asked room for all 66,
    predicted a wait in D's line and answered 429. A burst of requests sharing
    the prefix was charged it once a request until D's next reading."""
    from actors.block_pool import block_hashes

    prompt = list(range(1040))
    hashes = block_hashes(prompt, 16, b"")
    scheduler = _scheduler(ttft_ms=1000, decode_reserve_tokens=0)
    view = scheduler.view
    view.stats["d0"] = _idle_stats("d0", num_used_blocks=990)
    for worker_id in ("p0", "d0"):
        view.prefix[worker_id].insert(hashes[:64])
    now = time.monotonic()
    view.lines.observe("d0", num_granted=10, num_waiting=1, now_s=now - 2.0)  # a line a moment ago, gone
    view.lines.observe("d0", num_granted=11, num_waiting=0, now_s=now - 0.1)
    choice = scheduler.plan(prompt, max_new_tokens=16)
    assert choice.decode_id == "d0" and choice.line_wait_s == 0.0
    # Found by the second read: a cached block no request holds saves no room (D counts it free, and
    # reusing it takes it from there): the blocks D's reading found idle are not taken as held
    view.stats["d0"] = _idle_stats("d0", num_used_blocks=935, num_cached_blocks=64)
    assert view.rooms.held_prefix_blocks("d0", hashes[:65]) == 0
    view.stats["d0"] = _idle_stats("d0", num_used_blocks=990, num_cached_blocks=10)
    assert view.rooms.held_prefix_blocks("d0", hashes[:65]) == 64 - 10
    # Sent since the reading, each charged the blocks D did not hold for running requests (and its growth)
    for index in range(5):
        view.models.inflight[f"r{index}"] = InFlight(f"r{index}", "p0", "d0", 1040, 16, predicted_ttft_s=0.1,
                                                     decode_held_blocks=64)
    assert view.rooms.headroom("d0") == 10 - 5 * 2


def _admit_a_burst_sharing_the_prompt(scheduler, prompt: list[int], usable: list[bytes]) -> None:
    """16 requests of the 1040-token prompt, as the scheduler admits them, each
    charged on d0 (its 100 free blocks) the whole prompt's 66 blocks, less those
    held there: the first all of them, each later one 2."""
    view = scheduler.view
    for index in range(16):
        choice = scheduler.plan(prompt, max_new_tokens=16)
        assert choice.decode_id == "d0" and choice.line_wait_s == 0.0, index
        view.models.inflight[f"r{index}"] = InFlight(
            f"r{index}", "p0", "d0", 1040, 16, predicted_ttft_s=choice.ttft_s, prefix_hashes=tuple(usable),
            decode_held_blocks=view.rooms.held_prefix_blocks("d0", usable))
    assert [r.decode_held_blocks for r in view.models.inflight.values()] == [0] + [64] * 15
    assert view.rooms.headroom("d0") == 100 - 66 - 15 * 2


def test_a_burst_sharing_a_prompt_d_holds_idle_is_charged_it_once():
    """D's reading found a 1024-token system prompt cached and idle (no request held
    it): a request's reservation revives those blocks, taking them from D's free
    room, so the first of a burst is charged the whole prompt. The rest share what
    it holds, but were each charged it too until D's next reading: a burst of 16
    asked for 16 x 66 blocks of a D with 100 free, predicted a wait in D's line,
    and answered 429s."""
    from actors.block_pool import block_hashes

    prompt = list(range(1040))
    hashes = block_hashes(prompt, 16, b"")
    scheduler = _scheduler(ttft_ms=60_000, decode_reserve_tokens=0)
    view = scheduler.view
    view.stats["d0"] = _idle_stats("d0", num_used_blocks=900, num_cached_blocks=64)
    for worker_id in ("p0", "d0"):
        view.prefix[worker_id].insert(hashes[:64])
    now = time.monotonic()
    view.lines.observe("d0", num_granted=0, num_waiting=0, now_s=now - 0.5)
    usable = hashes[:64]
    assert view.rooms.held_prefix_blocks("d0", usable) == 0  # idle: the first request revives them
    view.models.inflight["elsewhere"] = InFlight("elsewhere", "p0", "d1", 1040, 16, predicted_ttft_s=0.1,
                                                 prefix_hashes=tuple(usable))
    assert view.rooms.held_prefix_blocks("d0", usable) == 0  # (on another D)
    view.models.inflight["other"] = InFlight("other", "p0", "d0", 1040, 16, predicted_ttft_s=0.1,
                                             prefix_hashes=tuple(usable[:10]) + (b"x",))
    assert view.rooms.held_prefix_blocks("d0", usable) == 10  # its first 10 blocks are the prompt's
    view.models.inflight.clear()
    _admit_a_burst_sharing_the_prompt(scheduler, prompt, usable)
    # D's next reading: the burst's blocks in use, its idle ones (any prompt's, 80) more than the prompt's 64:
    # a request in flight there still holds the prompt's, which the next one shares
    view.stats["d0"] = _idle_stats("d0", num_used_blocks=900 + 66 + 15 * 2, num_cached_blocks=80)
    view.lines.observe("d0", num_granted=16, num_waiting=0, now_s=time.monotonic())
    assert view.rooms.held_prefix_blocks("d0", usable) == 64


def test_a_burst_sharing_a_new_prompt_is_charged_it_once():
    """A system prompt no worker holds yet: D's reservations lend the blocks still
    on their way (actors/arriving_blocks.py), so the first of a burst is charged
    the whole prompt and the rest what follows it. Each was charged the whole
    prompt, D's index holding none of it: 16 x 66 blocks of a D with 100 free, a
    wait in D's line predicted for all but the first."""
    from actors.block_pool import block_hashes

    prompt = list(range(1040))
    usable = block_hashes(prompt, 16, b"")[:64]
    scheduler = _scheduler(ttft_ms=60_000, decode_reserve_tokens=0)
    view = scheduler.view
    view.stats["d0"] = _idle_stats("d0", num_used_blocks=900)
    view.lines.observe("d0", num_granted=0, num_waiting=0, now_s=time.monotonic() - 0.5)
    _admit_a_burst_sharing_the_prompt(scheduler, prompt, usable)


def test_a_prompt_another_request_computes_on_p_is_charged_only_the_rest():
    """The blocks a request in prefill on P shares with the prompt are computed once:
    P's cache has them by this one's turn, or it waits for them
    (`Scheduler._waits_for_prefix`). A burst sharing a new system prompt was charged
    it once a request on P, its queue read as 16 prompts' work."""
    from actors.block_pool import block_hashes

    prompt = list(range(1040))
    usable = block_hashes(prompt, 16, b"")[:64]
    scheduler = _scheduler(ttft_ms=60_000)
    view = scheduler.view
    first = scheduler.plan(prompt, max_new_tokens=16)
    assert first.uncached_tokens == 1040
    view.models.inflight["r0"] = InFlight("r0", "p0", "d0", 1040, 16, predicted_ttft_s=first.ttft_s,
                                          prefix_hashes=tuple(usable))
    assert scheduler.plan(prompt, max_new_tokens=16).uncached_tokens == 1040 - 64 * 16
    view.models.inflight["r0"].first_token_s = time.monotonic()  # past P: its cache, as P's index shows it, tells
    assert scheduler.plan(prompt, max_new_tokens=16).uncached_tokens == 1040


def test_among_equally_busy_decode_workers_the_one_holding_the_prompt_is_chosen():
    """A conversation's next turn: d1's cache holds its history, d0 is next in
    turn (routed to less). d0 took it, and the whole history moved again; d1 is
    sent only the rest. Busier than d0, d1 is not chosen (load comes first)."""
    from actors.block_pool import block_hashes

    prompt = list(range(200))
    scheduler = _scheduler(ttft_ms=5000, decodes=("d0", "d1"))
    view = scheduler.view
    view.prefix["d1"].insert(block_hashes(prompt, 16, b"")[:12])
    view.num_routed.update(d0=3, d1=4)
    choice = scheduler.plan(prompt)
    assert choice.decode_id == "d1" and choice.prefill_id == "p0"
    view.models.inflight["running"] = InFlight("running", "p0", "d1", 100, 500, predicted_ttft_s=0.0,
                                               first_token_s=time.monotonic())
    assert scheduler.plan(prompt).decode_id == "d0"
