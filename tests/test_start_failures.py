"""Workers that fail to start: one whose start-up profile failed (its engine could
not run its first steps) gets no requests and the pool manager starts another;
workers that die starting (a corrupt checkpoint) are started again ever later,
not in a crash loop; /health says which role, which worker and why
(cluster/restart_backoff.py)."""

from __future__ import annotations

import asyncio
import shutil
import time
from concurrent.futures import Future

import ray

from actors.sampling_params import SamplingParams
from benchmarks.scheduler_driver import build_scheduler, complete, refreshing, run_with_pool, wait_ready

ENGINE = {"block_size": 16, "prefill_chunk_size": 64, "max_num_batched_tokens": 256, "num_kv_blocks": 256}
SETTINGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "engine": ENGINE,
    "prefill": {"replicas": 2},
    "decode": {"replicas": 1},
    "slo": {"early_rejection": False},
    "autoscaling": {"interval_s": 0.25, "restart_backoff_s": 0.5},
    "pool_name": "test-pool-failed-profile",
}
SHORT = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
INJECTED = "start-up profile failed: RuntimeError: injected: no memory for the KV blocks"


async def _failed_profile(pool, settings):
    def fail_profile(worker) -> None:  # (nested: Ray ships it by value to the worker)
        """As if the engine's first steps had raised (an injected fault)."""
        failed = Future()
        failed.set_exception(RuntimeError("injected: no memory for the KV blocks"))
        worker._ensure_started()
        worker._profiled = failed

    members = await pool.list_members.remote()
    first, second = [m.worker_id for m in members if m.role == "prefill"]
    handles = {m.worker_id: m.handle for m in members}
    await asyncio.gather(*(h.profile.remote() for h in handles.values()))  # all ran theirs: then one fails
    await handles[first].__ray_call__.remote(fail_profile)
    scheduler = build_scheduler(settings, pool)
    picks, failing = set(), None
    async with refreshing(scheduler, interval_s=0.25):
        await wait_ready(scheduler, timeout_s=180)
        deadline = asyncio.get_running_loop().time() + 180
        while asyncio.get_running_loop().time() < deadline:
            picks |= {scheduler.plan(list(range(100 + i, 160 + i))).prefill_id for i in range(5)}
            status, body = scheduler.view.health()
            failing = (status, body) if "failing" in body else failing
            routed = scheduler.view.profiled & set(scheduler.view.members)
            prefills = {w for w in routed if scheduler.view.members[w].role == "prefill"}
            if len(prefills) == 2 and first not in prefills and failing is not None:
                break
            await asyncio.sleep(0.1)
        tokens, error = await complete(scheduler, list(range(3, 43)), SHORT)
        events = await pool.scaling_events.remote()
        return dict(first=first, second=second, picks=picks, tokens=tokens, error=error,
                    prefills=prefills, failing=failing, events=events)


def test_a_worker_whose_profile_failed_gets_no_requests_and_another_starts(ray_local, tiny_qwen2_dir):
    r = run_with_pool(SETTINGS, _failed_profile)
    assert r["first"] not in r["picks"] and r["second"] in r["picks"]
    assert r["error"] is None and len(r["tokens"]) == 4
    failed = [e for e in r["events"] if e.kind == "start_failed"]
    assert [e.worker_id for e in failed] == [r["first"]]
    assert all(e.reason.startswith(INJECTED + "; next start in ") for e in failed), failed
    assert len([e for e in r["events"] if e.kind == "restart" and e.role == "prefill"]) == 1
    assert r["second"] in r["prefills"] and len(r["prefills"]) == 2  # a new one (seeded from it) serves beside it
    status, body = r["failing"]
    assert status == 200 and body["status"] == "ready"
    assert body["failing"]["prefill"]["worker_id"] == r["first"] and body["failing"]["prefill"]["error"] == INJECTED


def _broken_checkpoint(source, folder):
    """A copy of the model whose weights file is not a safetensors file."""
    shutil.copytree(source, folder)
    for weights in folder.glob("*.safetensors"):
        weights.write_bytes(b"not a checkpoint")
    return folder


async def _die_starting(pool, settings):
    scheduler = build_scheduler(settings, pool)
    async with refreshing(scheduler, interval_s=0.25):
        while True:  # each role's second failure in a row
            events = await pool.scaling_events.remote()
            if all(len([e for e in events if e.kind == "start_failed" and e.role == role]) >= 2
                   for role in ("prefill", "decode")):
                break
            await asyncio.sleep(0.25)
        # A refresh reads the pool's start failures (a fixed 0.5 s was too short for one on a slow CI machine)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (
                set(scheduler.view.start_failures) == {"prefill", "decode"}
                and all(f.failures_in_a_row >= 2 for f in scheduler.view.start_failures.values())):
            await asyncio.sleep(0.1)
        return dict(events=events, health=scheduler.view.health(), ready=scheduler.view.ready)


