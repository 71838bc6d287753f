"""The pool manager: a detached, named actor that owns the worker actors, so the
P and D pools outlive any scheduler replica (actors a Serve replica creates die
with it; see RAY_NOTES.md).

Scheduler replicas find it by name (`get_or_create_pool`), ask for the members and
their handles, and report dead workers. The manager also runs its own health loop
(a ping per worker every `health_interval_s`) and replaces what died, so a pool
heals even with no scheduler running. Placement
follows each pool's settings: `num_cpus`, `num_gpus` and a `label_selector` such as
`{"tandem/role": "prefill"}`.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import ray

from actors.worker_base import WorkerOptions
from cluster.config import AppSettings, PoolSettings
from cluster.workers import start_worker

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class Member:
    worker_id: str
    role: str
    handle: object


class PoolManager:
    health_interval_s = 2.0
    health_timeout_s = 30.0  # a worker busy loading or computing still answers pings

    def __init__(self, settings: dict) -> None:
        self.settings = AppSettings.model_validate(settings)
        self.members: dict[str, Member] = {}
        self.num_replaced = 0
        self._ids = itertools.count()
        self._health_task: asyncio.Task | None = None
        self.options = WorkerOptions(
            transfer_timeout_s=self.settings.timeouts.transfer_s,
            reservation_ttl_s=self.settings.timeouts.reservation_ttl_s,
            kv_store=self.settings.kv_store.store_settings() if self.settings.kv_store else None,
        )
        for role in self._roles():
            for _ in range(self._pool(role).replicas):
                self._start(role)

    def _roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.settings.mode == "disaggregated" else ("colocated",)

    def _pool(self, role: str) -> PoolSettings:
        return getattr(self.settings, role)

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
        return member

    def _ensure_health_loop(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            members = list(self.members.values())
            results = await asyncio.gather(
                *(asyncio.wait_for(m.handle.ping.remote(), self.health_timeout_s) for m in members),
                return_exceptions=True,
            )
            for member, result in zip(members, results):
                if isinstance(result, ray.exceptions.RayActorError):
                    await self.report_dead(member.worker_id)

    async def list_members(self) -> list[Member]:
        self._ensure_health_loop()
        return list(self.members.values())

    async def wait_ready(self, timeout_s: float) -> list[Member]:
        """Members once every one answers a ping (raises on timeout)."""
        self._ensure_health_loop()
        members = list(self.members.values())
        await asyncio.wait_for(asyncio.gather(*(m.handle.ping.remote() for m in members)), timeout_s)
        return members

    async def report_dead(self, worker_id: str) -> Member | None:
        """A caller saw this worker die: replace it (same role). Idempotent."""
        member = self.members.pop(worker_id, None)
        if member is None:
            return None
        try:
            ray.kill(member.handle)
        except Exception:  # already gone
            pass
        self.num_replaced += 1
        return self._start(member.role)

    async def shutdown(self) -> None:
        for member in self.members.values():
            ray.kill(member.handle)
        self.members.clear()


def get_or_create_pool(settings: AppSettings):
    """The pool manager named in the settings, created (detached) if absent."""
    actor = ray.remote(PoolManager).options(
        name=settings.pool_name,
        namespace="tandem",
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=64,
    )
    return actor.remote(settings.model_dump())
