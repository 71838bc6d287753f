"""A short start-up profile of an engine: real prefill and decode-step timings that
seed the scheduler's cost models before live traffic refines them.

Runs once a worker, as its engine thread's first call (`WorkerBase.profile`), so
before any request: it steps the engine itself and keeps the outputs, so a live
request stepped by it would lose its tokens. Prompts are random token ids and leave
no trace but evictable device cache: none of their blocks goes to the node's KV
store. They did, about a hundred blocks each time a worker started (107, 1.75 MB,
on the tiny model: docs/benchmarks.md, "By-hand probes (fifty-first session)"),
into the host tier and on to disk and the shared path, pushing out
real prefixes; and a store restarted just then took a late batch of them (a
clean-clone run of test_kv_store_workers found it).

Decode steps are timed at batches of 1, 4 and 16 short prompts, so the profile
cannot tell a step's KV tokens from its rows (they grow together); a D's live
token gaps refit its model within seconds. A batch of four long prompts added to
the rows was tried and not kept: on the bench model it mended long contexts at
small batches (4 x 1024 tokens predicted -10%, not -30%) and spoiled large ones
(16 x 512: +27%, not 0%), its mean error over seven shapes 14% against 11%
(a one-off probe in one process, both fits on the same profile).
Prefill is timed step by step, as live traffic is (actors/prefill_steps.py), on
prompts of 16 to 1024 tokens after a warm-up request: a long prompt goes in
several chunks whose steps attend to a growing prefix, so the model's attention
term is fitted where it matters. Timed as whole prompts of 16, 64 and 256 tokens,
three rows for three coefficients, one noisy timing fixed the quadratic term:
the tiny model's 1800-token prompt was predicted at 1.2 s and took 0.1 s.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from actors.engine import Engine
from actors.messages import PrefillStep
from actors.sampling_params import SamplingParams


@dataclass
class EngineProfile:
    prefill_steps: list[PrefillStep] = field(default_factory=list)
    decode: list[tuple[int, int, float]] = field(default_factory=list)  # (batch, kv tokens, s/step)
    kv_bytes_per_block: int = 0
    num_steps: int = 0  # the engine's step count when the profile ended: live steps are later ones


def _prefill_steps(engine: Engine, prompt_ids: list[int]) -> list[PrefillStep]:
    """One prompt's prefill, step by step as the engine logged them."""
    engine.add_request(prompt_ids, SamplingParams(max_new_tokens=1))
    steps = []
    while engine.has_unfinished():
        before = engine.num_steps
        engine.step()
        steps += engine.prefill_steps.latest(after=before)
    return steps


def _decode_row(engine: Engine, prompts: list[list[int]], steps: int) -> tuple[int, int, float] | None:
    """(batch, KV tokens, seconds a step) of `steps` decode steps of `prompts` together."""
    params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    for prompt_ids in prompts:
        engine.add_request(prompt_ids, params)
    engine.step()  # the prefills (and first tokens)
    while any(r.is_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    kv_tokens = sum(r.num_tokens for r in engine.scheduler.running)
    started = time.perf_counter()
    num_steps = 0
    while engine.has_unfinished():
        engine.step()
        num_steps += 1
    return (len(prompts), kv_tokens, (time.perf_counter() - started) / num_steps) if num_steps else None


def profile_engine(
    engine: Engine, prompt_lens=(16, 64, 256, 1024), batch_sizes=(1, 4, 16), decode_steps: int = 3
) -> EngineProfile:
    if engine.has_unfinished():  # (its steps would take a live request's tokens: it would wait for ever)
        raise RuntimeError("profile an engine before its first request, not beside one")
    with engine.store_bridge.not_saving():
        return _profile(engine, prompt_lens, batch_sizes, decode_steps)


def _profile(engine: Engine, prompt_lens, batch_sizes, decode_steps: int) -> EngineProfile:
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    profile = EngineProfile(kv_bytes_per_block=engine.runner.kv_cache[0].numel() * engine.runner.kv_cache.element_size())
    limit = min(engine.max_model_len - 2, engine.pool.num_blocks * engine.pool.block_size // 2)
    _decode_row(engine, [[rng.randrange(vocab) for _ in range(min(16, limit))]], decode_steps)  # first-call costs
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in sorted({min(n, limit) for n in prompt_lens})]
    for prompt_ids in prompts:
        profile.prefill_steps += _prefill_steps(engine, prompt_ids)
    for batch in batch_sizes:
        if batch <= engine.config.max_num_seqs:
            row = _decode_row(engine, [[rng.randrange(vocab) for _ in range(16)] for _ in range(batch)], decode_steps)
            if row is not None:
                profile.decode.append(row)
    profile.num_steps = engine.num_steps
    engine.prefill_steps.clear()  # (the profile's, in `profile`: the worker's stats carry live ones only)
    return profile
