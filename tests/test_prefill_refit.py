"""A prefill worker's cost model is fitted on its engine's steps: the start-up
profile's, then live ones read with its stats (actors/prefill_steps.py,
`WorkerModels.observe_prefill_steps`); a prompt's prediction is the sum of its
chunks' steps. Fitted on three whole prompts of 16 to 256 tokens, the profile's
noise set the attention term, and an 1800-token prompt on the tiny model was
predicted at 1.2 s while it took 0.1 s (docs/benchmarks.md, tandem bench
predictions)."""

from __future__ import annotations

import pytest

from actors.config import EngineConfig
from actors.engine import Engine
from actors.messages import PrefillStep
from actors.profiler import profile_engine
from actors.sampling_params import SamplingParams
from cluster.admission import WorkerModels
from cluster.cost_model import prefill_features

FIXED_S, PER_TOKEN_S, PER_KTOKEN_PAIR_S = 0.004, 2e-5, 3e-5  # a made-up worker's law


def _step_s(chunks) -> float:
    return FIXED_S + sum(PER_TOKEN_S * f[0] + PER_KTOKEN_PAIR_S * f[1]
                         for f in (prefill_features(new, before) for new, before in chunks))


def _steps(first_seq: int, chunk_lists, scale: float = 1.0) -> list[PrefillStep]:
    return [PrefillStep(first_seq + i, chunks, scale * _step_s(chunks)) for i, chunks in enumerate(chunk_lists)]


def _live_chunks(num_steps: int):
    """Steps as a busy P runs them: one to four chunks of prompts at various depths."""
    return [tuple((64 + 32 * ((i + j) % 7), 128 * ((i * 3 + j) % 9)) for j in range(1 + i % 4))
            for i in range(num_steps)]


def test_a_prompt_is_predicted_as_its_chunks_steps():
    models = WorkerModels(block_size=16, prefill_chunk_size=256)
    models.observe_prefill_steps("p0", _steps(1, _live_chunks(32)))
    expected = sum(_step_s([(n, before)]) for n, before in [(256, 0), (256, 256), (256, 512), (32, 768)])
    assert models.prefill_s("p0", 800, 0) == pytest.approx(expected, rel=1e-6)
    expected_cached = sum(_step_s([(n, before)]) for n, before in [(256, 320), (44, 576)])
    assert models.prefill_s("p0", 300, 320) == pytest.approx(expected_cached, rel=1e-6)


def test_a_step_smaller_than_a_chunk_makes_the_chunks_smaller():
    """The engine keeps a chunk within the step's token budget as well."""
    small_steps = WorkerModels(block_size=16, prefill_chunk_size=512, max_num_batched_tokens=256)
    chunked = WorkerModels(block_size=16, prefill_chunk_size=256, max_num_batched_tokens=256)
    for models in (small_steps, chunked):
        models.observe_prefill_steps("p0", _steps(1, _live_chunks(32)))
    assert small_steps.prefill_s("p0", 800, 0) == pytest.approx(chunked.prefill_s("p0", 800, 0))


def test_live_steps_displace_a_profile_that_came_out_slow():
    """A profile run beside the other role's (two cores) came out twice as slow:
    the live steps that follow it refit the model to what the worker does."""
    models = WorkerModels(block_size=16, prefill_chunk_size=256)
    profile = _steps(1, [((16, 0),), ((64, 0),), ((256, 0),), ((256, 0),), ((256, 256),)], scale=2.0)
    models.observe_prefill_steps("p0", profile)
    models.skip_prefill_steps("p0", through=40)  # the profile's decode steps came after its prefills
    truth = sum(_step_s([(n, before)]) for n, before in [(256, 0), (256, 256), (256, 512), (32, 768)])
    assert models.prefill_s("p0", 800, 0) > 1.5 * truth
    models.observe_prefill_steps("p0", _steps(41, _live_chunks(300)))
    assert models.prefill_s("p0", 800, 0) == pytest.approx(truth, rel=1e-3)
    assert models.last_prefill_step("p0") == 340


def test_steps_read_again_with_the_next_stats_are_fitted_once():
    models = WorkerModels(block_size=16, prefill_chunk_size=256)
    models.observe_prefill_steps("p0", _steps(1, [((16, 0),), ((256, 0),), ((256, 256),)], scale=2.0))
    live = _steps(10, _live_chunks(20))
    models.observe_prefill_steps("p0", live)
    once = models.prefill_s("p0", 800, 0)
    models.observe_prefill_steps("p0", live[5:])  # the ring read again, no new step in it
    models.observe_prefill_steps("p0", _steps(1, [((16, 0),), ((256, 0),)], scale=2.0))  # a profile's, again
    assert models.prefill_s("p0", 800, 0) == once
    models.forget("p0")
    assert models.last_prefill_step("p0") == 0 and not models.prefill_model("p0").is_fitted


