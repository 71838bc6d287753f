"""A decode worker's line of handshakes (actors/reservation_queue.py) tries again
as soon as blocks come free, whatever frees them: a request done at its first
token (one token asked, or a stop) frees its blocks as it is activated, and the
line waited for its next timed try (`RETRY_S`) to take them. The worker runs in
this process, without Ray; the chunk is received as P's last would be."""

from __future__ import annotations

import asyncio
import time

import torch

from actors import reservation_queue
from actors.config import EngineConfig
from actors.decode_worker import DecodeWorker
from actors.kv_channel import ObjectStoreReceiver
from actors.messages import ChunkMeta, GenerateRequest
from actors.sampling_params import SamplingParams

CONFIG = EngineConfig(block_size=16, num_kv_blocks=12, prefill_chunk_size=48, decode_reserve_tokens=0)
ONE_TOKEN = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)


def test_a_request_done_at_its_first_token_lets_the_next_in_line_in_at_once(tiny_qwen2_dir, monkeypatch):
    monkeypatch.setattr(reservation_queue, "RETRY_S", 30.0)  # (the timed try, out of the way)

    async def scenario():
        worker = DecodeWorker("d0", tiny_qwen2_dir, CONFIG)
        await worker.profile()
        first = await worker.reserve(GenerateRequest("big", list(range(3, 150)), ONE_TOKEN), "feed", None,
                                     wait_s=0.0)  # 10 of the 12 blocks
        waiting = asyncio.ensure_future(
            worker.reserve(GenerateRequest("next", list(range(203, 260)), ONE_TOKEN), "feed", None, wait_s=20.0))
        while not len(worker.handshakes):
            await asyncio.sleep(0.01)
        worker._receivers["channel"] = ObjectStoreReceiver()
        cache = worker.engine.runner.kv_cache
        kv = torch.zeros((len(first.block_ids), *cache.shape[1:]), dtype=cache.dtype)
        freed = time.monotonic()
        await worker.receive_chunk(ChunkMeta("big", 0, first.block_ids, True, first_token_id=7), "channel", kv)
        granted = await waiting
        waited = time.monotonic() - freed
        await worker.abort("next")
        worker.loop.stop()
        return granted, waited

    granted, waited = asyncio.run(scenario())
    assert granted.request_id == "next" and waited < 10  # (it waited out the timed try's 30 s before)
