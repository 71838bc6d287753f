"""Deferred: the host time of a scheduler step while a queue waits for a prefix.

    tandem bench deferred [--queued 300,1000] [--prefix-tokens 2048,8192] [--repeats 3] [--out FILE.json]

A burst of requests sharing a long new prefix (a system prompt, a document) waits
while the first of them computes it (`Scheduler._waits_for_prefix`, the in-batch
prefix caching of actors/scheduler.py), a chunk a step. Every step, the scheduler
goes through the whole queue to decide who waits. This measures one worker's
`Scheduler.schedule()` alone (no model: the plan and the prefix cache's
bookkeeping, plain Python), with `--queued` requests behind one that computes a
`--prefix-tokens` prefix in 512-token chunks, each request's own 20 tokens after
it. Reported per (queued, prefix): the median `schedule()` time over the steps
the prefix takes to compute, and beside it, in the same run, the median time of
what each of those steps did before a waiting request kept the block it waits
for: a prefix-cache lookup (`Scheduler.cached_prefix`) of every waiting request.
Medians over `--repeats` runs of each case.

The goal: a step under a millisecond with a thousand requests waiting, a few
GPU decode steps of the 0.5B preset at batch 64 (about 0.33 ms each at 0.7 of an
H200's bandwidth; `tandem bench host`), so that a queue barely slows the batch it
waits behind. The deciding costs about a microsecond a waiting request here.
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks import report
from benchmarks.arguments import positive_int, positive_ints

BLOCK_SIZE = 16
CHUNK_TOKENS = 512
OWN_TOKENS = 20
GOAL_MS = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--queued", type=positive_ints, default=(300, 1000), help="requests waiting (comma-separated)")
    parser.add_argument("--prefix-tokens", type=positive_ints, default=(2048, 8192),
                        help="the shared prefix's length (comma-separated)")
    parser.add_argument("--repeats", type=positive_int, default=3)


def one_run(num_queued: int, prefix_tokens: int, seed: int) -> dict[str, float]:
    """Median ms of `schedule()`, and of a lookup of every waiting request, per
    step while the first request computes the shared prefix."""
    from actors.block_pool import BlockPool
    from actors.config import EngineConfig
    from actors.request import Request
    from actors.sampling_params import SamplingParams
    from actors.scheduler import Scheduler

    # (room for the first prompt and more: nothing is evicted while the queue waits)
    num_blocks = 2 * (prefix_tokens + OWN_TOKENS) // BLOCK_SIZE + 64
    config = EngineConfig(block_size=BLOCK_SIZE, prefill_chunk_size=CHUNK_TOKENS,
                          max_num_batched_tokens=4 * CHUNK_TOKENS, num_kv_blocks=num_blocks)
    scheduler = Scheduler(config, BlockPool(num_blocks, BLOCK_SIZE))
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 2000) for _ in range(prefix_tokens)]
    params = SamplingParams(max_new_tokens=4, temperature=0)
    for index in range(num_queued + 1):
        own = [rng.randrange(3, 2000) for _ in range(OWN_TOKENS)]
        scheduler.add(Request(f"r{index}", prefix + own, params, seed=index))
    step_ms, lookups_ms = [], []
    while True:
        started = time.perf_counter()
        out = scheduler.schedule()
        step_ms.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        for request in scheduler.waiting:
            scheduler.cached_prefix(request)
        lookups_ms.append((time.perf_counter() - started) * 1e3)
        scheduler.update(out.chunks)
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running):
            break  # the prefix is computed: the queue goes in
    return {"schedule_ms": report.median(step_ms), "lookups_ms": report.median(lookups_ms),
            "steps": len(step_ms)}


def main(args: argparse.Namespace) -> None:
    rows, results = [], []
    for num_queued in args.queued:
        for prefix_tokens in args.prefix_tokens:
            runs = [one_run(num_queued, prefix_tokens, seed) for seed in range(args.repeats)]
            case = {"queued": num_queued, "prefix_tokens": prefix_tokens, "steps": runs[0]["steps"],
                    "schedule_ms": report.median([r["schedule_ms"] for r in runs]),
                    "lookups_ms": report.median([r["lookups_ms"] for r in runs])}
            results.append(case)
            rows.append([num_queued, prefix_tokens, case["steps"], report.fmt(case["schedule_ms"]),
                         report.fmt(case["lookups_ms"]), report.fmt_ratio(report.ratio(case["lookups_ms"],
                                                                                      case["schedule_ms"]))])
    report.print_table("Scheduler step while a queue waits for a prefix in compute (median ms a step)",
                       ["queued", "prefix tokens", "steps", "schedule()", "a lookup each (before)", "before / now"],
                       rows)
    worst = max(case["schedule_ms"] for case in results)
    report.finish("deferred", args.out, {"cases": results}, f"worst median schedule() {worst:.2f} ms",
                  f"<= {GOAL_MS} ms")
