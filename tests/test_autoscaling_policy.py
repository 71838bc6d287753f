"""The per-pool scaling policies on sequences of observations, with an injected
clock (no Ray, no sleeping): bounds, one step at a time, cooldowns, hysteresis, and
P and D answering to their own signals only."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from cluster.autoscaling import Action, DecodeScaling, PoolObservation, PrefillScaling, make_policy
from cluster.config import AppSettings, AutoscalingSettings, PoolSettings

KNOBS = AutoscalingSettings(scale_up_cooldown_s=10, scale_down_cooldown_s=60, prefill_backlog_up_tokens=4000,
                            prefill_backlog_down_tokens=500, kv_usage_up=0.8, kv_usage_down=0.3,
                            scale_down_margin=0.05)
POOL = PoolSettings(replicas=1, min_replicas=1, max_replicas=3)


def prefill(**knobs) -> PrefillScaling:
    return PrefillScaling(POOL, KNOBS.model_copy(update=knobs), attainment_target=0.9)


def decode() -> DecodeScaling:
    return DecodeScaling(POOL, KNOBS, attainment_target=0.9)


def run(policy, steps):
    """steps: (now_s, observation) pairs -> the actions decided, in order."""
    return [policy.decide(obs, now).action for now, obs in steps]


def test_prefill_backlog_scales_up_once_then_waits_for_the_new_worker():
    policy = prefill()
    busy = PoolObservation(num_serving=1, backlog_tokens=9000)
    decision = policy.decide(busy, 100.0)
    assert decision.action is Action.UP and decision.signal == "prefill_backlog"
    assert "9000 tokens per worker" in decision.reason
    # The new worker starts: nothing more while it does, however long the backlog.
    starting = PoolObservation(num_serving=1, num_starting=1, backlog_tokens=20000)
    assert run(policy, [(t, starting) for t in (102.0, 110.0, 130.0)]) == [Action.HOLD] * 3
    # Ready at 130: the up cooldown counts from there.
    still_busy = PoolObservation(num_serving=2, backlog_tokens=20000)
    assert policy.decide(still_busy, 135.0).signal == "cooldown"
    assert policy.decide(still_busy, 141.0).action is Action.UP


def test_a_step_done_within_one_round_starts_the_cooldown_all_the_same():
    """Found by a review: a drain over (or a worker ready) before the next round
    was never seen in progress, and the cooldown counted from the step before:
    with 10 s rounds and 5 s drains, a scale-down every round (60 s asked);
    a worker that started fast, a scale-up every round (10 s asked)."""
    def carried_out(policy, steps):  # (as the autoscaler does: each step decided is taken)
        actions = []
        for now, obs in steps:
            actions.append(policy.decide(obs, now).action)
            if actions[-1] is not Action.HOLD:
                policy.stepped(now)
        return actions

    idle = PoolObservation(num_serving=3, backlog_tokens=0)  # (the pool never seen draining: 3 each round)
    assert carried_out(prefill(), [(t, idle) for t in range(100, 170, 10)]) == [Action.DOWN] + [Action.HOLD] * 5 + [
        Action.DOWN]
    busy = PoolObservation(num_serving=1, backlog_tokens=20000)
    ups = carried_out(prefill(scale_up_cooldown_s=30), [(t, busy) for t in range(100, 160, 10)])
    assert ups == [Action.UP, Action.HOLD, Action.HOLD, Action.UP, Action.HOLD, Action.HOLD]
    assert run(prefill(), [(t, idle) for t in range(100, 130, 10)]) == [Action.DOWN] * 3  # (decided, not taken)


def test_pressure_while_a_scaled_down_worker_drains_takes_it_back_at_once():
    """One step at a time held a scale-up for the whole drain of the worker a
    scale-down had just chosen (up to `drain_timeout_s`), then started a new
    one, a model load away. That worker is warm: taken back, without a cooldown.
    Not one drained by hand, nor while another starts, nor past the maximum."""
    busy = dict(num_serving=1, num_draining=1, backlog_tokens=9000)
    decision = prefill().decide(PoolObservation(**busy, num_recallable=1), 100.0)
    assert decision.action is Action.UP and decision.signal == "prefill_backlog"
    assert decision.reason.endswith("a worker scaled down and still draining is taken back")
    assert prefill().decide(PoolObservation(**busy), 100.0).signal == "in_progress"  # drained by hand
    assert prefill().decide(PoolObservation(**busy, num_recallable=1, num_starting=1), 100.0).signal == "in_progress"
    at_max = PoolObservation(**{**busy, "num_serving": 3}, num_recallable=1)
    assert prefill().decide(at_max, 100.0).signal == "in_progress"
    calm = PoolObservation(num_serving=1, num_draining=1, num_recallable=1, backlog_tokens=100)
    assert prefill().decide(calm, 100.0).signal == "in_progress"


def test_ttft_attainment_below_target_scales_prefill_up():
    decision = prefill().decide(PoolObservation(num_serving=2, attainment=0.7, num_samples=20), 0.0)
    assert decision.action is Action.UP and decision.signal == "ttft_attainment"
    assert "70%" in decision.reason and "90%" in decision.reason


def test_never_above_max_nor_below_min():
    policy = prefill()
    at_max = PoolObservation(num_serving=3, backlog_tokens=10**6, attainment=0.1, num_samples=50)
    decision = policy.decide(at_max, 0.0)
    assert decision.action is Action.HOLD and decision.signal == "at_max"
    idle_at_min = PoolObservation(num_serving=1)
    assert run(policy, [(t, idle_at_min) for t in (0.0, 100.0, 1000.0)]) == [Action.HOLD] * 3
    assert policy.decide(PoolObservation(num_serving=0), 0.0).signal == "below_min"
    assert policy.decide(PoolObservation(num_serving=4), 0.0).signal == "above_max"


def test_hysteresis_holds_between_the_thresholds():
    policy = prefill()
    # 2 workers, 1500 tokens each: above the down threshold, below the up one.
    middling = PoolObservation(num_serving=2, backlog_tokens=3000)
    assert run(policy, [(t, middling) for t in range(0, 600, 30)]) == [Action.HOLD] * 20


def test_scale_down_waits_for_its_cooldown_and_one_fewer_must_still_fit():
    policy = prefill()
    policy.decide(PoolObservation(num_serving=1, num_starting=1), 0.0)  # a scale-up finished at t=0
    idle = PoolObservation(num_serving=2, backlog_tokens=0)
    assert policy.decide(idle, 30.0).signal == "cooldown"
    decision = policy.decide(idle, 61.0)
    assert decision.action is Action.DOWN and decision.signal == "idle"
    # 1400 tokens over 3 workers: 467 each, under the down threshold (500), and 700
    # each over the 2 that would remain, under the up threshold (4000): down.
    assert prefill().decide(PoolObservation(num_serving=3, backlog_tokens=1400), 0.0).action is Action.DOWN
    # With the up threshold at 600, the 2 remaining workers would be over it: stay.
    tight = prefill(prefill_backlog_up_tokens=600, prefill_backlog_down_tokens=500)
    assert tight.decide(PoolObservation(num_serving=3, backlog_tokens=1400), 0.0).action is Action.HOLD


def test_scale_down_needs_attainment_above_target_plus_margin():
    policy = prefill()
    # 92% meets the 90% target but not target + 5%: hold, not down.
    assert policy.decide(PoolObservation(num_serving=2, attainment=0.92, num_samples=30), 0.0).action is Action.HOLD
    assert policy.decide(PoolObservation(num_serving=2, attainment=0.97, num_samples=30), 0.0).action is Action.DOWN
    # No requests at all (attainment unknown) and no backlog: the pool is idle.
    assert prefill().decide(PoolObservation(num_serving=2), 0.0).action is Action.DOWN


def test_no_more_than_one_scale_down_in_the_minute_after_a_scale_up():
    """A load spike then silence: up, then at most one down within 60 s of the up."""
    policy = prefill()
    timeline = [(0.0, PoolObservation(num_serving=1, backlog_tokens=50000))]
    timeline += [(t, PoolObservation(num_serving=1, num_starting=1)) for t in (2.0, 4.0, 20.0)]
    timeline += [(float(t), PoolObservation(num_serving=2)) for t in range(22, 200, 2)]
    actions = [(now, policy.decide(obs, now).action) for now, obs in timeline]
    ups = [now for now, a in actions if a is Action.UP]
    downs = [now for now, a in actions if a is Action.DOWN]
    assert ups == [0.0]
    assert all(now - ups[0] >= 60 for now in downs) and downs


def _steady(policy, attainment_at, rate_at, until_s: float, start_s: float = 20.0) -> list:
    """Run a pool whose attainment and load (requests a second) are functions of
    its size and the time; a worker starts in 20 s, drains in 10. Outcomes are
    counted as the pool manager counts them: those since the pool last changed,
    within the 30 s window. Its (time, action, size)s."""
    size, starting, draining, settled, steps = 1, None, None, -1e9, []
    for now in range(0, int(until_s), 2):
        if starting is not None and now >= starting:
            size, starting, settled = size + 1, None, now
        if draining is not None and now >= draining:
            size, draining, settled = size - 1, None, now
        span = min(30.0, now - settled)
        obs = PoolObservation(num_serving=size, num_starting=int(starting is not None),
                              num_draining=int(draining is not None), attainment=attainment_at(size, now),
                              num_samples=round(rate_at(now) * span), samples_span_s=span, kv_blocks_used=20,
                              kv_blocks_total=100 * size, kv_blocks_used_peak=20)
        action = policy.decide(obs, float(now)).action
        if action is Action.UP:
            starting = now + start_s
        elif action is Action.DOWN:
            draining = now + 10
        if action is not Action.HOLD:
            steps.append((now, action, size))
    return steps


def test_a_size_that_fell_short_is_not_come_back_to_under_the_same_load():
    """A steady load one decode worker serves at 60% TBT attainment, two at 100%:
    up once, and the pool stays at two (it came back to one at each down cooldown,
    fell short, and went up again: a worker started and drained every 96 s)."""
    steps = _steady(decode(), lambda size, now: 0.6 if size == 1 else 1.0, lambda now: 2.0, until_s=1200)
    assert steps == [(0, Action.UP, 1)]


def test_a_size_that_fell_short_serves_again_once_the_load_falls_or_the_memory_ends():
    """The load compared as a rate: attainment counts outcomes since the pool last
    changed, and a count taken seconds after a step (the least seen while short)
    was below any window's count, so the load never read as fallen."""
    load_falls = _steady(decode(), lambda size, now: 0.6 if size == 1 and now < 300 else 1.0,
                         lambda now: 2.0 if now < 300 else 1.2, until_s=600)
    assert [action for _, action, _ in load_falls] == [Action.UP, Action.DOWN]
    assert load_falls[1][0] >= 300  # (down only once the load fell: 1.2 a second is under 0.8 of 2)
    policy = DecodeScaling(POOL, KNOBS.model_copy(update={"shortfall_memory_s": 300}), attainment_target=0.9)
    forgotten = _steady(policy, lambda size, now: 0.6 if size == 1 and now < 100 else 1.0, lambda now: 2.0,
                        until_s=600)
    assert [action for _, action, _ in forgotten] == [Action.UP, Action.DOWN] and forgotten[1][0] >= 300
    policy = decode()  # short at one worker 2 s after a step (4 outcomes: 2 a second), then 1.2 a second at two
    short = PoolObservation(num_serving=1, attainment=0.6, num_samples=4, samples_span_s=2.0, kv_blocks_used=20,
                            kv_blocks_total=100)
    assert policy.decide(short, 100.0).action is Action.UP
    policy.decide(dataclasses.replace(short, num_starting=1), 120.0)
    met = PoolObservation(num_serving=2, attainment=1.0, num_samples=36, samples_span_s=30.0, kv_blocks_used=20,
                          kv_blocks_total=200, kv_blocks_used_peak=20)
    assert policy.decide(met, 300.0).action is Action.DOWN  # (36 outcomes were more than 0.8 of the 4)


