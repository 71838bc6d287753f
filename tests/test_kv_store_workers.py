"""The KV store behind real P and D workers on a local Ray: a prefix computed by one
prefill worker is loaded, not recomputed, by a fresh one; the decode side loads what
it lacks, so P sends only the delta; the `store` channel moves a request's KV; after
the workers and the node's store restart, the disk tier still serves hits; a store
that crashes is started again and serves the workers that had it. Outputs stay
token-identical to HF throughout."""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from actors.config import EngineConfig
from actors.kv_store import KVStoreSettings
from actors.messages import GenerateRequest
from actors.sampling_params import SamplingParams
from actors.worker_base import WorkerOptions
from cluster.pd_request import DisaggregatedCall
from cluster.workers import start_worker
from tests.conftest import hf_greedy, wait_idle

CONFIG = EngineConfig(block_size=16, prefill_chunk_size=32, max_num_batched_tokens=128, num_kv_blocks=256)
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def run_pd(p, d, request, channel="gloo"):
    async def run():
        call = DisaggregatedCall(p, d, request, channel)
        return call, [e async for e in call.events()]

    call, events = asyncio.run(run())
    assert events[-1].finished and events[-1].error is None, events[-1]
    return call, tokens(events)


def start_pair(ray, model_dir, suffix, settings):
    options = WorkerOptions(kv_store=settings)
    p = start_worker("prefill", f"p-{suffix}", model_dir, CONFIG, options)
    d = start_worker("decode", f"d-{suffix}", model_dir, CONFIG, options)
    ray.get([p.ping.remote(), d.ping.remote()])
    return p, d


def assert_idle(ray, *actors):
    """Each worker's blocks all back, within a bound: P's sender unpins a request's
    last chunk on the engine thread after the call has its answer."""
    for actor in actors:
        wait_idle(actor)


@pytest.mark.parametrize("channel", ["gloo", "store"])
def test_fresh_workers_load_a_prefix_instead_of_recomputing(ray_local, tiny_qwen2_dir, tmp_path, channel):
    settings = KVStoreSettings(host_bytes=64 << 20, disk_path=str(tmp_path / "disk"),
                               shared_path=str(tmp_path / "shared"))
    rng = random.Random(channel)
    conversation = [rng.randrange(3, 2000) for _ in range(200)]  # 12 full blocks + 8 tokens
    p1, d1 = start_pair(ray_local, tiny_qwen2_dir, f"store-a-{channel}", settings)
    call, first = run_pd(p1, d1, GenerateRequest(f"turn-1-{channel}", conversation, GREEDY), channel)
    assert call.prefill_result.num_computed_tokens == 200
    assert ray_local.get(p1.kv_store_stats.remote()).tiers["host"]["entries"] >= 12  # written through

    # New workers: empty device pools, the same node store.
    p2, d2 = start_pair(ray_local, tiny_qwen2_dir, f"store-b-{channel}", settings)
    turn_2 = conversation + first + [rng.randrange(3, 2000) for _ in range(24)]  # 232 tokens
    call, second = run_pd(p2, d2, GenerateRequest(f"turn-2-{channel}", turn_2, GREEDY), channel)
    assert call.prefill_result.num_computed_tokens == 232 - 12 * 16  # only past the stored prefix
    assert call.reservation.num_cached_blocks == 12  # D loaded them too: delta transfer
    assert call.prefill_result.num_blocks_sent == 15 - 12
    assert ray_local.get(p2.stats.remote()).num_store_loaded_blocks == 12
    assert first == hf_greedy(tiny_qwen2_dir, conversation, GREEDY.max_new_tokens)
    assert second == hf_greedy(tiny_qwen2_dir, turn_2, GREEDY.max_new_tokens)
    assert_idle(ray_local, p1, d1, p2, d2)
    for actor in (p1, d1, p2, d2):
        ray_local.kill(actor)


def test_a_decode_worker_without_room_loads_nothing_from_the_store(ray_local, tiny_qwen2_dir, tmp_path):
    """A handshake D has no room for waits (or is refused) without loading its
    prefix: the loaded blocks would take the free blocks and other prefixes' place
    for nothing. With room, the same handshake loads the prefix and reuses it."""
    settings = KVStoreSettings(host_bytes=64 << 20)
    conversation = [random.Random(11).randrange(3, 2000) for _ in range(200)]  # 12 full blocks + 8 tokens
    p, d = start_pair(ray_local, tiny_qwen2_dir, "room-a", settings)
    run_pd(p, d, GenerateRequest("room-first", conversation, GREEDY))
    ray_local.get(p.kv_store_stats.remote())  # written through
    small = EngineConfig(block_size=16, prefill_chunk_size=32, max_num_batched_tokens=128, num_kv_blocks=24)
    fresh = start_worker("decode", "d-room-b", tiny_qwen2_dir, small, WorkerOptions(kv_store=settings))
    hold = GenerateRequest("hold", [5] * 208, SamplingParams(max_new_tokens=1))  # 14 of 24 blocks: 10 free
    ray_local.get(fresh.reserve.remote(hold, "unread"))
    with pytest.raises(Exception, match="had no room for 200 prompt tokens"):  # 13 blocks
        ray_local.get(fresh.reserve.remote(GenerateRequest("no-room", conversation, GREEDY), "unread"))
    assert ray_local.get(fresh.stats.remote()).num_store_loaded_blocks == 0
    assert ray_local.get(fresh.abort.remote("hold")) is not None
    info = ray_local.get(fresh.reserve.remote(GenerateRequest("room", conversation, GREEDY), "unread"))
    assert info.num_cached_blocks == 12 and ray_local.get(fresh.stats.remote()).num_store_loaded_blocks == 12
    ray_local.get(fresh.abort.remote("room"))
    assert_idle(ray_local, p, d, fresh)
    for actor in (p, d, fresh):
        ray_local.kill(actor)


