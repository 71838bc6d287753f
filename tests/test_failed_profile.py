"""A worker whose start-up profile failed (its engine could not run its first
steps) gets no requests, whether it is the first of its role (profiled) or a later
one (seeded from a peer's models), and /health names it with why; its role's
other workers serve on."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

from actors.sampling_params import SamplingParams
from benchmarks.scheduler_driver import build_scheduler, complete, refreshing, run_with_pool, wait_ready

SETTINGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "engine": {"block_size": 16, "prefill_chunk_size": 64, "max_num_batched_tokens": 256, "num_kv_blocks": 256},
    "prefill": {"replicas": 3},
    "decode": {"replicas": 1},
    "slo": {"early_rejection": False},
    "pool_name": "test-pool-failed-profile",
}
SHORT = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


async def _scenario(pool, settings):
    def fail_profile(worker) -> None:  # (nested: Ray ships it by value to the worker)
        """As if the engine's first steps had raised (an injected fault)."""
        failed = Future()
        failed.set_exception(RuntimeError("injected: no memory for the KV blocks"))
        worker._ensure_started()
        worker._profiled = failed

    members = await pool.list_members.remote()
    # The scheduler looks at members in this order: the first P is profiled (no
    # peer yet), the second too, and the third seeded from the second's models.
    first, second, third = [m.worker_id for m in members if m.role == "prefill"]
    handles = {m.worker_id: m.handle for m in members}
    await asyncio.gather(handles[first].__ray_call__.remote(fail_profile),
                         handles[third].__ray_call__.remote(fail_profile))
    scheduler = build_scheduler(settings, pool)
    async with refreshing(scheduler, interval_s=0.5):
        await wait_ready(scheduler, timeout_s=180, workers=2)
        await asyncio.sleep(1.5)  # a few more refreshes
        picks = {scheduler.plan(list(range(100 + i, 160 + i))).prefill_id for i in range(20)}
        tokens, error = await complete(scheduler, list(range(3, 43)), SHORT)
        return dict(first=first, second=second, third=third, picks=picks, tokens=tokens, error=error,
                    profiled=set(scheduler.profiled), errors=dict(scheduler.profile_errors),
                    health=scheduler.health())


def test_a_worker_whose_profile_failed_gets_no_requests_and_health_names_it(ray_local, tiny_qwen2_dir):
    r = run_with_pool(SETTINGS, _scenario)
    assert r["picks"] == {r["second"]}
    assert r["error"] is None and len(r["tokens"]) == 4
    assert r["first"] not in r["profiled"] and r["third"] not in r["profiled"] and r["second"] in r["profiled"]
    assert set(r["errors"]) == {r["first"], r["third"]}
    assert all(e == "start-up profile failed: RuntimeError: injected: no memory for the KV blocks"
               for e in r["errors"].values()), r["errors"]
    status, body = r["health"]
    assert status == 200 and body["status"] == "ready" and body["failing"] == r["errors"]