def test_decode_scales_on_kv_usage_and_tbt_only():
    policy = decode()
    full = PoolObservation(num_serving=1, kv_blocks_used=900, kv_blocks_total=1000)
    decision = policy.decide(full, 0.0)
    assert decision.action is Action.UP and decision.signal == "kv_usage" and "90%" in decision.reason
    slow = PoolObservation(num_serving=2, kv_blocks_used=100, kv_blocks_total=2000, attainment=0.5, num_samples=9)
    assert decode().decide(slow, 0.0).signal == "tbt_attainment"
    # A prefill backlog is not the decode pool's business.
    backlog = PoolObservation(num_serving=1, backlog_tokens=10**6, kv_blocks_used=10, kv_blocks_total=1000)
    assert decode().decide(backlog, 0.0).action is Action.HOLD


def test_decode_scale_down_when_kv_would_still_fit_in_one_fewer():
    # 2 workers at 25% each: 50% on one, under 80%: down.
    light = PoolObservation(num_serving=2, kv_blocks_used=500, kv_blocks_total=2000)
    assert decode().decide(light, 0.0).action is Action.DOWN
    # 3 workers at 29%: under the down threshold, but with 2 left 43% < 80%: down.
    assert decode().decide(PoolObservation(num_serving=3, kv_blocks_used=870, kv_blocks_total=3000),
                           0.0).action is Action.DOWN
    # 35% is above the down threshold: hold.
    assert decode().decide(PoolObservation(num_serving=2, kv_blocks_used=700, kv_blocks_total=2000),
                           0.0).action is Action.HOLD


