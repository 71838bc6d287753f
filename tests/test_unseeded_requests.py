"""Requests that give no seed sample apart, whichever workers serve them. A worker's
engine draws the seeds of such requests from one sequence (`EngineConfig.seed`),
the same in every worker of a pool: two workers that have drawn as many seeds (two
fresh ones: here the second and third, since only the first of a role runs the
start-up profile) would give their next unseeded requests the same seed, and the
same prompt the same "random" completion (n choices spread over workers too). The
global scheduler draws those seeds itself."""

from __future__ import annotations

from actors.sampling_params import SamplingParams
from benchmarks.scheduler_driver import build_scheduler, complete, refreshing, run_with_pool, wait_ready

SETTINGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "mode": "colocated",
    "colocated": {"replicas": 3},
    "engine": {"block_size": 16, "prefill_chunk_size": 128, "max_num_batched_tokens": 256, "num_kv_blocks": 128},
    "slo": {"early_rejection": False},
    "routing": "round_robin",  # the same prompt to every worker (cache-aware routing sends it where it went)
    "pool_name": "test-pool-unseeded",
}
SAMPLED = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True)


async def _scenario(pool, settings):
    scheduler = build_scheduler(settings, pool)
    async with refreshing(scheduler, interval_s=0.3):
        await wait_ready(scheduler, timeout_s=180, workers=3)
        prompt = list(range(3, 40))
        results = [await complete(scheduler, prompt, SAMPLED) for _ in range(3)]
    return results, dict(scheduler.view.num_routed)


def test_unseeded_requests_on_different_workers_sample_apart(ray_local, tiny_qwen2_dir):
    results, routed = run_with_pool(SETTINGS, _scenario)
    assert sorted(routed.values()) == [1, 1, 1], routed  # one request each worker
    assert [error for _, error in results] == [None] * 3
    completions = {tuple(tokens) for tokens, _ in results}
    assert len(completions) == 3 and all(len(tokens) == 16 for tokens in completions)
