"""Overlapped decode (actors/engine.py) changes when the host reads a step's tokens,
never what they are. On CPU a launched step has already run, so these tests check
the bookkeeping the GPU relies on: the same scripted traffic (arrivals mid-run, stop
tokens and strings, seeded sampling, logprobs, penalties, bad words, aborts, a reused request
id, a pool short enough to preempt) gives identical outputs with and without overlap, through
both the eager step and the static one CUDA graphs replay; steps really are launched
ahead; and no block leaks. (Timing needs a GPU: `benchmarks/gpu_check.py`.)"""

from __future__ import annotations

import dataclasses
import random

import pytest

from actors.config import EngineConfig
from actors.engine import Engine
from actors.sampling_params import SamplingParams


def _params(rng: random.Random, **overrides) -> SamplingParams:
    settings = dict(
        max_new_tokens=rng.randint(1, 30),
        temperature=rng.choice([0.0, 0.0, 0.8]),
        top_p=rng.choice([1.0, 0.9]),
        seed=rng.randrange(1000),
        logprobs=rng.choice([None, 0, 2]),
        ignore_eos=True,
    )
    settings.update(overrides)
    return SamplingParams(**settings)


def _script(seed: int, stop_token: int) -> dict[int, list[tuple]]:
    """Actions before each `step()` call: ('add', id, prompt, params) or ('abort', id)."""
    rng = random.Random(seed)
    script: dict[int, list[tuple]] = {}
    ids = iter(range(1000))

    def add(call, **overrides):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
        script.setdefault(call, []).append(("add", f"r{next(ids)}", prompt, _params(rng, **overrides)))

    for _ in range(6):
        add(0)
    add(0, max_new_tokens=40, stop_token_ids=[stop_token])
    add(0, max_new_tokens=40, stop=[" "])
    add(12, max_new_tokens=20, repetition_penalty=1.4, frequency_penalty=0.5)  # counts its input on the device
    add(12, max_new_tokens=25, presence_penalty=1.5, repetition_penalty=0.8, temperature=0.8)
    add(14, max_new_tokens=20, bad_words=["the", "quick brown"])  # a two-token word: sampled once the host reads
    for call in (12, 13, 30):
        add(call)
    script.setdefault(8, []).append(("abort", "r2"))
    script.setdefault(9, []).append(("add", "r2", [7, 8, 9], _params(rng, max_new_tokens=12)))  # the id again
    script.setdefault(20, []).append(("abort", "r3"))
    return script


def _run(engine: Engine, script: dict[int, list[tuple]]) -> dict[tuple[str, int], tuple]:
    """Every request's final output, keyed by (id, the call that added it)."""
    results: dict[tuple[str, int], tuple] = {}
    added: dict[str, int] = {}
    call = 0
    while engine.has_unfinished() or call <= max(script):
        for action in script.get(call, []):
            if action[0] == "add":
                _, request_id, prompt, params = action
                engine.add_request(prompt, params, request_id)
                added[request_id] = call
            else:
                out = engine.abort(action[1])
                results[(out.request_id, added[out.request_id])] = (out.token_ids, out.logprobs, out.finish_reason)
        for out in engine.step():
            if out.finished:
                key = (out.request_id, added[out.request_id])
                results[key] = (out.token_ids, out.text, out.logprobs, out.finish_reason)
        engine.pool.check()
        call += 1
    assert engine.pool.num_used == 0
    return results