def test_scale_down_needs_the_load_low_over_the_whole_window():
    """Clients that start and end together: KV use dips to 1% between waves. The
    dip alone must not take a worker away; its peak over the window decides."""
    dip = PoolObservation(num_serving=2, kv_blocks_used=20, kv_blocks_total=2000, kv_blocks_used_peak=600)
    assert decode().decide(dip, 0.0).action is Action.HOLD
    quiet = PoolObservation(num_serving=2, kv_blocks_used=20, kv_blocks_total=2000, kv_blocks_used_peak=40)
    assert decode().decide(quiet, 0.0).action is Action.DOWN
    lull = PoolObservation(num_serving=2, backlog_tokens=0, backlog_tokens_peak=9000)
    assert prefill().decide(lull, 0.0).action is Action.HOLD


def test_prefill_ignores_kv_usage():
    full_kv = PoolObservation(num_serving=1, kv_blocks_used=1000, kv_blocks_total=1000)
    assert prefill().decide(full_kv, 0.0).action is Action.HOLD


def test_make_policy_per_role():
    assert isinstance(make_policy("prefill", POOL, KNOBS, 0.9), PrefillScaling)
    assert isinstance(make_policy("decode", POOL, KNOBS, 0.9), DecodeScaling)
    with pytest.raises(ValueError, match="colocated"):
        make_policy("colocated", POOL, KNOBS, 0.9)


