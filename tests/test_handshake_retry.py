"""A request whose decode worker has no room within the handshake's wait is retried
on another decode worker (the one that refused is left out; before, the retry left
out the prefill worker and asked the same full D again, or, with one P, found no
pair and answered 503)."""

from __future__ import annotations

from actors.messages import GenerateRequest
from actors.sampling_params import SamplingParams
from benchmarks.scheduler_driver import build_scheduler, complete, refreshing, run_with_pool, wait_ready

SETTINGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "engine": {"block_size": 16, "prefill_chunk_size": 64, "max_num_batched_tokens": 256, "num_kv_blocks": 24},
    "limits": {"max_prompt_tokens": 383},  # the longest prompt and its first token fill the 24 blocks
    "prefill": {"replicas": 1},
    "decode": {"replicas": 2},
    "slo": {"early_rejection": False},
    "timeouts": {"handshake_s": 1.0},
    "pool_name": "test-pool-handshake-retry",
}
SHORT = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


async def _scenario(pool, settings):
    scheduler = build_scheduler(settings, pool)
    async with refreshing(scheduler, interval_s=0.3):
        await wait_ready(scheduler, timeout_s=180, workers=3)
    # Refreshes stopped: the scheduler still sees both Ds empty when the one it
    # picks fills up.
    prompt = list(range(3, 60))
    full_id = scheduler.plan(prompt).decode_id
    full = scheduler.view.members[full_id].handle
    hold = GenerateRequest("hold", list(range(1, 384)), SamplingParams(max_new_tokens=1))  # all 24 blocks
    await full.reserve.remote(hold, "unread")
    try:
        tokens, error = await complete(scheduler, prompt, SHORT)
    finally:
        await full.abort.remote("hold")
    return full_id, tokens, error, dict(scheduler.view.num_routed)


def test_a_request_refused_by_a_full_decode_worker_is_served_by_another(ray_local, tiny_qwen2_dir):
    full_id, tokens, error, routed = run_with_pool(SETTINGS, _scenario)
    assert error is None and len(tokens) == 4
    assert routed[full_id] == 1 and sum(routed.values()) == 2, routed  # first the full D, then the other