def test_a_multi_chunk_prompt_behind_a_short_queue_pays_each_steps_fixed_part():
    """A prompt shares the queue's steps only if the queue takes as many steps as
    the prompt has chunks; a 2048-token prompt behind one short prompt does not."""
    models = WorkerModels(block_size=16, prefill_chunk_size=256, max_num_batched_tokens=1024)
    models.observe_prefill_steps("p0", _steps(1, _live_chunks(32)))
    from cluster.admission import InFlight

    models.inflight["queued"] = InFlight("queued", "p0", "d0", 32, 1, predicted_ttft_s=5.0)
    assert models.own_prefill_s("p0", 2048, 0) == pytest.approx(models.prefill_s("p0", 2048, 0))
    short = models.own_prefill_s("p0", 48, 0)
    assert short == pytest.approx(models.prefill_s("p0", 48, 0) - models.prefill_model("p0").fixed_s())


def _engine(model_dir, **config) -> Engine:
    return Engine(model_dir, EngineConfig(block_size=16, num_kv_blocks=256, max_num_seqs=8, **config))


def test_the_engine_logs_prompt_only_steps_with_their_chunks(tiny_qwen2_dir):
    engine = _engine(tiny_qwen2_dir, prefill_chunk_size=16, max_num_batched_tokens=64)
    engine.add_request(list(range(3, 43)), SamplingParams(max_new_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    steps = engine.prefill_steps.latest()
    assert [s.chunks for s in steps] == [((16, 0),), ((16, 16),), ((8, 32),)]  # the decode steps are not kept
    assert [s.seq for s in steps] == [1, 2, 3] and engine.num_steps == 6
    assert all(s.seconds > 0 for s in steps)
    assert engine.prefill_steps.latest(after=2) == steps[2:]


def test_a_step_that_also_decodes_is_not_logged(tiny_qwen2_dir):
    """A colocated worker's mixed step costs what no prefill model describes."""
    engine = _engine(tiny_qwen2_dir, prefill_chunk_size=64, max_num_batched_tokens=128)
    engine.add_request(list(range(3, 20)), SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()  # its prompt: logged
    engine.add_request(list(range(30, 60)), SamplingParams(max_new_tokens=2, ignore_eos=True))
    engine.step()  # the first decodes while the second's prompt is computed
    assert [s.chunks for s in engine.prefill_steps.latest()] == [((17, 0),)]


def test_the_profile_times_a_long_prompt_chunk_by_chunk_after_a_warm_up(tiny_qwen2_dir):
    engine = _engine(tiny_qwen2_dir, prefill_chunk_size=256, max_num_batched_tokens=512, max_model_len=2048)
    profile = profile_engine(engine, prompt_lens=(16, 1024), batch_sizes=(1,))
    assert [s.chunks for s in profile.prefill_steps] == [((16, 0),), ((256, 0),), ((256, 256),), ((256, 512),),
                                                         ((256, 768),)]
    assert profile.prefill_steps[0].seq == 5  # steps 1-4, the warm-up request's prefill and decodes, are left out
    assert profile.num_steps == engine.num_steps
    assert [(batch, kv_tokens) for batch, kv_tokens, _ in profile.decode] == [(1, 17)]


SETTINGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "mode": "disaggregated",
    "engine": {"block_size": 16, "prefill_chunk_size": 128, "max_num_batched_tokens": 256, "num_kv_blocks": 256},
    "slo": {"early_rejection": False},
    "pool_name": "test-pool-prefill-refit",
}


async def _a_long_prompt(pool, settings):
    import asyncio
    import time

    from benchmarks.scheduler_driver import build_scheduler, complete, refreshing, wait_ready

    scheduler = build_scheduler(settings, pool)
    async with refreshing(scheduler, interval_s=0.3):
        await wait_ready(scheduler, timeout_s=180)
        view, models = scheduler.view, scheduler.view.models
        (prefill_id,) = [w for w, m in view.members.items() if m.role == "prefill"]
        profiled_through = models.last_prefill_step(prefill_id)
        _, error = await complete(scheduler, list(range(3, 603)), SamplingParams(max_new_tokens=2, ignore_eos=True))
        stats = await view.members[prefill_id].handle.stats.remote()
        live = [s for s in stats.prefill_steps if s.seq > profiled_through]
        deadline = time.monotonic() + 10
        while live and models.last_prefill_step(prefill_id) < live[-1].seq and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return error, profiled_through, live, models.last_prefill_step(prefill_id)


def test_the_scheduler_fits_a_prefill_workers_live_steps(ray_local, tiny_qwen2_dir):
    from benchmarks.scheduler_driver import run_with_pool

    error, profiled_through, live, fitted_through = run_with_pool(SETTINGS, _a_long_prompt)
    assert error is None and profiled_through > 0  # the profile's steps fitted, and not again as live ones
    assert [s.chunks for s in live] == [((128, 0),), ((128, 128),), ((128, 256),), ((128, 384),), ((88, 512),)]
    assert fitted_through == live[-1].seq
