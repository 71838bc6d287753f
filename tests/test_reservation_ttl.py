"""A decode worker's reservation expires when no KV comes for it within
`reservation_ttl_s`, counted from the handshake or from its latest chunk: a
long prompt's transfer that keeps coming, however long it takes, is not
dropped midway (it was, at the TTL counted from the handshake). The worker
runs in this process, without Ray; chunks are written as `receive_chunk`
writes them."""

from __future__ import annotations

import asyncio

import torch

from actors.config import EngineConfig
from actors.decode_worker import DecodeWorker
from actors.messages import ChunkMeta, GenerateRequest
from actors.sampling_params import SamplingParams
from actors.worker_base import WorkerOptions

CONFIG = EngineConfig(block_size=16, num_kv_blocks=64, prefill_chunk_size=48)
OPTIONS = WorkerOptions(reservation_ttl_s=1.0, watchdog_interval_s=0.05)


def test_a_transfer_that_keeps_coming_outlives_the_ttl_and_one_that_stops_does_not(tiny_qwen2_dir):
    async def scenario():
        worker = DecodeWorker("d0", tiny_qwen2_dir, CONFIG, OPTIONS)
        request = GenerateRequest("r1", list(range(3, 100)), SamplingParams(max_new_tokens=4))  # 7 blocks
        reservation = await worker.reserve(request, "feed", None)
        block = tuple(worker.engine.runner.kv_cache.shape[1:])
        alive = []
        for index, block_id in enumerate(reservation.block_ids[:4]):  # a chunk every 0.6 s: 2.4 s in all
            await asyncio.sleep(0.6)
            alive.append("r1" in worker._pending)
            meta = ChunkMeta("r1", index, [block_id], is_last=False)
            await worker.in_thread(worker._write_chunk, meta, torch.zeros((1,) + block))
        await asyncio.sleep(1.5)  # then none
        dropped = "r1" not in worker._pending
        used = worker.engine.pool.num_used
        worker.loop.stop()
        return alive, dropped, used

    alive, dropped, used = asyncio.run(scenario())
    assert alive == [True] * 4
    assert dropped and used == 0


def test_a_chunk_that_lands_while_the_watchdog_drops_others_keeps_its_reservation(tiny_qwen2_dir):
    """Expired together, then dropped one after another, each with an await: a
    chunk for the second that came while the first was dropped (here, written
    from within that drop) did not save it, though its TTL counted again."""
    async def scenario():
        worker = DecodeWorker("d0", tiny_qwen2_dir, CONFIG, WorkerOptions(reservation_ttl_s=0.3,
                                                                          watchdog_interval_s=60.0))
        for rid, first in (("a", 3), ("b", 200)):  # (prompts apart: b borrowing a's blocks would end with a)
            await worker.reserve(GenerateRequest(rid, list(range(first, first + 97)), SamplingParams(max_new_tokens=4)),
                                 "feed", None)
        block = tuple(worker.engine.runner.kv_cache.shape[1:])
        first_block = worker._pending["b"].block_ids[0]
        drop = worker._drop

        async def drop_then_a_chunk_for_b(request_id: str, reason: str) -> None:
            await drop(request_id, reason)
            if request_id == "a":
                meta = ChunkMeta("b", 0, [first_block], is_last=False)
                await worker.in_thread(worker._write_chunk, meta, torch.zeros((1,) + block))

        worker._drop = drop_then_a_chunk_for_b
        await asyncio.sleep(0.4)  # both past their TTL
        await worker._watchdog()
        kept = set(worker._pending)
        worker.loop.stop()
        return kept

    assert asyncio.run(scenario()) == {"b"}
