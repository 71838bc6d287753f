"""A worker's trace of its engine steps (actors/step_profile.py): its file's name."""

from __future__ import annotations


def test_two_traces_of_a_worker_in_one_second_have_names_of_their_own(monkeypatch, tmp_path):
    """Named to the second, the second trace was written over the first."""
    import actors.step_profile as step_profile

    times = iter([1_000_000.123, 1_000_000.456])
    monkeypatch.setattr(step_profile.time, "time", lambda: next(times))
    first, second = (step_profile.StepProfile(str(tmp_path), "p0") for _ in range(2))
    assert first.path != second.path and first.path.name.startswith("p0-")
