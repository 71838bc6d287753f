"""Speculative: what prompt-lookup speculative decoding saves, and costs
(actors/speculation.py, EngineConfig.num_speculative_tokens).

One process, two engines of the same model: plain decoding, and speculation with
`--drafts` draft tokens a step (the lookup's n-grams 2 to 4, the defaults). Both
generate the same `--tokens` tokens for the same prompts (seeded; the benchmark
checks that they are the same tokens), in alternation, `--repeats` times: each of
eight prompts alone, greedy, free and then each answer held to a JSON list of
short strings (structured output: drafts cut where they would leave the pattern,
the text it fixes written by jump-forward, the drafts after that text verified in
the chunk that computes it; before speculation drafted for patterned requests,
these cases ran as the plain engine does); then the eight as one
batch, greedy, at temperature 0.8 and held to the JSON list; and the eight four
times over as one batch of 32, greedy (where a CPU's step is compute-bound and
verifying every draft would cost most; the drafts a step verifies are trimmed to
those that pay, actors/speculation.py).
Per case: the time, the engine steps it took and the share of the drafts
verified that the samples confirmed (the acceptance rate).

What the figures mean on a CPU: a decode step's time grows with its rows (this
machine's two cores are compute-bound from a few rows on, `tandem bench kernels`),
so a draft costs about a row's compute whether confirmed or not, and speculation
pays where most are confirmed and the batch is small; the goodput rule then
verifies the drafts likeliest to stand, fewer the larger the batch. On a GPU a
decode step reads the weights whatever its rows, up to large batches: drafts
cost little there. With random weights
the models' greedy text falls into loops, which the lookup predicts, while
sampled text rarely repeats: the two samplings bracket what real text gets (code,
quotes, documents being edited repeat; chat much less).
"""

from __future__ import annotations

import argparse
import time

from benchmarks import report
from benchmarks.arguments import arch, int_between, positive_int, preset

SAMPLINGS = {"greedy": 0.0, "temperature 0.8": 0.8}
LARGE_BATCH = 4  # the prompts this many times over
PROMPTS = ["Once upon a time", "def fibonacci(n):", "The capital of France is", "Dear Sir or Madam,",
           "In 1905, Albert Einstein", "SELECT name FROM users WHERE", "The recipe calls for", "Breaking news:"]
JSON_ANSWER = r'\{"items": \[(?:"[a-z ]{1,12}", )+'  # a JSON list that goes on to the token limit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", type=preset, default="bench", help="built-in model preset")
    parser.add_argument("--arch", type=arch, default="qwen2")
    parser.add_argument("--tokens", type=positive_int, default=128, help="tokens each request generates")
    # (16: the engine's bound, actors.config.MAX_SPECULATIVE_TOKENS; imported here, it loaded torch for every
    # command; main checks they agree)
    parser.add_argument("--drafts", type=int_between(1, 16), default=4, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=positive_int, default=3)


def _run(llm, prompts: list[str], temperature: float, tokens: int, seed: int, regex: str | None = None) -> dict:
    from actors.sampling_params import SamplingParams

    engine = llm.engine
    before = (engine.num_steps, engine.num_draft_tokens, engine.num_accepted_draft_tokens)
    params = SamplingParams(max_new_tokens=tokens, temperature=temperature, seed=seed, ignore_eos=True, regex=regex)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    steps, drafts, accepted = (now - then for now, then in zip(
        (engine.num_steps, engine.num_draft_tokens, engine.num_accepted_draft_tokens), before))
    return {"s": seconds, "steps": steps, "drafts": drafts, "accepted": accepted,
            "token_ids": [o.token_ids for o in outputs]}


