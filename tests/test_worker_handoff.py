"""A worker's hand-off of the blocks it loads from the KV store (`WorkerBase.import_then`):
the prefix is imported and pinned, then handed to the request the engine adds.
A caller cancelled between the two (its client left while the engine thread
was in a long step) pinned those blocks for good; now the hand-off runs to its
end and the blocks come back with the request. The worker runs in this process,
without Ray: its engine thread and an in-process store are what is under test."""

from __future__ import annotations

import asyncio
import random
import time

from actors.colocated_worker import ColocatedWorker
from actors.config import EngineConfig
from actors.engine import Engine
from actors.kv_store import KVStore, KVStoreSettings
from actors.messages import GenerateRequest
from actors.sampling_params import SamplingParams

PROMPT = [random.Random(3).randrange(3, 2000) for _ in range(150)]  # 9 full blocks and 6 tokens
PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(block_size=16, num_kv_blocks=64, prefill_chunk_size=48)


class SlowStepAfterImport(ColocatedWorker):
    """As if the engine thread began a long step right after the import: the
    request's `add` waits behind it."""

    async def import_prefix(self, request, **options):
        held = await super().import_prefix(request, **options)
        self.loop.call(lambda engine: time.sleep(0.5))
        self.imported = len(held)
        return held


def test_blocks_imported_for_a_request_whose_caller_is_cancelled_come_back(tiny_qwen2_dir):
    store = KVStore(b"test", KVStoreSettings(host_bytes=1 << 26))
    writer = Engine(tiny_qwen2_dir, CONFIG)  # computes the prompt once and writes its blocks to the store
    writer.store_bridge.sink = store.save
    writer.add_request(PROMPT, PARAMS, "writes")
    while writer.has_unfinished():
        writer.step()

    async def scenario():
        worker = SlowStepAfterImport("w0", tiny_qwen2_dir, CONFIG)
        worker.kv_store, worker.imported = store, None  # (the store in this process, whether or not Ray is up)
        submitted = asyncio.ensure_future(worker.submit(GenerateRequest("r1", PROMPT, PARAMS), "feed"))
        deadline = time.monotonic() + 20
        while worker.imported is None and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        held = worker.imported
        submitted.cancel()  # its client went away, `add` not run yet
        await asyncio.gather(submitted, return_exceptions=True)
        while (worker.engine.has_unfinished() or worker.engine.pool.num_used) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        engine = worker.engine
        worker.loop.stop()
        return held, engine.pool.num_used, engine.has_unfinished(), worker.num_store_loaded_blocks

    held, used, unfinished, loaded = asyncio.run(scenario())
    assert held == 9 and loaded == 9  # the prompt's full blocks, from the store
    assert used == 0 and not unfinished
