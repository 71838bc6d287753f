"""Timers the GPU check and its diagnostics share (`benchmarks/gpu_check.py`,
`gpu_check_graphs.py`, `gpu_profile.py`): wall time with the device drained, and a
decode step's time, through the engine and through the decode forward alone."""

from __future__ import annotations

import statistics
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
    warm-up missing, that put 13.8 ms a step where 1.2 was the steady figure).
    Timed again, up to three times, where the longer run was not the slower: on
    CI's two busy cores the tiny model's 64 steps once came out negative."""
    from actors.sampling_params import SamplingParams

    vocab = min(llm.engine.model_config.vocab_size, 8000)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    first = decode_first_tokens(llm, batch, prompt_len, steps)
    shorter = SamplingParams(max_new_tokens=first, temperature=0, ignore_eos=True)
    longer = SamplingParams(max_new_tokens=first + steps, temperature=0, ignore_eos=True)
    llm.generate(prompts, [longer] * batch)
    for _ in range(3):  # again where the runs' noise outweighed the steps between them (a busy CPU's)
        short = min(timed(torch, device, lambda: llm.generate(prompts, [shorter] * batch)) for _ in range(2))
        full = min(timed(torch, device, lambda: llm.generate(prompts, [longer] * batch)) for _ in range(2))
        if full > short:
            break
    return (full - short) / steps


def decode_first_tokens(llm, batch: int, prompt_len: int, steps: int) -> int:
    """The tokens `decode_step_s`'s shorter run asks of each request: past the steps
    that prefill the batch (a step's token budget at a time), so the first request
    to end has not ended before the last began, and the longer run's `steps` more
    are each a step of the whole batch decoding. With 1 + steps // 4 alone, a batch
    of 4k-token prompts (one a step) never decoded whole: of 65 steps the runs
    differed by, 20 were of the whole batch, and one carried a prefill."""
    budget = llm.engine.config.max_num_batched_tokens
    return 1 + steps // 4 + -(-batch * prompt_len // budget)


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


def cuda_time_ms(fn, repeats: int = 20, inner: int = 10, capture: bool = True, best: bool = False) -> float:
    """Device time of one call of `fn`: `inner` calls captured in one CUDA graph,
    the median of `repeats` replays over `inner`. Timed launch by launch, a small
    kernel's figure is the host's launch time instead (the first H200 run: 84 us
    for an RMSNorm of 64 rows, launched from Python under a sandboxed host). A
    function that cannot be captured (`capture=False`: the torch decode reference
    reads lengths to the host), or whose capture fails, is timed call by call with
    CUDA events. `best`: the fastest replay, not the median (a peak's).
    """
    import torch

    fn()
    torch.cuda.synchronize()
    run, per_run = fn, 1
    if capture:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for _ in range(inner):
                    fn()
            graph.replay()
            run, per_run = graph.replay, inner
        except Exception:  # not capturable after all: call by call
            pass
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / per_run)
    return min(samples) if best else statistics.median(samples)