def _engine(model_dir, overlap: bool, static: bool, **config) -> Engine:
    engine = Engine(model_dir, EngineConfig(block_size=16, prefill_chunk_size=32, max_num_batched_tokens=128,
                                            enable_prefix_cache=False, overlap_decode=overlap, **config))
    if static:
        engine.runner.decode_graphs = engine.runner.static_decode(capture=False)
    return engine


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_overlap_gives_the_same_outputs(tiny_qwen2_dir, static):
    probe = _engine(tiny_qwen2_dir, overlap=False, static=False)
    probe.add_request([11, 12, 13], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True), "probe")
    while probe.has_unfinished():
        outputs = probe.step()
    stop_token = outputs[0].token_ids[5]  # a token greedy decoding reaches mid-way
    script = _script(3, stop_token)

    runs = {}
    for overlap in (False, True):
        engine = _engine(tiny_qwen2_dir, overlap, static)
        runs[overlap] = _run(engine, script)
        if overlap:
            assert engine.num_steps_launched_ahead > 10
        else:
            assert engine.num_steps_launched_ahead == 0
    assert runs[True] == runs[False]
    reasons = {key: result[-1].value for key, result in runs[True].items()}
    assert {"stop", "length", "abort"} <= set(reasons.values())
    assert reasons[("r2", 0)] == "abort" and ("r2", 9) in reasons


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_penalised_requests_overlap_and_give_the_same_outputs(tiny_qwen2_dir, static):
    """A checkpoint whose generation_config.json sets a repetition penalty penalises
    every request: their steps are launched ahead too (each row's last token counted
    on the device), and the tokens are those of reading every step first."""
    rng = random.Random(5)
    script = {0: [("add", f"p{i}", [rng.randrange(3, 40) for _ in range(30)],  # few distinct ids: repeats
                   SamplingParams(max_new_tokens=40, ignore_eos=True, seed=i, temperature=rng.choice([0.0, 0.9]),
                                  repetition_penalty=rng.choice([1.05, 1.5, 0.7]),
                                  frequency_penalty=rng.choice([0.0, 1.0, -0.5]),
                                  presence_penalty=rng.choice([0.0, 1.5]))) for i in range(6)]}
    runs, ahead = {}, {}
    for overlap in (False, True):
        engine = _engine(tiny_qwen2_dir, overlap, static)
        runs[overlap] = _run(engine, script)
        ahead[overlap] = engine.num_steps_launched_ahead
    assert runs[True] == runs[False]
    assert ahead[True] >= 30 and ahead[False] == 0


# Held to a pattern: fixed text between the fields (jump-forward writes it), now
# and then fixed text (after three digits), letters and spaces.
PATTERNS = [r'\{"name": "[a-z]{1,6}", "age": [1-9][0-9]?\}', r"\d{1,3}(, \d{1,3}){0,9}", "[a-z ]{1,30}"]


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_patterned_requests_overlap_and_give_the_same_outputs(tiny_qwen2_dir, static):
    """Requests held to a pattern, and one with a bad word of two tokens, beside
    free ones: ahead of the host only the forward runs, sampled once the tokens
    before are read (`ModelRunner.sample_deferred`); a row after which jump-forward
    wrote text is dropped and the run ends. The outputs are those of reading every
    step first, with jump-forward on and off."""
    rng = random.Random(7)
    script = {0: [("add", f"f{i}", [rng.randrange(3, 500) for _ in range(20)], _params(rng, max_new_tokens=30))
                  for i in range(3)]}
    script[0] += [("add", f"p{i}", [rng.randrange(3, 500) for _ in range(rng.randint(5, 30))],
                   _params(rng, max_new_tokens=40, regex=pattern, ignore_eos=False, logprobs=None))
                  for i, pattern in enumerate(PATTERNS * 2)]
    script[3] = [("add", "b", [5, 6, 7], _params(rng, max_new_tokens=25, bad_words=["the", "quick brown"]))]
    for jump_forward in (True, False):
        runs, ahead, stale = {}, {}, []
        for overlap in (False, True):
            engine = _engine(tiny_qwen2_dir, overlap, static, jump_forward=jump_forward)
            sample = engine.runner.sample_deferred

            def counting(step, sample=sample):
                sample(step)
                stale.append(len(step.stale_rows))
            engine.runner.sample_deferred = counting
            runs[overlap] = _run(engine, script)
            ahead[overlap] = engine.num_steps_launched_ahead
        assert runs[True] == runs[False], jump_forward
        assert ahead[True] >= 15 and ahead[False] == 0, ahead
        assert len(stale) >= 10 and (sum(stale) > 0) == jump_forward, stale
    held = [runs[True][(f"p{i}", 0)][1] for i in range(len(PATTERNS))]
    assert held[0].startswith('{"name": "') and set(held[1]) <= set("0123456789, "), held


def test_overlap_under_preemption(tiny_qwen2_dir):
    """A pool too small for the batch: planning the next decodes ahead finds no
    block, the engine reads the step first and `schedule()` preempts, as without
    overlap."""
    rng = random.Random(1)
    script = {0: [("add", f"r{i}", [rng.randrange(3, 500) for _ in range(30)],
                   SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)) for i in range(6)]}
    runs, preemptions = {}, {}
    for overlap in (False, True):
        engine = _engine(tiny_qwen2_dir, overlap, static=True, num_kv_blocks=14)
        runs[overlap] = _run(engine, script)
        preemptions[overlap] = engine.scheduler.num_preemptions
    assert runs[True] == runs[False]
    assert preemptions[True] == preemptions[False] > 0


