"""A fixed pool keeps its size: a worker drained by hand is started anew at once
(never below the pool's minimum), and a redeploy's new `replicas` reaches the
pool manager through the first refresh of a new scheduler replica, which brings
the pool to it, up or down (cluster/pool_manager.py `apply_pools`,
cluster/pool_autoscaler.py `_keep_size`). A redeploy's SLO reaches the
autoscaler the same way; one that changes what the workers were started from
is refused, by the app builder and by a replica (cluster/pool_settings.py)."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.scheduler_driver import build_scheduler, refreshing, run_with_pool
from cluster.config import AppSettings
from cluster.pool_settings import check_redeploy

SETTINGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "engine": {"block_size": 16, "num_kv_blocks": 64},
    "limits": {"max_prompt_tokens": 1023},  # the longest prompt and its first token fill the 64 blocks
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
    "autoscaling": {"interval_s": 0.25, "drain_grace_s": 0.5},
    "pool_name": "test-pool-sizes",
}


async def _prefills(pool, count: int, timeout_s: float = 120) -> list:
    """Once the prefill pool has `count` workers that are not draining."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        workers = [w for w in await pool.workers.remote() if w.role == "prefill"]
        if len([w for w in workers if w.state != "draining"]) == count and len(workers) == count:
            return workers
        await asyncio.sleep(0.25)
    raise TimeoutError(f"the prefill pool did not come to {count} workers: {workers}")


async def _scenario(pool, settings):
    await pool.list_members.remote()
    drained = await pool.drain.remote("p0", "by hand")
    after_drain = await _prefills(pool, 1)
    bigger = AppSettings.model_validate({**SETTINGS, "prefill": {"replicas": 2}})
    replica = build_scheduler(bigger, pool)
    async with refreshing(replica, interval_s=0.25):  # a redeployed replica
        after_redeploy = await _prefills(pool, 2)
        smaller = await pool.apply_pools.remote(SETTINGS)
        after_shrink = await _prefills(pool, 1)  # (the replica reports the one drained as left alone)
        await asyncio.sleep(1.0)  # (refreshes that see it gone)
        gauged = _gauged_workers(replica.metrics.render())
        members = set(replica.view.members)
    unchanged = await pool.apply_pools.remote(SETTINGS)
    stricter = await pool.apply_pools.remote({**SETTINGS, "slo": {"ttft_ms": 700}})
    running = await pool.running_settings.remote()
    events = [e for e in await pool.scaling_events.remote() if e.role == "prefill"]
    # A redeploy that changes an engine setting: the builder refuses it, and a
    # replica of it (built where the builder could not check) routes nothing.
    other_engine = AppSettings.model_validate({**SETTINGS, "engine": {"block_size": 32, "num_kv_blocks": 64}})
    with pytest.raises(ValueError) as refused:
        await asyncio.to_thread(check_redeploy, other_engine)
    await asyncio.to_thread(check_redeploy, AppSettings.model_validate({**SETTINGS, "slo": {"ttft_ms": 700}}))
    mismatched = build_scheduler(other_engine, pool)
    for _ in range(3):
        await mismatched.view.refresh()
    return dict(drained=drained, after_drain=after_drain, after_redeploy=after_redeploy, smaller=smaller,
                after_shrink=after_shrink, unchanged=unchanged, stricter=stricter, running=running, events=events,
                refused=str(refused.value), mismatched=mismatched.view.health(), gauged=gauged, members=members,
                mismatched_members=mismatched.view.members)


def _gauged_workers(metrics: str) -> set[str]:
    """The workers /metrics reports a KV block gauge for."""
    return {line.split('worker="')[1].split('"')[0] for line in metrics.splitlines()
            if line.startswith("tandem_kv_blocks_used{")}


def test_a_fixed_pool_keeps_its_size_through_a_drain_and_takes_a_redeploys(ray_local, tiny_qwen2_dir):
    r = run_with_pool(SETTINGS, _scenario)
    assert r["drained"] == "waiting"  # p0 is its role's only worker: it serves until its replacement has started
    [waits] = [e for e in r["events"] if e.kind == "drain_waits" and e.worker_id == "p0"]
    [drain] = [e for e in r["events"] if e.kind == "drain_started" and e.worker_id == "p0"]
    replacement = r["after_drain"][0].worker_id
    assert replacement != "p0"
    assert drain.reason == f"by hand; {replacement} starts in its place (the pool's minimum is 1)"
    assert waits.reason == drain.reason + "; it serves until another prefill worker has started"
    [started] = [e for e in r["events"] if e.kind == "started" and e.worker_id == replacement]
    assert started.time_s <= waits.time_s < drain.time_s  # (its replacement started with the drain, then answered)
    assert [e.reason for e in r["events"] if e.kind == "resized"] == ["redeployed: size 2", "redeployed: size 1"]
    assert [e.signal for e in r["events"] if e.kind == "up"] == ["below_size"]  # 1 -> 2
    downs = [e for e in r["events"] if e.kind == "down"]
    assert [e.signal for e in downs] == ["above_size"] and downs[0].worker_id not in {
        w.worker_id for w in r["after_shrink"]}
    assert r["smaller"] == ["prefill"] and r["unchanged"] == []
    assert r["gauged"] == r["members"] and downs[0].worker_id not in r["gauged"]  # (a gone worker's were kept)
    assert r["stricter"] == ["slo"] and r["running"]["slo"]["ttft_ms"] == 700
    assert "retuned" in [e.kind for e in r["events"]]
    assert r["refused"].startswith("the running worker pools 'test-pool-sizes' keep the settings they were started "
                                   "from; this manifest changes engine.block_size: 16 -> 32: to apply them")
    status, body = r["mismatched"]
    assert status == 503 and body["status"] == "failing" and body["error"] == r["refused"]
    assert body["settings_not_applied"] == ["engine.block_size: 16 -> 32"] and r["mismatched_members"] == {}
