"""GC pauses: the cycle collector's stops in a decode engine, with the start-up heap frozen and not.

A serving process's heap is mostly what start-up built (Ray, torch, transformers,
the model's modules, the tokenizer); a full collection walks all of it, and every
running request waits (actors/startup_heap.py). This runs an engine in a process
with that heap (Ray imported, the engine loaded) and keeps `--batch` requests
decoding, each replaced by a new one as it ends, for `--steps` steps; a
`gc.callbacks` hook times every pass of each generation. Phases alternate within
each repeat: `as is`, then `frozen` (`freeze_startup_heap`, undone after with
`gc.unfreeze`). Workloads:
- `greedy`: no logprobs (little request state outlives a step);
- `logprobs`: 2 top logprobs a token (a `TokenLogprob` and its list kept for every
  token: what gets promoted to the oldest generation).
The figures are pause times on this CPU; what matters is the full passes' length
against a decode step's (milliseconds on a GPU).
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from benchmarks import report
from benchmarks.arguments import positive_int, preset

WORKLOADS = {"greedy": dict(temperature=0.0), "logprobs": dict(temperature=0.8, logprobs=2)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", type=preset, default="tiny")
    parser.add_argument("--batch", type=positive_int, default=64)
    parser.add_argument("--steps", type=positive_int, default=3000, help="engine steps a phase")
    parser.add_argument("--new-tokens", type=positive_int, default=300, help="tokens a request decodes before it ends")
    parser.add_argument("--repeats", type=positive_int, default=1)


class PassTimer:
    """Every collector pass's length, by generation, through `gc.callbacks`."""

    def __init__(self) -> None:
        self.passes: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.passes[info["generation"]].append((time.perf_counter() - self._started) * 1e3)


def run_phase(engine, settings: dict, args, rng: random.Random) -> dict:
    """`args.steps` steps with `args.batch` requests decoding; each pass's length."""
    from actors.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, **settings)
    add = lambda: engine.add_request([rng.randrange(3, vocab) for _ in range(100)], params)  # noqa: E731
    for _ in range(args.batch):
        add()
    timer = PassTimer()
    gc.callbacks.append(timer)
    started = time.perf_counter()
    try:
        for _ in range(args.steps):
            for output in engine.step():
                if output.finished:
                    add()
    finally:
        gc.callbacks.remove(timer)
    wall_s = time.perf_counter() - started
    for request_id in list(engine.requests):
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    result = {"wall_s": wall_s}
    for generation, passes in timer.passes.items():
        result[f"gen{generation}"] = {"passes": len(passes), "total_ms": sum(passes),
                                      "max_ms": max(passes, default=0.0)}
    return result


def main(args: argparse.Namespace) -> None:
    import importlib

    import torch

    from actors.llm import LLM
    from actors.model_builder import ensure_checkpoint
    from actors.startup_heap import freeze_startup_heap

    importlib.import_module("ray")  # a worker's heap holds Ray
    torch.set_num_threads(1)
    llm = LLM(ensure_checkpoint(args.preset, "qwen2"), max_num_seqs=args.batch, overlap_decode=True)
    gc.collect()
    tracked = len(gc.get_objects())
    rng = random.Random(0)
    runs: dict[str, dict[str, list[dict]]] = {w: {"as is": [], "frozen": []} for w in WORKLOADS}
    for _ in range(args.repeats):
        for workload, settings in WORKLOADS.items():
            runs[workload]["as is"].append(run_phase(llm.engine, settings, args, rng))
            freeze_startup_heap()
            try:
                runs[workload]["frozen"].append(run_phase(llm.engine, settings, args, rng))
            finally:
                gc.unfreeze()
    rows = []
    for workload, phases in runs.items():
        for phase, results in phases.items():
            full = [r["gen2"] for r in results]
            rows.append([workload, phase, sum(f["passes"] for f in full), max(f["max_ms"] for f in full),
                         sum(f["total_ms"] for f in full), sum(r["gen0"]["total_ms"] + r["gen1"]["total_ms"]
                                                               for r in results),
                         sum(r["wall_s"] for r in results)])
    report.print_table(
        f"Collector pauses, {args.batch} requests decoding, {args.steps} steps a phase x {args.repeats} "
        f"({tracked} objects tracked after start-up)",
        ["workload", "heap", "full passes", "longest full pass (ms)", "full passes in all (ms)",
         "young passes in all (ms)", "wall (s)"],
        rows,
    )
    longest = {(w, p): max(r["gen2"]["max_ms"] for r in results) for w, phases in runs.items()
               for p, results in phases.items()}
    report.finish(
        "gc", args.out,
        {"config": {k: v for k, v in vars(args).items() if not callable(v)}, "tracked_after_startup": tracked,
         "runs": runs, "machine": report.machine_info()},
        f"longest full pass {longest[('logprobs', 'as is')]:.0f} ms as is, "
        f"{longest[('logprobs', 'frozen')]:.0f} ms frozen (logprobs)",
        "frozen: no full pass longer than a few decode steps",
    )