def _compare(engines: dict, cases: dict[str, tuple[list[str], float, str | None]], args) -> dict[str, dict]:
    """Each case (prompts, temperature, pattern) through both engines, alternated, `--repeats` times."""
    runs = {case: {name: [] for name in engines} for case in cases}
    for repeat in range(args.repeats):
        for case, (prompts, temperature, regex) in cases.items():
            for name in (list(engines) if repeat % 2 == 0 else list(reversed(engines))):
                runs[case][name].append(_run(engines[name], prompts, temperature, args.tokens, repeat, regex))
    figures = {}
    for case, by_name in runs.items():
        plain, spec = by_name["plain"], by_name["speculative"]
        drafts, accepted = sum(r["drafts"] for r in spec), sum(r["accepted"] for r in spec)
        plain_s, spec_s = report.median([r["s"] for r in plain]), report.median([r["s"] for r in spec])
        figures[case] = {
            "plain_s": [r["s"] for r in plain], "speculative_s": [r["s"] for r in spec], "ratio": spec_s / plain_s,
            "plain_steps": report.median([r["steps"] for r in plain]),
            "speculative_steps": report.median([r["steps"] for r in spec]), "drafts": drafts, "accepted": accepted,
            "acceptance": accepted / drafts if drafts else 0.0,
            "identical": all(p["token_ids"] == s["token_ids"] for p, s in zip(plain, spec))}
    return figures


def _rows(figures: dict[str, dict]) -> list[list]:
    return [[case, report.median(f["plain_s"]), report.median(f["speculative_s"]), f["ratio"],
             f["plain_steps"], f["speculative_steps"], f["acceptance"], f["identical"]] for case, f in figures.items()]


def main(args: argparse.Namespace) -> None:
    from actors.config import MAX_SPECULATIVE_TOKENS
    from actors.llm import LLM
    from actors.model_builder import ensure_checkpoint

    assert args.drafts <= MAX_SPECULATIVE_TOKENS, "--drafts' bound is the engine's"
    model_dir = ensure_checkpoint(args.preset, args.arch)
    max_num_seqs = len(PROMPTS) * LARGE_BATCH
    engines = {"plain": LLM(model_dir, max_num_seqs=max_num_seqs, enable_prefix_cache=False),
               "speculative": LLM(model_dir, max_num_seqs=max_num_seqs, enable_prefix_cache=False,
                                  num_speculative_tokens=args.drafts)}
    for llm in engines.values():  # warm-up: kernels built, first steps paid
        _run(llm, PROMPTS, 0.0, 8, seed=0)
    headers = ["case", "plain s", "speculative s", "ratio", "plain steps", "speculative steps", "drafts confirmed",
               "same tokens"]
    alone = _compare(engines, {prompt: ([prompt], 0.0, None) for prompt in PROMPTS}, args)
    report.print_table(f"Batch 1, greedy, {args.tokens} tokens, {args.preset} model, {args.drafts} drafts a step "
                       f"(median of {args.repeats})", headers, _rows(alone))
    alone_json = _compare(engines, {f"{prompt} (JSON)": ([prompt], 0.0, JSON_ANSWER) for prompt in PROMPTS}, args)
    report.print_table(f"Batch 1, greedy, each answer held to {JSON_ANSWER} (median of {args.repeats})", headers,
                       _rows(alone_json))
    cases = {f"batch {len(PROMPTS)}, {name}": (PROMPTS, t, None) for name, t in SAMPLINGS.items()}
    cases[f"batch {len(PROMPTS)}, greedy, JSON answer"] = (PROMPTS, 0.0, JSON_ANSWER)
    cases[f"batch {len(PROMPTS) * LARGE_BATCH}, greedy"] = (PROMPTS * LARGE_BATCH, 0.0, None)
    batched = _compare(engines, cases, args)
    report.print_table(f"The prompts as one batch (median of {args.repeats})", headers, _rows(batched))
    ratios = sorted(f["ratio"] for f in alone.values())
    json_ratio = report.median([f["ratio"] for f in alone_json.values()])
    everything = {**alone, **alone_json, **batched}
    report.finish(
        "speculative", args.out,
        {"config": {k: v for k, v in vars(args).items() if not callable(v)}, "alone": alone,
         "alone_json": alone_json, "batched": batched, "machine": report.machine_info()},
        f"greedy alone {ratios[0]:.2f}-{ratios[-1]:.2f}x the time (median {report.median(ratios):.2f}x; "
        f"held to JSON, median {json_ratio:.2f}x), "
        f"batches {max(f['ratio'] for f in batched.values()):.2f}x at worst; same tokens: "
        f"{all(f['identical'] for f in everything.values())}",
        "same tokens; below 1x where most drafts are confirmed",
    )