def test_a_full_batch_with_a_request_queued_still_overlaps_and_gives_the_same_outputs(tiny_qwen2_dir):
    """max_num_seqs 2 and three requests: the third waits for a seat, and nobody
    can be admitted until a request ends. Every step of that wait ran without
    overlap (a review's probe: 0 of 39 launched ahead), under the sustained load
    overlap is for. It now overlaps, and the third starts once a seat is free."""
    for lengths, num_steps, ahead in (((40, 40, 40), 80, 70), ((5, 10, 30), 35, 25)):
        script = {0: [("add", f"r{i}", [5 + i] * 8, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
                      for i, n in enumerate(lengths)]}
        runs, steps = {}, {}
        for overlap in (False, True):
            engine = _engine(tiny_qwen2_dir, overlap, static=False, max_num_seqs=2)
            runs[overlap] = _run(engine, script)
            steps[overlap] = engine.num_steps
        assert runs[True] == runs[False]
        # A seat `step` frees by length (r0's at step 5): r2 starts as soon as without overlap, not a launched
        # step later (36 steps)
        assert steps[True] == steps[False] == num_steps, lengths
        assert engine.num_steps_launched_ahead >= ahead, lengths  # (40, 40, 40): 38 before, none while r2 waited


def test_overlap_is_on_for_cuda_only_by_default():
    assert not EngineConfig().overlaps_decode
    assert EngineConfig(device="cuda").overlaps_decode
    assert not EngineConfig(device="cuda", overlap_decode=False).overlaps_decode
    assert EngineConfig(overlap_decode=True).overlaps_decode


def _prefill(engine: Engine, prompt: list[int], params: SamplingParams, request_id: str):
    """What a prefill worker hands a decode worker: the first token, the prompt's KV
    blocks, the request's sampling seed (as actors/prefill_worker.py)."""
    one = dataclasses.replace(params, max_new_tokens=1, ignore_eos=True, stop=(), stop_token_ids=())
    engine.add_request(prompt, one, request_id, exports_kv=True)
    request = engine.requests[request_id]
    blocks = None
    while blocks is None:
        exported, outputs = engine.run_step()
        blocks = next((c.block_ids for c in exported if c.end == len(prompt)), None)
    first = next(o for o in outputs if o.request_id == request_id)
    kv = engine.runner.read_blocks(blocks).clone()
    return first, kv, request.seed


def test_activations_join_an_overlapped_run(tiny_qwen2_dir):
    """A decode worker's requests arrive with their prompt KV and first token while
    others decode: they join the step launched ahead instead of ending the run, and
    every output is what the engine gives without overlap (two held to a pattern)."""
    from actors.request import SampledToken

    rng = random.Random(4)
    prefill = _engine(tiny_qwen2_dir, overlap=False, static=False)
    arrivals = {}  # call -> [(id, prompt, params, (first, kv, seed))]
    for index, call in enumerate((0, 0, 0, 3, 4, 4, 9, 15)):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(5, 60))]
        params = _params(rng, max_new_tokens=rng.randint(5, 25))
        if index in (3, 6):  # held to a pattern: the step after is sampled once the host has read its tokens
            params = dataclasses.replace(params, regex="[a-z ]{1,40}", logprobs=None, ignore_eos=False)
        request_id = f"d{index}"
        arrivals.setdefault(call, []).append((request_id, prompt, params, _prefill(prefill, prompt, params, request_id)))

    runs = {}
    for overlap in (False, True):
        engine = _engine(tiny_qwen2_dir, overlap, static=True)
        finished, call = {}, 0
        while engine.has_unfinished() or call <= max(arrivals):
            for request_id, prompt, params, (first, kv, seed) in arrivals.get(call, []):
                reservation = engine.reserve(prompt, params, request_id)
                engine.runner.write_blocks(reservation.block_ids[: len(kv)], kv)
                token = SampledToken(first.token_ids[0], first.logprobs[0] if first.logprobs else None)
                out = engine.activate(request_id, token, seed)
                if out.finished:
                    finished[request_id] = (out.token_ids, out.text, out.logprobs)
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = (out.token_ids, out.text, out.logprobs)
            engine.pool.check()
            call += 1
        assert engine.pool.num_used == 0
        runs[overlap] = (finished, engine.num_steps, engine.num_steps_launched_ahead)
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 8
    # The batch never empties in this script: every step but the first is launched
    # ahead (28 of 32 when an activation ends the run instead of joining it).
    (_, steps, ahead), (_, _, in_turn_ahead) = runs[True], runs[False]
    assert ahead == steps - 1 and in_turn_ahead == 0
