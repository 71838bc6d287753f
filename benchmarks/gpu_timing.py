"""Timers the GPU check and its diagnostics share (`benchmarks/gpu_check.py`,
`gpu_check_graphs.py`, `gpu_profile.py`): wall time with the device drained, and a
decode step's time, through the engine and through the decode forward alone."""

from __future__ import annotations

import time


def timed(torch, device: str, fn) -> float:
    """Seconds `fn()` takes, the device drained before and after (CUDA)."""
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def decode_step_s(torch, llm, device: str, batch: int, prompt_len: int, steps: int, rng) -> float:
    """One decode step's time at `batch`: two runs that differ only in `steps` decode
    steps (both decode some, so what a request's end costs is in both), each the
    best of two, after one untimed run of the longer (the first decode steps at a
    batch size compile what is compiled lazily: on the first H200 run, untimed
    warm-up missing, that put 13.8 ms a step where 1.2 was the steady figure)."""
    from actors.sampling_params import SamplingParams

    vocab = min(llm.engine.model_config.vocab_size, 8000)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    first = 1 + steps // 4
    shorter = SamplingParams(max_new_tokens=first, temperature=0, ignore_eos=True)
    longer = SamplingParams(max_new_tokens=first + steps, temperature=0, ignore_eos=True)
    llm.generate(prompts, [longer] * batch)
    short = min(timed(torch, device, lambda: llm.generate(prompts, [shorter] * batch)) for _ in range(2))
    full = min(timed(torch, device, lambda: llm.generate(prompts, [longer] * batch)) for _ in range(2))
    return (full - short) / steps


def static_decode_step_s(torch, runner, device: str, batch: int, context_len: int, repeats: int = 50) -> float:
    """The decode forward alone at `batch` sequences of `context_len` tokens: inputs
    copied in and the step's graph replayed (the padded static step where there is
    no graph), back to back; no scheduling, sampling or detokenizing. Writes K/V at
    each sequence's last position in the first blocks of the cache (the engine is
    idle, nothing there is in use)."""
    static = runner.decode_graphs or runner.static_decode(capture=False)
    size = runner.config.block_size
    num_blocks = -(-context_len // size)
    tables = [list(range(i * num_blocks, (i + 1) * num_blocks)) for i in range(batch)]
    last = context_len - 1
    inputs = dict(token_ids=[5] * batch, positions=[last] * batch, block_tables=tables)
    static.run(**inputs)  # warm-up
    return timed(torch, device, lambda: [static.run(**inputs) for _ in range(repeats)]) / repeats
