"""A short start-up profile of an engine: real prefill and decode-step timings that
seed the scheduler's cost models before live traffic refines them.

Runs on the engine thread (through `EngineLoop.call`) before the worker takes
requests; prompts are random token ids and leave no trace but evictable cache.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from actors.engine import Engine
from actors.sampling_params import SamplingParams


@dataclass
class EngineProfile:
    prefill: list[tuple[int, int, float]] = field(default_factory=list)  # (new, cached, seconds)
    decode: list[tuple[int, int, float]] = field(default_factory=list)  # (batch, kv tokens, s/step)
    kv_bytes_per_block: int = 0


def _drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def profile_engine(
    engine: Engine, prompt_lens=(16, 64, 256), batch_sizes=(1, 4, 16), decode_steps: int = 3
) -> EngineProfile:
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    profile = EngineProfile(kv_bytes_per_block=engine.runner.kv_cache[0].numel() * engine.runner.kv_cache.element_size())
    limit = min(engine.max_model_len - 2, engine.pool.num_blocks * engine.pool.block_size // 2)
    for length in sorted({min(n, limit) for n in prompt_lens}):
        engine.add_request([rng.randrange(vocab) for _ in range(length)], SamplingParams(max_new_tokens=1))
        started = time.perf_counter()
        _drain(engine)
        profile.prefill.append((length, 0, time.perf_counter() - started))
    for batch in batch_sizes:
        if batch > engine.config.max_num_seqs:
            continue
        params = SamplingParams(max_new_tokens=decode_steps + 1, ignore_eos=True)
        for _ in range(batch):
            engine.add_request([rng.randrange(vocab) for _ in range(16)], params)
        engine.step()  # the prefills (and first tokens)
        while any(r.is_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        kv_tokens = sum(r.num_tokens for r in engine.scheduler.running)
        started = time.perf_counter()
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        if steps:
            profile.decode.append((batch, kv_tokens, (time.perf_counter() - started) / steps))
    return profile