# ---- the manifest's bounds and knobs ---------------------------------------------------
def test_pool_bounds_default_to_the_initial_size():
    pool = PoolSettings(replicas=2)
    assert (pool.min_size, pool.max_size, pool.autoscales) == (2, 2, False)
    assert PoolSettings(replicas=1, max_replicas=4).autoscales


@pytest.mark.parametrize("pool, message", [
    ({"replicas": 3, "max_replicas": 2}, r"replicas \(3, the initial size\) is above max_replicas \(2\)"),
    ({"replicas": 1, "min_replicas": 2}, r"replicas \(1, the initial size\) is below min_replicas \(2\)"),
    ({"replicas": 2, "min_replicas": 3, "max_replicas": 2}, r"min_replicas \(3\) is above max_replicas \(2\)"),
    ({"replicas": 1, "min_replicas": 0, "max_replicas": 2}, "min_replicas >= 1"),
])
def test_bad_bounds_are_refused_clearly(pool, message):
    with pytest.raises(ValidationError, match=message):
        AppSettings.model_validate({"model": {"preset": "tiny"}, "prefill": pool})


@pytest.mark.parametrize("knobs, message", [
    ({"kv_usage_up": 0.3, "kv_usage_down": 0.5}, "kv_usage_down must be below kv_usage_up"),
    ({"prefill_backlog_up_tokens": 100, "prefill_backlog_down_tokens": 100}, "prefill_backlog_down_tokens"),
    ({"interval_s": 0}, "interval_s"),
])
def test_bad_knobs_are_refused_clearly(knobs, message):
    with pytest.raises(ValidationError, match=message):
        AppSettings.model_validate({"model": {"preset": "tiny"}, "autoscaling": knobs})


def test_colocated_pools_do_not_autoscale():
    with pytest.raises(ValidationError, match="only the prefill and decode pools autoscale"):
        AppSettings.model_validate({"model": {"preset": "tiny"}, "mode": "colocated",
                                    "colocated": {"replicas": 1, "max_replicas": 2}})


def test_a_redeploys_slo_and_knobs_retune_the_autoscaler_and_its_cooldowns_run_on():
    """`PoolAutoscaler.retune` (a redeploy's `autoscaling` and `slo`, through
    `PoolManager.apply_pools`): new outcomes are judged by the new SLO, the
    policies take the new target and knobs, and each keeps when its pool last
    settled."""
    from types import SimpleNamespace

    from cluster.pool_autoscaler import PoolAutoscaler

    settings = AppSettings.model_validate({"model": {"preset": "tiny"},
                                           "prefill": {"replicas": 1, "min_replicas": 1, "max_replicas": 4}})
    scaler = PoolAutoscaler(SimpleNamespace(members={}), settings, ("prefill", "decode"), clock=lambda: 100.0)
    scaler.policies["prefill"].settled_s = 90.0
    redeployed = AppSettings.model_validate({
        "model": {"preset": "tiny"}, "prefill": {"replicas": 1, "min_replicas": 1, "max_replicas": 4},
        "slo": {"ttft_ms": 200, "tbt_ms": 50, "attainment": 0.95},
        "autoscaling": {"window_s": 10, "scale_up_cooldown_s": 5, "restart_backoff_s": 1, "restart_backoff_max_s": 8}})
    scaler.retune(redeployed)
    assert scaler.signals.slo_s == {"ttft": 0.2, "tbt": 0.05} and scaler.signals.window_s == 10
    policy = scaler.policies["prefill"]
    assert policy.target == 0.95 and policy.knobs.scale_up_cooldown_s == 5 and policy.settled_s == 90.0
    assert set(scaler.policies) == {"prefill"}  # the fixed decode pool still has none
    assert (scaler.restarts.first_s, scaler.restarts.max_s) == (1, 8)
    assert [(e.role, e.kind) for e in scaler.events] == [("prefill", "retuned"), ("decode", "retuned")]
