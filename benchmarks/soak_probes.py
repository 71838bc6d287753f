"""Watching a soak from outside: which processes serve the app, their memory, the
workers' KV blocks, and whether they come back to idle.

- `find_processes(cluster, app)`: the app's worker actors (from the pool manager's
  `list_members`), its scheduler replica and the Serve proxy (Serve's named actors),
  and the pool manager. Each is asked once, through `__ray_call__`, for its pid,
  node and where it imports `cluster` from (proof of which code runs); nothing in
  `actors/` or `cluster/` is changed for this. All must live on this node: RSS is
  then read from `/proc/<pid>/statm` here, without queueing behind the actor's work.
- `take_sample(processes, t_s)`: every process's RSS, every worker's `stats()`, and
  the machine's load average.
- `wait_idle(workers, timeout_s)`: poll `stats()` until no worker holds a used
  block, a reservation, or a running or waiting request; then `check_accounting()`
  on each (the block pool's invariants).
- `memory_growth(...)`: RSS growth between two samples against a tolerance, pure.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MIB = 2**20


@dataclass(frozen=True)
class Process:
    name: str  # worker id, "scheduler", "proxy" or "pool-manager"
    role: str  # prefill | decode | colocated | scheduler | proxy | pool-manager
    pid: int
    handle: object
    cluster_file: str  # where the process imports `cluster` from

    @property
    def is_worker(self) -> bool:
        return self.role in ("prefill", "decode", "colocated")


@dataclass
class Sample:
    t_s: float  # from the start of the load
    rss_bytes: dict[str, int] = field(default_factory=dict)  # process name -> RSS
    workers: dict[str, dict] = field(default_factory=dict)  # worker id -> stats (used, running, ...)
    loadavg_1m: float | None = None  # the machine's, for the conditions of the run


def _identify(actor) -> tuple[int, str, str]:
    """Runs inside an actor (`__ray_call__`): pid, node id, `cluster` package path."""
    import os

    import ray

    import cluster

    return os.getpid(), ray.get_runtime_context().get_node_id(), cluster.__file__


def find_processes(cluster, app: str) -> list[Process]:
    import ray

    from benchmarks.serve_cluster import POOL_NAMESPACE

    found = [(m.worker_id, m.role, m.handle) for m in cluster.members(app)]
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, namespace = entry["name"], entry["namespace"]
        if namespace == "serve" and name.startswith(f"SERVE_REPLICA::{app}#"):
            found.append(("scheduler", "scheduler", ray.get_actor(name, namespace=namespace)))
        elif namespace == "serve" and name.startswith("SERVE_PROXY_ACTOR"):
            found.append(("proxy", "proxy", ray.get_actor(name, namespace=namespace)))
    found.append(("pool-manager", "pool-manager", ray.get_actor(cluster.apps[app], namespace=POOL_NAMESPACE)))
    here = ray.get_runtime_context().get_node_id()
    processes = []
    for name, role, handle in found:
        pid, node, cluster_file = ray.get(handle.__ray_call__.remote(_identify), timeout=60)
        if node != here:
            raise RuntimeError(f"{name} runs on node {node}, not this one: the soak reads /proc locally")
        processes.append(Process(name, role, pid, handle, cluster_file))
    return processes


def read_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES


async def take_sample(processes: list[Process], t_s: float) -> Sample:
    sample = Sample(t_s, loadavg_1m=os.getloadavg()[0])
    workers = [p for p in processes if p.is_worker]
    stats = await asyncio.gather(*(p.handle.stats.remote() for p in workers))
    for process, s in zip(workers, stats):
        sample.workers[process.name] = {"used_blocks": s.num_used_blocks, "cached_blocks": s.num_cached_blocks,
                                        "total_blocks": s.num_blocks, "running": s.num_running,
                                        "waiting": s.num_waiting, "reserved": s.num_reserved}
    for process in processes:
        sample.rss_bytes[process.name] = read_rss_bytes(process.pid)
    return sample


async def wait_idle(workers: list[Process], timeout_s: float) -> dict:
    """{"idle": bool, "after_s", "workers": {id: final stats}, "accounting": {id: "ok" | error}}."""
    started = time.monotonic()
    while True:
        stats = await asyncio.gather(*(p.handle.stats.remote() for p in workers))
        idle = all(s.num_used_blocks == 0 and s.num_reserved == 0 and s.num_running == 0 and s.num_waiting == 0
                   and s.num_waiting_handshakes == 0 for s in stats)
        if idle or time.monotonic() - started > timeout_s:
            break
        await asyncio.sleep(0.5)
    accounting = {}
    for process in workers:
        try:
            await process.handle.check_accounting.remote()
            accounting[process.name] = "ok"
        except Exception as exc:  # an AssertionError from the pool, wrapped by Ray
            accounting[process.name] = f"{type(exc).__name__}: {exc}"[:300]
    return {
        "idle": idle, "after_s": time.monotonic() - started,
        "workers": {p.name: {"used_blocks": s.num_used_blocks, "reserved": s.num_reserved, "running": s.num_running,
                             "waiting": s.num_waiting, "cached_blocks": s.num_cached_blocks}
                    for p, s in zip(workers, stats)},
        "accounting": accounting,
    }


def memory_growth(baseline_bytes: int, end_bytes: int, rel_tolerance: float, abs_tolerance_bytes: int) -> dict:
    """Growth from `baseline_bytes` to `end_bytes`; within tolerance when it is at
    most the larger of `rel_tolerance` x baseline and `abs_tolerance_bytes`."""
    growth = end_bytes - baseline_bytes
    allowed = max(rel_tolerance * baseline_bytes, abs_tolerance_bytes)
    return {"baseline_bytes": baseline_bytes, "end_bytes": end_bytes, "growth_bytes": growth,
            "growth_rel": growth / baseline_bytes if baseline_bytes else None, "allowed_bytes": int(allowed),
            "within": growth <= allowed}


def slope_bytes_per_min(points: list[tuple[float, int]]) -> float | None:
    """Least-squares slope of (t_s, bytes) points, in bytes per minute; None for
    fewer than two distinct times."""
    if len({t for t, _ in points}) < 2:
        return None
    mean_t = sum(t for t, _ in points) / len(points)
    mean_b = sum(b for _, b in points) / len(points)
    num = sum((t - mean_t) * (b - mean_b) for t, b in points)
    den = sum((t - mean_t) ** 2 for t, _ in points)
    return 60.0 * num / den
