"""A worker's watchdogs (`actors.background.every`) outlive a round that fails:
a decode worker's, which expires reservations and notices dead prefill workers,
died at its first error, and no reservation expired for the worker's life. The
worker runs in this process, without Ray."""

from __future__ import annotations

import asyncio
import logging

from actors.config import EngineConfig
from actors.decode_worker import DecodeWorker
from actors.messages import GenerateRequest
from actors.sampling_params import SamplingParams
from actors.worker_base import WorkerOptions

CONFIG = EngineConfig(block_size=16, num_kv_blocks=64, prefill_chunk_size=48)
OPTIONS = WorkerOptions(reservation_ttl_s=0.5, watchdog_interval_s=0.05)


def test_a_watchdog_round_that_fails_is_logged_and_the_next_goes_on(tiny_qwen2_dir, caplog):
    async def scenario():
        worker = DecodeWorker("d0", tiny_qwen2_dir, CONFIG, OPTIONS)
        heard = worker._hear_from_prefill
        failures = []

        async def fails_twice(pending, now):
            if len(failures) < 2:
                failures.append(now)
                raise RuntimeError("a round's error (as a test)")
            return await heard(pending, now)

        worker._hear_from_prefill = fails_twice
        await worker.reserve(GenerateRequest("r1", list(range(3, 100)), SamplingParams(max_new_tokens=4)), "feed")
        for _ in range(100):  # no KV comes: it expires at its TTL
            await asyncio.sleep(0.05)
            if "r1" not in worker._pending:
                break
        expired = "r1" not in worker._pending
        used = worker.engine.pool.num_used
        worker.loop.stop()
        return expired, used, len(failures)

    with caplog.at_level(logging.ERROR, logger="actors.background"):
        expired, used, failures = asyncio.run(scenario())
    assert failures == 2 and expired and used == 0
    assert sum("d0's watchdog: a round failed" in r.getMessage() for r in caplog.records) == 2
