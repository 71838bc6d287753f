"""Restarts of workers that failed to start: each failure in a row of a role waits
twice as long as the one before, up to a cap; a worker of the role that runs its
start-up profile ends the run (cluster/restart_backoff.py)."""

from __future__ import annotations

import pytest

from cluster.restart_backoff import RestartBackoff, StartFailure, death_reason


def test_each_failure_in_a_row_waits_twice_as_long_up_to_the_cap():
    backoff = RestartBackoff(first_s=2.0, max_s=10.0)
    delays = [backoff.failed("prefill", f"p{i}", "boom", now_s=100.0 * i) for i in range(5)]
    assert delays == [2.0, 4.0, 8.0, 10.0, 10.0]


def test_roles_back_off_apart():
    backoff = RestartBackoff(first_s=1.0, max_s=60.0)
    backoff.failed("prefill", "p0", "boom", 0.0)
    backoff.failed("prefill", "p1", "boom", 0.0)
    assert backoff.failed("decode", "d2", "boom", 0.0) == 1.0


def test_a_worker_started_since_the_latest_failure_ends_the_run_an_older_one_does_not():
    backoff = RestartBackoff(first_s=1.0, max_s=60.0)
    backoff.failed("decode", "d0", "boom", 5.0)
    backoff.failed("decode", "d1", "boom", 7.0)
    backoff.started("decode", started_s=6.0)  # (started before d1 failed)
    assert backoff.failures(7.0)["decode"].failures_in_a_row == 2
    backoff.started("decode", started_s=8.0)
    assert "decode" not in backoff.failures(8.0)
    assert backoff.failed("decode", "d2", "boom", 9.0) == 1.0


def test_a_restart_is_taken_once_when_due_and_counts_as_waiting_until_then():
    backoff = RestartBackoff(first_s=1.0, max_s=60.0)
    backoff.failed("prefill", "p0", "boom", now_s=10.0)  # due at 11
    backoff.failed("prefill", "p1", "boom", now_s=10.0)  # due at 12
    assert backoff.take_due(10.5) == [] and backoff.num_waiting("prefill") == 2
    assert backoff.take_due(11.0) == ["prefill"] and backoff.num_waiting("prefill") == 1
    assert backoff.take_due(13.0) == ["prefill"] and backoff.num_waiting("prefill") == 0
    assert backoff.take_due(100.0) == []


def test_failures_name_the_latest_worker_why_and_when_the_next_starts():
    backoff = RestartBackoff(first_s=2.0, max_s=60.0)
    backoff.failed("prefill", "p0", "first", now_s=0.0)  # due at 2
    backoff.failed("prefill", "p3", "second", now_s=1.0)  # due at 5
    assert backoff.failures(1.5) == {"prefill": StartFailure("p3", "second", 2, 0.5)}
    backoff.take_due(10.0)
    assert backoff.failures(10.0) == {"prefill": StartFailure("p3", "second", 2, None)}
    backoff.started("prefill", started_s=10.0)
    assert backoff.failures(10.0) == {}


def test_death_reason_is_the_constructors_exception_or_the_first_line():
    traceback = ("The actor died because of an error raised in its creation task, \x1b[36mray::W.__init__()\x1b[39m "
                 "(pid=1)\n  File \"/a.py\", line 3, in __init__\n    raise ValueError('bad header')\n"
                 "           ^^^^^^^^\nValueError: bad header\nsecond line")
    assert death_reason(RuntimeError(traceback)) == "ValueError: bad header second line"
    assert death_reason(RuntimeError("The actor died unexpectedly.\nmore")) == "The actor died unexpectedly."
    assert death_reason(RuntimeError("")) == "RuntimeError"


def test_the_cap_must_not_be_below_the_first_delay():
    from pydantic import ValidationError

    from cluster.config import AutoscalingSettings

    with pytest.raises(ValidationError, match="restart_backoff_max_s"):
        AutoscalingSettings(restart_backoff_s=10, restart_backoff_max_s=5)


def test_a_waiting_restart_counts_as_starting_so_the_policy_holds_rather_than_start_one_through_its_minimum():
    from types import SimpleNamespace

    from cluster.autoscaling import Action
    from cluster.config import AppSettings
    from cluster.pool_autoscaler import PoolAutoscaler

    settings = AppSettings.model_validate({"model": {"preset": "tiny"},
                                           "prefill": {"replicas": 1, "min_replicas": 1, "max_replicas": 2}})
    scaler = PoolAutoscaler(SimpleNamespace(members={}), settings, ("prefill", "decode"), clock=lambda: 100.0)
    policy = scaler.policies["prefill"]
    assert policy.decide(scaler.observe("prefill", 100.0), 100.0).action is Action.UP  # below its minimum
    scaler.restarts.failed("prefill", "p0", "died starting: boom", 100.0)
    observation = scaler.observe("prefill", 100.0)
    assert observation.num_starting == 1 and policy.decide(observation, 100.0).action is Action.HOLD


def test_a_thousand_failures_in_a_row_wait_the_cap_not_an_overflow():
    """The delay doubled as a float product, which overflowed at the 1025th failure
    in a row (34 h at a 120 s cap: a bad checkpoint over a weekend): the error
    stopped each control step, and workers started every other step, unthrottled."""
    backoff = RestartBackoff(first_s=2.0, max_s=120.0)
    delays = [backoff.failed("decode", f"d{i}", "died starting", float(i)) for i in range(1100)]
    assert delays[-1] == 120.0 and max(delays) == 120.0


def test_a_restart_started_between_a_rounds_failures_ends_the_run_once_it_runs_its_profile():
    """Two workers started together fail at 5 s and 8 s (one round); the first's
    restart, started at 7 s, runs its profile: the run is over. The round took the
    time of its latest failure (8 s), so /health said failing on, and the next
    failure waited twice as long."""
    backoff = RestartBackoff(first_s=2.0, max_s=60.0)
    assert backoff.failed("prefill", "p0", "boom", 5.0, started_s=0.0) == 2.0
    assert backoff.failed("prefill", "p1", "boom", 8.0, started_s=0.0) == 2.0  # (of p0's round)
    backoff.started("prefill", started_s=7.0)  # p0's restart
    assert backoff.failures(9.0) == {}
    assert backoff.failed("prefill", "p3", "boom", 12.0, started_s=10.0) == 2.0, "a new run"


def test_a_worker_started_before_the_latest_failure_is_of_its_round():
    """Failures of workers of one start (lost together) are one failure in the
    run, with one delay; a worker started after them failing is the next."""
    backoff = RestartBackoff(first_s=2.0, max_s=60.0)
    assert [backoff.failed("decode", f"d{i}", "node lost", 10.0, started_s=5.0) for i in range(3)] == [2.0] * 3
    assert backoff.failures(10.0)["decode"].failures_in_a_row == 1
    assert backoff.failed("decode", "d4", "node lost", 13.0, started_s=12.0) == 4.0
    assert backoff.failed("decode", "d5", "boom", 20.0, restart=False, started_s=15.0) == 8.0
    assert backoff.failures(20.0)["decode"].failures_in_a_row == 3 and backoff.num_waiting("decode") == 4
    assert backoff.held_s("decode", 21.0) == 7.0  # (no restart waits for it: the pool's next start does)
    assert backoff.drop_waiting("decode") and backoff.num_waiting("decode") == 3