def test_disk_tier_serves_hits_after_everything_restarts(ray_local, tiny_qwen2_dir, tmp_path):
    from actors.block_pool import kv_namespace
    from actors.kv_store_client import node_store_name

    settings = KVStoreSettings(host_bytes=0, disk_path=str(tmp_path / "disk"))
    prompt = [random.Random(5).randrange(3, 2000) for _ in range(100)]  # 6 full blocks
    p, d = start_pair(ray_local, tiny_qwen2_dir, "restart-a", settings)
    _, before = run_pd(p, d, GenerateRequest("before-restart", prompt, GREEDY))
    ray_local.get(p.kv_store_stats.remote())  # written through
    namespace = kv_namespace(tiny_qwen2_dir, CONFIG.dtype, CONFIG.block_size)
    node_id = ray_local.get_runtime_context().get_node_id()
    for actor in (p, d, ray_local.get_actor(node_store_name(node_id, namespace, settings), namespace="tandem-kv")):
        ray_local.kill(actor)

    p, d = start_pair(ray_local, tiny_qwen2_dir, "restart-b", settings)  # a new store indexes the disk
    call, after = run_pd(p, d, GenerateRequest("after-restart", prompt, GREEDY))
    assert call.prefill_result.num_computed_tokens == 100 - 6 * 16
    assert after == before
    assert_idle(ray_local, p, d)
    for actor in (p, d):
        ray_local.kill(actor)


def test_a_crashed_store_is_started_again_and_the_workers_use_it_again(ray_local, tiny_qwen2_dir):
    """The node's store process dies (Ray restarts it: `max_restarts`): the
    workers that held its handle go on serving, write through to the new one (its
    host tier started empty), and a fresh prefill worker loads from it."""
    from actors.block_pool import kv_namespace
    from actors.kv_store_client import node_store_name

    settings = KVStoreSettings(host_bytes=32 << 20)
    p, d = start_pair(ray_local, tiny_qwen2_dir, "crash-a", settings)
    run_pd(p, d, GenerateRequest("before-crash", [random.Random(8).randrange(3, 2000) for _ in range(100)], GREEDY))
    assert ray_local.get(p.kv_store_stats.remote()).tiers["host"]["entries"] > 0  # written through
    ray_local.get(d.kv_store_stats.remote())  # (D's pending writes done too: none may reach the new store)
    namespace = kv_namespace(tiny_qwen2_dir, CONFIG.dtype, CONFIG.block_size)
    store = ray_local.get_actor(node_store_name(ray_local.get_runtime_context().get_node_id(), namespace, settings),
                                namespace="tandem-kv")
    pid = lambda: ray_local.get(store.__ray_call__.remote(lambda _: os.getpid()), timeout=60)  # noqa: E731
    crashed = pid()
    ray_local.kill(store, no_restart=False)  # as a crash: Ray starts it again
    deadline = time.monotonic() + 60
    while True:  # the old process answers for a few ms after the kill; calls while it restarts fail
        try:
            if pid() != crashed:
                break
        except ray_local.exceptions.ActorUnavailableError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert ray_local.get(store.stats.remote()).tiers["host"]["entries"] == 0  # a new process, its host tier empty
    prompt = [random.Random(9).randrange(3, 2000) for _ in range(100)]  # 6 full blocks
    _, served = run_pd(p, d, GenerateRequest("after-crash", prompt, GREEDY))
    assert served == hf_greedy(tiny_qwen2_dir, prompt, GREEDY.max_new_tokens)
    assert ray_local.get(p.kv_store_stats.remote()).tiers["host"]["entries"] > 0  # written to the new store
    fresh_p, fresh_d = start_pair(ray_local, tiny_qwen2_dir, "crash-b", settings)
    call, again = run_pd(fresh_p, fresh_d, GenerateRequest("from-new-store", prompt, GREEDY))
    assert call.prefill_result.num_computed_tokens == 100 - 6 * 16 and again == served
    assert_idle(ray_local, p, d, fresh_p, fresh_d)
    for actor in (p, d, fresh_p, fresh_d, store):
        ray_local.kill(actor)
