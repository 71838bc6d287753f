"""Traces of the workers' engine steps (actors/step_profile.py, `/start_profile`
through cluster/pool_view.py): a trace's file name, and a start that fails on
one worker."""

from __future__ import annotations

import asyncio

import pytest

import actors.step_profile as step_profile
from cluster.api_models import ApiError
from cluster.pool_manager import Member
from tests.scheduler_setup import make_scheduler
from tests.test_scheduler_retries import _remote


def test_two_traces_of_a_worker_in_one_second_have_names_of_their_own(monkeypatch, tmp_path):
    """Named to the second, the second trace was written over the first."""
    times = iter([1_000_000.123, 1_000_000.456])
    monkeypatch.setattr(step_profile.time, "time", lambda: next(times))
    first, second = (step_profile.StepProfile(str(tmp_path), "p0") for _ in range(2))
    assert first.path != second.path and first.path.name.startswith("p0-")


def test_a_start_that_fails_on_one_worker_leaves_none_tracing():
    """One node could not make profile_dir: the client got a 500 while the others
    traced on without bound (no num_steps), every event held in memory."""
    tracing = set()

    class Worker:
        def __init__(self, worker_id: str, can_write: bool) -> None:
            async def start(folder, *options):
                if not can_write:
                    raise PermissionError(13, "Permission denied", folder)
                tracing.add(worker_id)
                return f"{folder}/{worker_id}.trace.json.gz"

            async def stop():
                tracing.discard(worker_id)

            self.start_profile, self.stop_profile = _remote(start), _remote(stop)

    view = make_scheduler(ttft_ms=1000, decodes=("d0", "d1")).view
    view.members = {w: Member(w, role, handle=Worker(w, can_write=w != "d1"))
                    for w, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))}
    with pytest.raises(ApiError) as refused:
        asyncio.run(view.start_profiles("/traces", None, False, False))
    assert refused.value.status == 500 and tracing == set()
