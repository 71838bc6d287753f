"""The static-shape prefill step that CUDA graphs would replay (`prefill_graphs`),
checked on CPU without capture: which steps take it, and that its padding rows
change no real row and write only the scratch block. (Capture needs CUDA: the GPU
check's `roofline` step times prefill with and without it.)"""

import random

import pytest
import torch

from actors.config import EngineConfig
from actors.llm import LLM
from actors.prefill_graphs import token_buckets
from actors.request import Request
from actors.sampling_params import SamplingParams
from actors.scheduler import ScheduledChunk


def test_token_buckets():
    assert token_buckets(16) == [16]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(1100) == [16, 32, 64, 128, 256, 512, 768, 1024, 1100]


def test_the_largest_bucket_is_the_largest_chunk_a_step_holds(tiny_qwen2_dir):
    runner = LLM(tiny_qwen2_dir, prefill_chunk_size=300, max_num_batched_tokens=200).engine.runner
    assert runner.static_prefill(capture=False).max_tokens == 200
    runner = LLM(tiny_qwen2_dir, prefill_chunk_size=100, max_num_batched_tokens=200).engine.runner
    assert runner.static_prefill(capture=False).buckets == [16, 32, 64, 100]


def test_which_steps_take_the_static_prefill(tiny_qwen2_dir):
    graphs = LLM(tiny_qwen2_dir, prefill_chunk_size=64).engine.runner.static_prefill(capture=False)
    params = SamplingParams(max_new_tokens=4)
    request = Request("a", list(range(3, 200)), params, seed=0)
    other = Request("b", list(range(3, 50)), params, seed=0)
    assert graphs.fits([ScheduledChunk(request, 64, 0)])  # a prompt's first chunk
    assert graphs.fits([ScheduledChunk(other, 47, 0)])  # a whole prompt, padded to 64
    assert not graphs.fits([ScheduledChunk(request, 64, 64)])  # over a computed (or cached) prefix
    assert not graphs.fits([ScheduledChunk(request, 65, 0)])  # longer than any bucket
    assert not graphs.fits([ScheduledChunk(request, 64, 0), ScheduledChunk(other, 47, 0)])  # two prompts
    assert not graphs.fits([ScheduledChunk(request, 1, 0)])  # one token: a decode row
    assert not graphs.fits([])


def test_padded_static_prefill_matches_eager(tiny_qwen2_dir):
    """Prompts one at a time (a step each holds one chunk from position 0): of 15,
    40 and 64 tokens (buckets 16, 64 and 64), and of 97 and 150, whose first
    chunk takes the static step and the rest run eagerly over it. Tokens, top
    logprob ids and prompt logprob ids equal the eager engine's, logprob values and
    every KV block but the scratch one within rounding; the padding rows wrote the
    scratch block."""
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (15, 40, 64, 97, 150)]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    engines = {}
    for mode in ("eager", "static"):
        llm = LLM(tiny_qwen2_dir, block_size=16, prefill_chunk_size=64, enable_prefix_cache=False)
        runner = llm.engine.runner
        calls = []
        if mode == "static":
            runner.prefill_graphs = runner.static_prefill(capture=False)
            run = runner.prefill_graphs.run
            runner.prefill_graphs.run = lambda chunk: calls.append(chunk.num_new_tokens) or run(chunk)
        outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
        engines[mode] = (outputs, runner, calls)

    (eager, eager_runner, _), (static, static_runner, calls) = engines["eager"], engines["static"]
    assert calls == [15, 40, 64, 64, 64]
    for ours, theirs in zip(static, eager):  # (the padded step's GEMMs have more rows: values may round apart)
        assert ours.token_ids == theirs.token_ids
        assert [[t for t, _ in lp.top] for lp in ours.logprobs] == [[t for t, _ in lp.top] for lp in theirs.logprobs]
        assert [lp.logprob for lp in ours.logprobs] == pytest.approx([lp.logprob for lp in theirs.logprobs], abs=1e-5)
        assert ours.prompt_logprobs is not None
        assert [p and p.token_id for p in ours.prompt_logprobs] == [p and p.token_id for p in theirs.prompt_logprobs]
    scratch = static_runner.scratch_block
    assert torch.allclose(static_runner.kv_cache[:scratch], eager_runner.kv_cache[:scratch], atol=1e-5)
    assert static_runner.kv_cache[scratch].abs().sum() > 0  # the padding rows wrote there
    assert eager_runner.kv_cache[scratch].abs().sum() == 0  # and nothing else does


def test_prefill_graphs_is_a_manifest_setting():
    from cluster.config import EngineSettings

    assert EngineSettings(prefill_graphs=True).engine_config() == EngineConfig(
        **{**EngineSettings().model_dump(), "prefill_graphs": True})
    assert EngineConfig().prefill_graphs is False
