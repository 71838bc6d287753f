"""The pool manager: a detached, named actor that owns the worker actors, so the
P and D pools outlive any scheduler replica (actors a Serve replica creates die
with it; see RAY_NOTES.md).

Scheduler replicas find it by name (`get_or_create_pool`), ask for the members and
their handles, report dead workers, and send a `SchedulerReport` on every refresh
(SLO outcomes, backlog, requests in flight). The manager also runs its own health
loop (a ping per worker every `health_interval_s`) and replaces what died, so a pool
heals even with no scheduler running (what died starting is started again after a
growing delay, cluster/restart_backoff.py); and its control loop
(cluster/pool_autoscaler.py), which scales each pool between its min and max and
retires draining workers. Placement follows each pool's settings: `num_cpus`,
`num_gpus` and a `label_selector` such as `{"tandem/role": "prefill"}`.

It also owns the deployment's stored responses (`response_store`:
cluster/response_store.py), so they too outlive scheduler replicas and go with the
pools.

Draining (`drain`): the member is flagged `draining`; schedulers stop routing new
requests to it on their next refresh; once it holds nothing it is killed. A
draining worker that dies is not replaced. Make before break: a drain that would
leave its role with no other worker that has started (the only decode worker of a
1P + 1D deployment, drained by hand) starts one in its place and waits for it,
the worker serving on meanwhile (a `drain_waits` event, then `drain_started`);
before, every new request was answered 503 for the replacement's start-up. Only
where the cluster has room for the replacement beside it (its CPUs and GPUs free,
counted cluster-wide): without room the replacement could not be placed until the
worker leaves, so it drains at once, as before. The wait ends after
`autoscaling.start_timeout_s` in any case (room on a node the pool's label
selector does not take).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, replace

import ray

from actors.background import background_task, every
from actors.deadlines import within
from actors.worker_base import WorkerOptions
from cluster.actor_errors import actor_died
from cluster.config import AppSettings, PoolSettings
from cluster.pool_autoscaler import PoolAutoscaler, ScalingEvent, log_to_stderr
from cluster.response_store import MIB, start_response_store
from cluster.restart_backoff import StartFailure, death_reason
from cluster.scaling_signals import PeerLoad, SchedulerReport
from cluster.workers import start_worker

ROLES = ("prefill", "decode", "colocated")
NAMESPACE = "tandem"  # the pool managers' alone (`tandem pools` lists them by it)


@dataclass(frozen=True)
class Member:
    worker_id: str
    role: str
    handle: object
    draining: bool = False  # takes no new requests; killed once it holds nothing


@dataclass(frozen=True)
class WorkerState:
    worker_id: str
    role: str
    state: str  # starting, ready, serving or draining


class PoolManager:
    health_interval_s = 2.0
    health_timeout_s = 30.0  # a worker busy loading or computing still answers pings
    initial_wait_s = 30.0

    def __init__(self, settings: dict) -> None:
        log_to_stderr()
        self.settings = AppSettings.model_validate(settings)
        self.members: dict[str, Member] = {}
        self.num_replaced = 0
        # The deployment's stored responses (cluster/response_store.py), started now, so no first request waits
        store_bytes = int(self.settings.response_store_mib * MIB)
        self._response_store = start_response_store(store_bytes) if store_bytes else None
        self._ids = itertools.count()
        self._health_task: asyncio.Task | None = None
        self._control_task: asyncio.Task | None = None
        self._initial_ready = False
        self.options = WorkerOptions(
            transfer_timeout_s=self.settings.timeouts.transfer_s,
            reservation_ttl_s=self.settings.timeouts.reservation_ttl_s,
            kv_store=self.settings.kv_store.store_settings() if self.settings.kv_store else None,
            stream_interval=self.settings.stream_interval,
        )
        # Each pool's size and placement: the manifest's, until a redeploy brings others (`apply_pools`)
        self.pools: dict[str, PoolSettings] = {role: getattr(self.settings, role) for role in self._roles()}
        self.scaler = PoolAutoscaler(self, self.settings, self._roles())
        for role in self._roles():
            for _ in range(self._pool(role).replicas):
                self._start(role)

    def _roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.settings.mode == "disaggregated" else ("colocated",)

    def _pool(self, role: str) -> PoolSettings:
        return self.pools[role]

    def _start(self, role: str) -> Member:
        pool = self._pool(role)
        worker_id = f"{role[0]}{next(self._ids)}"
        handle = start_worker(
            role,
            worker_id,
            self.settings.model.location(),
            self.settings.engine.engine_config(),
            self.options,
            num_cpus=pool.num_cpus,
            num_gpus=pool.num_gpus,
            label_selector=pool.label_selector or None,
        )
        member = Member(worker_id, role, handle)
        self.members[worker_id] = member
        self.scaler.on_started(member)
        return member

    def _ensure_health_loop(self) -> None:
        """Start the health and control loops (they need the actor's event loop),
        apart from the call that starts them (`actors.background`)."""
        if self._health_task is None or self._health_task.done():
            self._health_task = background_task(self._health_loop())
        if self._control_task is None or self._control_task.done():
            self._control_task = background_task(self.scaler.run())

    async def _health_loop(self) -> None:
        """`_health_round` every `health_interval_s`. A round that raises is logged
        and the next goes on (`every`): before, the loop ended unsaid, and no
        death was seen until some call to the manager started it again."""
        await every(self.health_interval_s, self._health_round, "pool health check")

    async def _health_round(self) -> None:
        """Ping the workers that answered once; one found dead is replaced. A
        worker still starting is watched by its first answer (the control
        loop's), not pinged: one waiting for a node held every round for
        `health_timeout_s`, and a death elsewhere went unseen."""
        members = [m for m in self.members.values() if self.scaler.is_ready(m.worker_id)]
        results = await asyncio.gather(
            *(within(m.handle.ping.remote(), self.health_timeout_s) for m in members),
            return_exceptions=True,
        )
        for member, result in zip(members, results):
            if actor_died(result):  # (one unreachable for now is pinged again next round)
                await self.report_dead(member.worker_id, death_reason(result))

    async def list_members(self) -> list[Member]:
        """Members that answered their first ping, draining ones included (flagged).
        A worker started later (scale-up, replacement) is left out while it starts,
        so no caller waits on an actor whose node is launching. The first call
        waits up to `initial_wait_s` for every initial worker, so a scheduler
        reports ready with the whole pool; a slower one joins when it is up."""
        self._ensure_health_loop()
        if not self._initial_ready:  # (each worker's first answer, which `is_ready` reads: not a later ping's)
            # Polled, not awaited under a timeout: a timeout cancels what it awaits,
            # and a cancelled first answer broke every later control step.
            deadline = time.monotonic() + self.initial_wait_s
            while not all(t.ready.done() for t in self.scaler.tracks.values()) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            self._initial_ready = True
        return [m for m in self.members.values() if self.scaler.is_ready(m.worker_id)]

    async def wait_ready(self, timeout_s: float) -> list[Member]:
        """Members once every one answers a ping (raises on timeout)."""
        self._ensure_health_loop()
        members = list(self.members.values())
        await within(asyncio.gather(*(m.handle.ping.remote() for m in members)), timeout_s)
        return members

    async def report_dead(self, worker_id: str, reason: str = "reported dead") -> Member | None:
        """A caller saw this worker die: replace it (same role), unless it was
        draining, or its role has its maximum without it (a redeploy shrank the
        pool: a replacement started, then drained), or it died before its start-up
        profile ran (a start failure: another starts after a delay, and None is
        returned). Idempotent."""
        member = self.members.get(worker_id)
        if member is None:
            return None
        leaving = self.scaler.is_leaving(member)
        if not leaving and not self.scaler.has_started(worker_id):
            self.scaler.start_failed(member, f"died starting: {reason}")
            return None
        del self.members[worker_id]
        try:
            ray.kill(member.handle)
        except Exception:  # already gone
            pass
        self.scaler.on_gone(member)
        if leaving:  # (its replacement, if it needed one, was started by the drain)
            self.scaler.record(member.role, "died_draining", worker_id)
            return None
        staying = self.scaler.num_staying(member.role)
        maximum = self.pools[member.role].max_size
        if staying >= maximum:
            self.scaler.record(member.role, "died", worker_id,
                               reason=f"dead; not replaced: {staying} workers stay, the pool's maximum is {maximum}")
            return None
        self.num_replaced += 1
        self.scaler.metrics.replaced(member.role)
        replacement = self._start(member.role)
        self.scaler.record(member.role, "replaced", worker_id, reason=f"dead; replaced by {replacement.worker_id}")
        return replacement

    async def report(self, report: SchedulerReport) -> PeerLoad:
        """A scheduler replica's figures since its last report (each refresh);
        answered with the load the other replicas put on each worker."""
        self._ensure_health_loop()
        self.scaler.on_report(report)
        return self.scaler.signals.peer_load(report.replica_id, self.scaler.clock())

    async def drain(self, worker_id: str, reason: str = "requested") -> str | None:
        """Stop routing new requests to this worker, let what it holds finish, then
        kill it (the control loop does, see cluster/pool_autoscaler.py): "draining".
        A drain that leaves the pool below its minimum (a fixed pool's `replicas`)
        starts a worker in its place at once; one that leaves its role no other
        worker that has started waits for one, the worker serving on meanwhile:
        "waiting". None if the worker is unknown, or draining or waiting already."""
        self._ensure_health_loop()
        member = self.members.get(worker_id)
        # A drain asked for besides the policy's own (which marks it after this): never taken back
        self.scaler.scaled_down.discard(worker_id)
        if member is None or self.scaler.is_leaving(member):
            return None
        others = [m for m in self.members.values()
                  if m.role == member.role and m.worker_id != worker_id and not self.scaler.is_leaving(m)]
        minimum = self._pool(member.role).min_size
        room = self._room_for(member.role)  # (before a replacement takes it)
        if len(others) + self.scaler.restarts.num_waiting(member.role) < minimum:  # (by hand: never below it)
            reason += f"; {self._start(member.role).worker_id} starts in its place (the pool's minimum is {minimum})"
        if not any(self.scaler.has_started(m.worker_id) for m in others):
            if room:
                self.scaler.drain_when_replaced(member, reason)
                return "waiting"
            reason += "; no room for another beside it, so it drains at once"
        self.begin_drain(member, reason)
        return "draining"

    def _room_for(self, role: str) -> bool:
        """Whether the cluster has the CPUs and GPUs free that a worker of `role` takes."""
        pool, free = self._pool(role), ray.available_resources()
        return free.get("CPU", 0.0) >= pool.num_cpus and free.get("GPU", 0.0) >= pool.num_gpus

    def begin_drain(self, member: Member, reason: str) -> None:
        """The member flagged draining (schedulers route it nothing new from their next refresh)."""
        self.members[member.worker_id] = replace(member, draining=True)
        self.scaler.on_drain(member, reason)

    def take_back(self, member: Member, reason: str) -> None:
        """A draining member serving again (schedulers route to it from their next
        refresh): a scale-up while a worker a scale-down drained still holds its
        model and, often, requests and cache."""
        self.members[member.worker_id] = replace(member, draining=False)
        self.scaler.on_taken_back(member, reason)

    async def apply_pools(self, settings: dict) -> list[str]:
        """A (re)deployed scheduler's settings: each pool's size (and the
        placement of the workers started from now on) becomes theirs, the control
        loop bringing a fixed pool to its new `replicas`, an autoscaling one within
        its new bounds; and so do the autoscaler's knobs and SLO targets. Returns
        what changed: the roles resized, then `autoscaling` or `slo`. The rest
        stays the pools' own until they are torn down (cluster/pool_settings.py)."""
        self._ensure_health_loop()
        new = AppSettings.model_validate(settings)
        changed = [role for role in self._roles() if getattr(new, role) != self.pools[role]]
        for role in changed:
            self.pools[role] = getattr(new, role)
            self.scaler.set_pool(role, self.pools[role])
        retuned = [name for name in ("autoscaling", "slo") if getattr(new, name) != getattr(self.settings, name)]
        if retuned:
            self.settings = self.settings.model_copy(update={"autoscaling": new.autoscaling, "slo": new.slo})
            self.scaler.retune(self.settings.model_copy(update=self.pools))
        return changed + retuned

    async def running_settings(self) -> dict:
        """The settings the pools run: those they were started from, with the
        pool sizes, autoscaling and SLO a redeploy brought since. A deploy is
        checked against their `POOL_OWNED` part (cluster/pool_settings.py)."""
        return self.settings.model_copy(update=self.pools).model_dump()

    async def workers(self) -> list[WorkerState]:
        """Every worker, starting ones too (`list_members` leaves them out), with
        its state (cluster/pool_autoscaler.py `state_of`): for `tandem pools`."""
        self._ensure_health_loop()
        return [WorkerState(m.worker_id, m.role, self.scaler.state_of(m)) for m in self.members.values()]

    async def start_failures(self) -> dict[str, StartFailure]:
        """Each role whose latest worker failed to start (none since has run its
        start-up profile): which, why, how many in a row, when the next starts."""
        self._ensure_health_loop()
        return self.scaler.start_failures()

    async def scaling_events(self, start: int = 0) -> list[ScalingEvent]:
        """Scaling events from index `start` on (the last 10,000 are kept)."""
        self._ensure_health_loop()
        return self.scaler.events_since(start)

    async def response_store(self):
        """The handle of the deployment's stored responses (None: it stores none)."""
        return self._response_store

    async def shutdown(self) -> None:
        for task in (self._health_task, self._control_task):
            if task is not None:
                task.cancel()
        for member in self.members.values():
            ray.kill(member.handle)
        self.members.clear()


def get_or_create_pool(settings: AppSettings):
    """The pool manager named in the settings, created (detached) if absent."""
    actor = ray.remote(PoolManager).options(
        name=settings.pool_name,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=64,
    )
    return actor.remote(settings.model_dump())
