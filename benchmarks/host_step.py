"""Host: the Python a decode step costs, the part of a step a GPU does not run.

On a GPU, a small model's decode step is shorter than the host work around it
(reading the sampled tokens, stop checks, detokenizing, building outputs, planning
the next step and copying its inputs in, launching the sampling), so that work, not
the memory bandwidth, sets the step time: overlapped decode hides it only up to the
device step's length (docs/benchmarks.md, GPU check). This measures it without a
GPU: the engine decodes `--batch` requests in steady state through the static decode
step (the one CUDA graphs replay; uncaptured here) with overlapped decode on, and a
step's host time is its wall time less the model's forward and LM head and less
sampling (each timed by wrapping it). Sampling is reported on its own: it is
device work (an argmax, a softmax and a prefix sum over the vocabulary) plus host
work (launching those, one draw from each request's generator), which a CPU run
cannot separate. A worker's engine thread also turns each step's outputs into token
events (`TokenStreams.publish`, actors/token_streams.py) before the next step: that
has a column of its own, `publish`, outside the host figure.

Workloads, alternated within each repeat (medians over `--repeats`):
- `greedy`: temperature 0 (what the GPU check's decode MBU runs);
- `sampled`: temperature 0.8, seeded (the default request samples with a
  temperature alone; a top_p row would add a CPU top-k over the vocabulary, device
  work on a GPU, which would swamp the host figure here);
- `sampled+logprobs+stop`: the same with 2 top logprobs a token and a stop string
  that never matches (the heaviest per-token path);
- `instruct defaults`: what a Qwen2.5 instruct checkpoint's generation_config.json
  makes of every request that leaves sampling to it (temperature 0.7, top_p 0.8,
  top_k 20, repetition penalty 1.05): a CPU top-k over the vocabulary in the
  sampling column, and the penalties' counts in the host one.
The `ahead` column is the share of steps launched before the previous step's
tokens were read (overlapped decode; what hides the host time on a GPU).

The goal is a derived one: at 0.7 of an H200's bandwidth the Qwen2.5-0.5B preset's
decode step at batch 64 and about 160 tokens of context (1.1 GB read) takes about
0.33 ms, so the host work must fit in that for overlap to hide it. This machine's
CPU is slower than a GPU server's, so read the figure as an upper bound.
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks import report
from benchmarks.arguments import positive_int, preset

WORKLOADS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8),
    "sampled+logprobs+stop": dict(temperature=0.8, logprobs=2, stop=["\u2603never"]),
    "instruct defaults": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
}
GOAL_MS = 0.33


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", type=preset, default="tiny", help="model preset (tiny: the device work is small)")
    parser.add_argument("--batch", type=positive_int, default=64)
    parser.add_argument("--steps", type=positive_int, default=200, help="decode steps timed per workload and repeat")
    parser.add_argument("--prompt-tokens", type=positive_int, default=100)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads")


def decode_step_ms(llm, settings: dict, args, seed: int) -> dict[str, float]:
    """Add `batch` requests, run them into steady decoding, then time `steps` steps:
    per step, the host time, the sampling calls and the model (forward, LM head),
    and the worker's publishing of the step's outputs as token events (timed apart,
    not in the host figure)."""
    import asyncio

    import actors.model_runner as runner_module
    from actors.sampling_params import SamplingParams
    from actors.token_streams import TokenStreams
    from benchmarks.engine_profile import PhaseTimer

    engine = llm.engine
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    warmup = 5
    params = SamplingParams(max_new_tokens=args.steps + warmup + 2, ignore_eos=True, seed=seed, **settings)
    events_loop = asyncio.new_event_loop()
    streams = TokenStreams(events_loop)
    feed = streams.batches("bench")
    for _ in range(args.batch):
        request_id = engine.add_request([rng.randrange(3, vocab) for _ in range(args.prompt_tokens)], params)
        streams.open(request_id, "bench")
    while not all(r.output_token_ids for r in engine.requests.values()):  # every prompt prefilled
        engine.step()
    for _ in range(warmup):
        engine.step()
    timer = PhaseTimer()
    model = engine.runner.model
    sample, logprobs_of = runner_module.sample, runner_module.logprobs_of
    model.forward, model.compute_logits = timer.wrap("model", model.forward), timer.wrap("model", model.compute_logits)
    runner_module.sample = timer.wrap("sampling", sample)
    runner_module.logprobs_of = timer.wrap("sampling", logprobs_of)
    publish = timer.wrap("publish", streams.publish)
    # The events go to the loop as in a worker; a consumer's feed takes them (this
    # benchmark's own work, timed apart and left out of every figure).
    take_events = timer.wrap("feed", lambda: events_loop.run_until_complete(anext(feed)))
    launched_ahead = engine.num_steps_launched_ahead
    try:
        started = time.perf_counter()
        for _ in range(args.steps):
            publish(engine.step())
            take_events()
        wall = time.perf_counter() - started
        launched_ahead = engine.num_steps_launched_ahead - launched_ahead
    finally:
        del model.forward, model.compute_logits  # the class's methods again
        runner_module.sample, runner_module.logprobs_of = sample, logprobs_of
        events_loop.run_until_complete(feed.aclose())
        events_loop.close()
    while engine.has_unfinished():
        engine.step()
    seconds = {part: timer.totals.get(("all", part), 0.0) for part in ("model", "sampling", "publish", "feed")}
    per_step = lambda s: s / args.steps * 1e3  # noqa: E731
    host = wall - seconds["model"] - seconds["sampling"] - seconds["publish"] - seconds["feed"]
    return {"host": per_step(host), "sampling": per_step(seconds["sampling"]), "model": per_step(seconds["model"]),
            "publish": per_step(seconds["publish"]), "ahead": launched_ahead / args.steps}


def main(args: argparse.Namespace) -> None:
    import torch

    from actors.llm import LLM
    from actors.model_builder import ensure_checkpoint
    from actors.startup_heap import freeze_startup_heap

    torch.set_num_threads(args.threads)
    model_dir = ensure_checkpoint(args.preset, "qwen2")
    llm = LLM(model_dir, max_num_seqs=args.batch, enable_prefix_cache=False, overlap_decode=True,
              max_num_batched_tokens=max(2048, args.prompt_tokens * 4))
    runner = llm.engine.runner
    runner.decode_graphs = runner.static_decode(capture=False)  # the CUDA-graph step's host path
    freeze_startup_heap()  # as a worker does: no full collection walks the start-up heap
    times: dict[str, list[dict]] = {name: [] for name in WORKLOADS}
    for repeat in range(args.repeats):
        names = list(WORKLOADS) if repeat % 2 == 0 else list(reversed(WORKLOADS))
        for name in names:
            times[name].append(decode_step_ms(llm, WORKLOADS[name], args, seed=repeat))
    summary = {name: {part: report.spread([run[part] for run in runs]) for part in runs[0]}
               for name, runs in times.items()}
    report.print_table(
        f"Host time of a decode step, batch {args.batch}, {args.steps} steps, median of {args.repeats} (ms a step)",
        ["workload", "host", "host min", "host max", "host us / sequence", "sampling (host + CPU work)",
         "model (CPU)", "publish (a worker's token events)", "ahead"],
        [[name, s["host"]["median"], s["host"]["min"], s["host"]["max"], s["host"]["median"] * 1e3 / args.batch,
          s["sampling"]["median"], s["model"]["median"], s["publish"]["median"], s["ahead"]["median"]]
         for name, s in summary.items()],
    )
    greedy = summary["greedy"]["host"]["median"]
    report.finish(
        "host", args.out,
        {"config": {k: v for k, v in vars(args).items() if not callable(v)}, "model_dir": model_dir, "ms_per_step": summary,
         "machine": report.machine_info()},
        f"{greedy:.2f} ms a greedy decode step at batch {args.batch}",
        f"<= {GOAL_MS} ms (fits a 0.5B step at 0.7 MBU)",
    )
