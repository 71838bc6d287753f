"""Run as a script by tests/test_autoscale_cluster.py: an autoscaling Ray cluster on
this machine (autoscaler v2, fake multi-node provider; benchmarks/fake_cluster.py)
whose prefill and decode node types start at zero nodes. The pool manager asks for
1 P and 1 D (min 1, max 2 each), which launches a node of each; then:

1. prefill-heavy load (long prompts, one output token): the P pool must grow, a
   prefill node must be launched, and the D pool must stay as it is;
2. decode-heavy load (short prompts, long outputs): the D pool must grow, and the
   P pool must not;
3. no load: both pools shrink back to 1 and their extra nodes are terminated.

Load is closed-loop (each client sends its next request when the previous one
ends) through a GlobalScheduler in this process (benchmarks/scheduler_driver.py). The
SLOs are loose, so the backlog and KV signals decide (TTFT and TBT attainment are
covered by the policy's unit tests and by `tandem bench autoscale`). Prints one
JSON line; the test asserts on it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
import urllib.request

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray  # noqa: E402

from actors.sampling_params import SamplingParams  # noqa: E402
from benchmarks.fake_cluster import FakeAutoscalingCluster, fake_node_type  # noqa: E402
from cluster.config import AppSettings  # noqa: E402
from cluster.pool_manager import get_or_create_pool  # noqa: E402
from benchmarks.scheduler_driver import build_scheduler, complete, refreshing, wait_ready  # noqa: E402

NODE_TYPES = {
    "prefill": fake_node_type({"CPU": 1}, {"tandem/role": "prefill"}, min_workers=0, max_workers=2),
    "decode": fake_node_type({"CPU": 1}, {"tandem/role": "decode"}, min_workers=0, max_workers=2),
}
POOL = {"replicas": 1, "min_replicas": 1, "max_replicas": 2, "num_cpus": 1}
SETTINGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "engine": {"block_size": 16, "prefill_chunk_size": 256, "max_num_batched_tokens": 512, "num_kv_blocks": 1024},
    "prefill": {**POOL, "label_selector": {"tandem/role": "prefill"}},
    "decode": {**POOL, "label_selector": {"tandem/role": "decode"}},
    "slo": {"ttft_ms": 60000, "tbt_ms": 5000, "attainment": 0.9, "early_rejection": False},
    "limits": {"request_timeout_s": 90},
    # (short windows and cooldowns: the test's time is mostly theirs and the workers' starts)
    "autoscaling": {"interval_s": 1.0, "window_s": 6, "scale_up_cooldown_s": 5, "scale_down_cooldown_s": 6,
                    "prefill_backlog_up_tokens": 3000, "prefill_backlog_down_tokens": 300,
                    "kv_usage_up": 0.12, "kv_usage_down": 0.03, "drain_grace_s": 2.0},
    "pool_name": "autoscale-check-pool",
}
PREFILL_HEAVY = dict(clients=6, prompt_tokens=1000, max_new_tokens=1)
DECODE_HEAVY = dict(clients=8, prompt_tokens=32, max_new_tokens=600)
# A functional bound, generous for a loaded 2-core machine (the latency goal is `tandem bench autoscale`'s).
PHASE_TIMEOUT_S = 180


class ClosedLoop:
    """`clients` concurrent request loops until stopped; every result is kept."""

    def __init__(self, scheduler, clients: int, prompt_tokens: int, max_new_tokens: int, seed: int) -> None:
        self.scheduler = scheduler
        self.rng = random.Random(seed)
        self.prompt_tokens = prompt_tokens
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
        self.results: list[tuple[int, str | None]] = []  # (tokens, error)
        self.stopping = False
        self.tasks = [asyncio.ensure_future(self._client()) for _ in range(clients)]

    async def _client(self) -> None:
        while not self.stopping:
            prompt = [self.rng.randrange(3, 2048) for _ in range(self.prompt_tokens)]
            try:
                tokens, error = await complete(self.scheduler, prompt, self.params)
            except Exception as exc:  # an ApiError or anything else is a failed request
                tokens, error = [], f"{type(exc).__name__}: {exc}"
            self.results.append((len(tokens), error))

    async def stop(self, timeout_s: float = 100.0) -> dict:
        self.stopping = True
        done, stuck = await asyncio.wait(self.tasks, timeout=timeout_s)
        for task in stuck:
            task.cancel()
        if stuck:
            inflight = [(r.request_id, r.prefill_id, r.decode_id, r.num_generated)
                        for r in self.scheduler.view.models.inflight.values()]
            self.results.append((0, f"{len(stuck)} requests still running after {timeout_s:.0f} s: {inflight}"))
        failed = [e for n, e in self.results if e is not None or n != self.params.max_new_tokens]
        return {"num_requests": len(self.results), "failed": failed[:5], "num_failed": len(failed)}


def role_nodes() -> dict[str, int]:
    counts = {"prefill": 0, "decode": 0}
    for node in ray.nodes():
        role = (node.get("Labels") or {}).get("tandem/role")
        if node["Alive"] and role in counts:
            counts[role] += 1
    return counts


def say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


async def wait_until(condition, timeout_s: float, what: str, trace: list) -> float:
    started = time.monotonic()
    while not await condition():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what} not within {timeout_s:.0f} s")
        trace.append((round(time.monotonic(), 1), role_nodes()))
        await asyncio.sleep(1.0)
    return time.monotonic() - started


def scheduler_view(scheduler) -> dict:
    """What the scheduler believed when a phase timed out (for the failure message)."""
    view = scheduler.view
    members = {w: (m.role, m.draining, w in view.profiled) for w, m in view.members.items()}
    prefills = [w for w, m in view.members.items() if m.role == "prefill" and w in view.profiled]
    decodes = [w for w, m in view.members.items() if m.role == "decode" and w in view.profiled]
    predictions = {f"{p}->{d}": view.models.predict(p, d, 32, 0) for p in prefills for d in decodes}
    inflight = [(r.prefill_id, r.decode_id, r.num_generated, r.in_prefill) for r in view.models.inflight.values()]
    return {"members": members, "ready": view.ready, "predictions": predictions, "inflight": inflight,
            "stats": {w: s for w, s in view.stats.items()}}


def pool_metric_names() -> list[str]:
    """The ray_tandem_* series on the head node's metrics port (the pool manager's,
    and this process's scheduler's)."""
    names = set()
    for node in ray.nodes():
        if node["Alive"] and not (node.get("Labels") or {}).get("tandem/role"):
            text = urllib.request.urlopen(f"http://127.0.0.1:{node['MetricsExportPort']}/metrics", timeout=10).read()
            names |= {line.split("{")[0].split(" ")[0] for line in text.decode().splitlines()
                      if line.startswith("ray_tandem_")}
    return sorted(names)


async def scenario(pool, settings, result: dict) -> dict:
    result.update(phases={}, node_trace=[])
    trace = result["node_trace"]
    scheduler = build_scheduler(settings, pool)

    async def events():
        return await pool.scaling_events.remote()

    async def serving(role: str) -> bool:
        """A second worker of `role` took a request."""
        started = [e.worker_id for e in await events() if e.role == role and e.kind == "started"]
        return any(e.kind == "serving" and e.worker_id in started[1:] for e in await events())

    async def at_min() -> bool:
        members = await pool.list_members.remote()
        sizes = {role: sum(m.role == role for m in members) for role in ("prefill", "decode")}
        return sizes == {"prefill": 1, "decode": 1} and role_nodes() == {"prefill": 1, "decode": 1}

    async with refreshing(scheduler, interval_s=1.0):
        await wait_ready(scheduler, timeout_s=240)
        say("ready")
        result["nodes_at_start"] = role_nodes()
        for name, load, role in (("prefill_heavy", PREFILL_HEAVY, "prefill"), ("decode_heavy", DECODE_HEAVY, "decode")):
            mark = len(await events())
            say(f"{name} load starts")
            loop = ClosedLoop(scheduler, seed=len(name), **load)
            try:
                waited = await wait_until(lambda role=role: serving(role), PHASE_TIMEOUT_S, f"a new {role} serving",
                                          trace)
            except TimeoutError:
                result["scheduler_view"] = scheduler_view(scheduler)
                raise
            nodes = role_nodes()
            say(f"{name}: a new {role} worker serves after {waited:.0f} s; stopping the load")
            outcome = await loop.stop()
            phase_events = (await events())[mark:]
            result["phases"][name] = {**outcome, "seconds": waited, "nodes": nodes,
                                      "ups": sorted({e.role for e in phase_events if e.kind == "up"}),
                                      "events": [(e.role, e.kind, e.worker_id, e.signal, e.reason) for e in phase_events]}
        mark = len(await events())
        say("no load: waiting for both pools at min")
        result["phases"]["idle"] = {"seconds": await wait_until(at_min, PHASE_TIMEOUT_S, "both pools at min", trace)}
        all_events = await events()
        result["phases"]["idle"]["events"] = [(e.role, e.kind, e.worker_id, e.reason) for e in all_events[mark:]]
        result["drained"] = [(e.role, e.stats.num_used_blocks if e.stats else None, e.reason)
                             for e in all_events if e.kind in ("drained", "drain_timeout")]
        result["metric_names"] = pool_metric_names()
    result["node_trace"] = trace[-20:]
    return result


def main() -> dict:
    started = time.time()
    with FakeAutoscalingCluster(NODE_TYPES, head_cpus=0, idle_timeout_s=3.0) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        settings = AppSettings.model_validate(SETTINGS)
        pool = get_or_create_pool(settings)
        result: dict = {}
        try:
            result = asyncio.run(scenario(pool, settings, result))
        except Exception as exc:  # report what happened, with every event, for the test's message
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["all_events"] = [(round(e.time_s - started, 1), e.role, e.kind, e.worker_id, e.signal, e.reason)
                                    for e in ray.get(pool.scaling_events.remote())]
        finally:
            try:
                ray.get(pool.shutdown.remote(), timeout=30)
                ray.kill(pool)
            except Exception:  # the cluster goes anyway
                pass
    result["total_s"] = time.time() - started
    return result


if __name__ == "__main__":
    print(json.dumps(main(), default=str))
