"""The global scheduler run in this process instead of a Serve replica: built
as `cluster.app.Scheduler` builds it, refreshed in the background as that
deployment does (members, stats, and the report to the pool manager), driven by
`generate` directly (no HTTP). For tests that need the scheduler's own state, and
benchmarks that read it (`tandem bench predictions`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import ray

from actors.block_pool import kv_namespace
from actors.config import ModelConfig
from actors.tokenization import load_tokenizer
from cluster.config import AppSettings
from cluster.pool_manager import get_or_create_pool
from cluster.service import GlobalScheduler

log = logging.getLogger("benchmarks.scheduler_driver")


def run_with_pool(settings: dict, scenario):
    """`await scenario(pool, settings)` against a new pool manager for `settings`,
    shut down (its workers killed) afterwards, unless the scenario did."""
    app_settings = AppSettings.model_validate(settings)
    pool = get_or_create_pool(app_settings)
    try:
        return asyncio.run(scenario(pool, app_settings))
    finally:
        with contextlib.suppress(ray.exceptions.RayActorError):
            ray.get(pool.shutdown.remote())
            ray.kill(pool)


def build_scheduler(settings: AppSettings, pool) -> GlobalScheduler:
    model_dir = settings.model.location().resolve()
    model_config = ModelConfig.from_hf(model_dir)
    model_len = model_config.max_position_embeddings
    max_model_len = min(settings.engine.max_model_len or model_len, model_len)
    kv_seed = kv_namespace(model_dir, settings.engine.dtype, settings.engine.block_size)
    return GlobalScheduler(settings, load_tokenizer(model_dir), pool, max_model_len, kv_seed,
                           model_config.eos_token_ids, model_config.vocab_size)


@contextlib.asynccontextmanager
async def refreshing(scheduler: GlobalScheduler, interval_s: float = 1.0):
    """Refresh the scheduler every `interval_s` while the block runs."""

    async def loop():
        while True:
            try:
                await scheduler.view.refresh()
            except Exception as exc:  # as the deployment does: keep refreshing
                log.warning("refresh failed: %s", exc)
            await asyncio.sleep(interval_s)

    task = asyncio.ensure_future(loop())
    try:
        yield scheduler
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_ready(scheduler: GlobalScheduler, timeout_s: float, workers: int = 0) -> None:
    """Until the scheduler is ready and routes to at least `workers` workers (it
    is ready with one of each role; the others may still be starting)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not scheduler.view.ready or len(scheduler.view.profiled & set(scheduler.view.members)) < workers:
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"scheduler not ready with {workers} workers within {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


async def complete(scheduler: GlobalScheduler, prompt_ids: list[int], params) -> tuple[list[int], str | None]:
    """One request to its end: (token ids, error or None)."""
    tokens, error = [], None
    async for event in scheduler.generate(prompt_ids, params):
        tokens += event.token_ids
        error = event.error or error
    return tokens, error