def test_workers_that_die_starting_are_started_again_ever_later_and_health_says_why(
        ray_local, tiny_qwen2_dir, tmp_path):
    broken = _broken_checkpoint(tiny_qwen2_dir, tmp_path / "broken")
    settings = {**SETTINGS, "model": {"path": str(broken)}, "prefill": {"replicas": 1},
                "autoscaling": {"interval_s": 0.25, "restart_backoff_s": 0.5},
                "pool_name": "test-pool-broken-checkpoint"}
    r = run_with_pool(settings, _die_starting)
    assert not r["ready"]
    for role in ("prefill", "decode"):
        events = [e for e in r["events"] if e.role == role and e.kind in ("start_failed", "restart")]
        failed = [e for e in events if e.kind == "start_failed"]
        assert all(e.reason.startswith("died starting: actors.checkpoint_error.CheckpointError: ") and "safetensors" in e.reason
                   for e in failed), failed
        assert [e.reason.rsplit("; ", 1)[1] for e in failed[:2]] == ["next start in 0.5 s", "next start in 1 s"]
        for failure, restart in zip(failed, [e for e in events if e.kind == "restart"]):
            assert events.index(restart) == events.index(failure) + 1  # one restart per failure, none sooner
            assert restart.time_s - failure.time_s >= float(failure.reason.rsplit(" ", 2)[1]) - 0.05
    status, body = r["health"]
    assert status == 503 and body["status"] == "failing" and set(body["failing"]) == {"prefill", "decode"}
    assert all("CheckpointError" in f["error"] and f["failures_in_a_row"] >= 2 for f in body["failing"].values())


async def _never_placed(pool, settings):
    deadline = asyncio.get_running_loop().time() + 120
    while asyncio.get_running_loop().time() < deadline:
        events = [e for e in await pool.scaling_events.remote() if e.role == "prefill"]
        if len([e for e in events if e.kind == "start_failed"]) >= 2:
            break
        await asyncio.sleep(0.25)
    return dict(events=events, failures=await pool.start_failures.remote())


def test_a_worker_no_node_takes_is_given_up_and_another_asked_for(ray_local, tiny_qwen2_dir):
    settings = {**SETTINGS, "prefill": {"replicas": 1, "label_selector": {"tandem/role": "nowhere"}},
                "autoscaling": {"interval_s": 0.25, "start_timeout_s": 1.0, "restart_backoff_s": 0.5},
                "pool_name": "test-pool-never-placed"}
    r = run_with_pool(settings, _never_placed)
    kinds = [e.kind for e in r["events"]]
    assert kinds[:5] == ["started", "start_failed", "restart", "started", "start_failed"], kinds
    failed = [e for e in r["events"] if e.kind == "start_failed"]
    assert [e.reason for e in failed[:2]] == ["not ready within 1 s (no node for it?); next start in 0.5 s",
                                              "not ready within 1 s (no node for it?); next start in 1 s"]
    failure = r["failures"]["prefill"]
    assert failure.failures_in_a_row >= 2 and failure.error == "not ready within 1 s (no node for it?)"


async def _killed_after_profile(pool, settings):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120  # (a listing waits up to 30 s for workers to come up; a loaded machine took longer)
    while not (decodes := [m for m in await pool.list_members.remote() if m.role == "decode"]):
        if loop.time() > deadline:
            raise TimeoutError("no decode worker listed")
        await asyncio.sleep(0.25)
    (decode,) = decodes
    await decode.handle.profile.remote()
    worker_id = decode.worker_id

    def answered(manager) -> bool:  # (nested: Ray ships it by value to the pool manager)
        return manager.scaler.has_started(worker_id)
    # The pool's own profile call answered too: its reply may come after this one (a clean-clone
    # run killed the worker first, and the pool's call failed with it: a start failure)
    deadline = loop.time() + 30
    while not await pool.__ray_call__.remote(answered) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    ray.kill(decode.handle)  # long before the next control step reads its stats
    deadline = loop.time() + 60
    while loop.time() < deadline:
        events = [e for e in await pool.scaling_events.remote() if e.worker_id == decode.worker_id]
        if any(e.kind in ("replaced", "start_failed") for e in events):
            break
        await asyncio.sleep(0.1)
    return dict(worker_id=decode.worker_id, kinds=[e.kind for e in events],
                failures=await pool.start_failures.remote())


def test_a_worker_killed_just_after_its_profile_answered_is_replaced_at_once_not_a_start_failure(
        ray_local, tiny_qwen2_dir):
    # A control step every 30 s: the pool learns that the profile ran from the
    # profile's own answer, not from stats a step reads.
    settings = {**SETTINGS, "prefill": {"replicas": 1}, "autoscaling": {"interval_s": 30.0},
                "pool_name": "test-pool-killed-after-profile"}
    r = run_with_pool(settings, _killed_after_profile)
    assert "replaced" in r["kinds"] and "start_failed" not in r["kinds"], r["kinds"]
    assert r["failures"] == {}


async def _slower_than_the_first_listing(pool, settings):
    def impatient(manager) -> None:  # (nested: Ray ships it by value to the pool manager)
        manager.initial_wait_s = 0.01  # as if the workers took longer to start than the first listing waits

    await pool.__ray_call__.remote(impatient)
    first = await pool.list_members.remote()
    deadline = asyncio.get_running_loop().time() + 120
    while asyncio.get_running_loop().time() < deadline:
        ready = [e.worker_id for e in await pool.scaling_events.remote() if e.kind == "ready"]
        if len(ready) == 2:
            break
        await asyncio.sleep(0.1)
    return dict(first=first, ready=ready, listed=await pool.list_members.remote())


def test_workers_slower_than_the_first_listing_are_listed_once_up(ray_local, tiny_qwen2_dir):
    # The first listing's wait timed out before, cancelled the workers' first
    # answers, and from then on every listing and control step raised CancelledError.
    settings = {**SETTINGS, "prefill": {"replicas": 1}, "pool_name": "test-pool-slow-start"}
    r = run_with_pool(settings, _slower_than_the_first_listing)
    assert r["first"] == []
    assert sorted(r["ready"]) == ["d1", "p0"] and sorted(m.worker_id for m in r["listed"]) == ["d1", "p0"]
