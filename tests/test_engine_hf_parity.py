"""Greedy token ids identical to transformers `generate` (float32), logprobs within
1e-4 of HF's log-softmax, across chunk sizes, block sizes, arrivals, prefix-cache
hits and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from actors.config import EngineConfig
from actors.engine import Engine
from actors.sampling_params import SamplingParams
from tests.conftest import hf_greedy, hf_logprobs

PROMPT_LENGTHS = [1, 2, 15, 16, 17, 31, 33, 64, 100, 127, 200, 255, 300, 333, 400, 450, 511, 512, 555, 600]
NEW_TOKENS = 32
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)

_REFERENCE: dict = {}


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def _reference(model_dir):
    key = str(model_dir)
    if key not in _REFERENCE:
        engine_vocab = Engine(model_dir, EngineConfig(num_kv_blocks=4)).model_config.vocab_size
        prompts = _prompts(engine_vocab)
        _REFERENCE[key] = (prompts, [hf_greedy(model_dir, p, NEW_TOKENS) for p in prompts])
    return _REFERENCE[key]


def _run(engine: Engine, prompts, staggered: bool) -> list:
    """All prompts at once, or one new arrival every other step."""
    pending = list(enumerate(prompts))
    ids: dict[str, int] = {}
    done: dict[int, object] = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and (not staggered or step % 2 == 0):
            batch = pending if not staggered else pending[:1]
            for index, prompt in batch:
                ids[engine.add_request(prompt, GREEDY)] = index
            pending = pending[len(batch) :]
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out
        step += 1
    return [done[i] for i in range(len(prompts))]


CONFIGS = {
    "chunk-block-multiple": dict(block_size=16, prefill_chunk_size=64),
    "chunk-not-multiple": dict(block_size=16, prefill_chunk_size=50, max_num_batched_tokens=160),
    "chunk-larger-than-prompt": dict(block_size=32, prefill_chunk_size=1024),
    "block32-odd-chunk-staggered": dict(block_size=32, prefill_chunk_size=77),
    "staggered": dict(block_size=16, prefill_chunk_size=128),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf(tiny_model_dir, name):
    prompts, expected = _reference(tiny_model_dir)
    engine = Engine(tiny_model_dir, EngineConfig(**CONFIGS[name]))
    outputs = _run(engine, prompts, staggered="staggered" in name)
    for prompt, want, out in zip(prompts, expected, outputs):
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens"
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_logprobs_match_hf_log_softmax(tiny_model_dir):
    prompts, _ = _reference(tiny_model_dir)
    engine = Engine(tiny_model_dir, EngineConfig(block_size=16, prefill_chunk_size=64))
    outputs = _run(engine, prompts[::4], staggered=False)
    for prompt, out in zip(prompts[::4], outputs):
        ours = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(ours, hf_logprobs(tiny_model_dir, prompt, out.token_ids), atol=1e-4, rtol=0)


def test_prefix_cache_hits_still_match(tiny_model_dir):
    prompts, expected = _reference(tiny_model_dir)
    engine = Engine(tiny_model_dir, EngineConfig(block_size=16, prefill_chunk_size=64))
    first = _run(engine, prompts, staggered=False)
    assert all(out.num_cached_tokens == 0 for out in first)
    second = _run(engine, prompts, staggered=False)
    for prompt, want, out in zip(prompts, expected, second):
        assert out.token_ids == want
        # Every full block but the one holding the last prompt token is reused.
        assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    engine.pool.check()


def test_preemption_by_recompute_still_matches(tiny_model_dir):
    prompts, expected = _reference(tiny_model_dir)
    # 48 blocks of 16 tokens: room for about one long request at a time.
    engine = Engine(tiny_model_dir, EngineConfig(block_size=16, prefill_chunk_size=64, num_kv_blocks=48))
    outputs = _run(engine, prompts, staggered=False)
    assert engine.scheduler.num_preemptions > 0
    for want, out in zip(expected, outputs):
        assert out.token_ids == want
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_a_request_preempted_after_its_prompts_logprobs_reuses_its_cached_prompt(tiny_model_dir):
    """Preempted once its prompt's logprobs were all in, a request that asked for
    them computed its whole prompt again (the cache skipped for it as for a new
    one): as many tokens as one that did not ask, and the logprobs still HF's."""
    def run(prompt_logprobs):
        engine = Engine(tiny_model_dir, EngineConfig(block_size=16, num_kv_blocks=6, max_num_batched_tokens=64,
                                                     prefill_chunk_size=64))
        engine.add_request(list(range(1, 40)), SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True), "A")
        engine.add_request(list(range(100, 133)), SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True,
                                                                 prompt_logprobs=prompt_logprobs), "B")
        computed, launch = [0], engine.runner.launch

        def counted(chunks, *args, **kwargs):
            computed[0] += sum(c.num_new_tokens for c in chunks if c.request.request_id == "B")
            return launch(chunks, *args, **kwargs)

        engine.runner.launch = counted
        results = {}
        while engine.has_unfinished():
            results.update({out.request_id: out for out in engine.step() if out.finished})
        engine.pool.check()
        return computed[0], engine.scheduler.num_preemptions, results["B"]

    plain, asked = run(None), run(0)
    assert asked[1] == plain[1] > 0 and asked[0] == plain[0]  # (it was 103 tokens against 87)
    assert asked[2].token_ids == plain[2].token_ids
    ours = torch.tensor([lp.logprob for lp in asked[2].prompt_logprobs[1:]])
    torch.testing.assert_close(ours, hf_logprobs(tiny_model_dir, [100], list(range(101, 133))), atol=1e-4, rtol=0)


@pytest.mark.parametrize("config", [dict(prefill_chunk_size=64), dict(prefill_chunk_size=50, max_num_batched_tokens=70),
                                    dict(prefill_chunk_size=1024)], ids=["chunks-64", "chunks-50-budget-70", "whole"])
def test_prompt_logprobs_match_hf_log_softmax(tiny_model_dir, config):
    """Each prompt token's logprob given the ones before (vLLM's prompt_logprobs,
    SGLang's input logprobs), with its 2 best, whatever the chunking; a prompt
    whose blocks are cached is computed again for them."""
    prompts, _ = _reference(tiny_model_dir)
    engine = Engine(tiny_model_dir, EngineConfig(block_size=16, **config))
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    for prompt in prompts[2::5] + prompts[2::5]:  # the second time, their blocks are in the prefix cache
        request_id = engine.add_request(prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == request_id and out.finished:
                    result = out
        assert result.num_cached_tokens == 0
        first, *rest = result.prompt_logprobs
        assert first is None and [lp.token_id for lp in rest] == prompt[1:]
        ours = torch.tensor([lp.logprob for lp in rest])
        torch.testing.assert_close(ours, hf_logprobs(tiny_model_dir, prompt[:1], prompt[1:]), atol=1e-4, rtol=0)
        assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.logprob - 1e-6 for lp in rest)
    engine.pool.check()
