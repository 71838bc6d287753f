"""Engine throughput: Tandem vs Hugging Face transformers, same checkpoint, one process.

Systems, each loaded once and warmed up outside the timed region:
- `tandem`: `LLM.generate` with every request submitted at once (continuous
  batching, chunked prefill), each request its own `max_new_tokens`.
- `hf_static`: `model.generate` in padded static batches (left padding, attention
  mask, submission order); a batch runs to its longest `max_new_tokens`, and only
  each request's own requested tokens count as useful output.
- `hf_cb`: transformers' continuous batching, the engine behind
  `model.generate_batch`. `generate_batch` takes one `max_new_tokens` for all
  requests, so the mixed workload drives the same manager directly
  (`init_continuous_batching` + `add_request(max_new_tokens=...)`), which is what
  `generate_batch` wraps.

Workloads (prompts are seeded random token ids; greedy, EOS ignored):
- `mixed`: prompt lengths uniform in 32..512, output lengths uniform in 16..256.
- `equal`: 16 prompts x 128 tokens x 64 new tokens.

Every repeat draws a fresh workload from `seed + repeat` (so Tandem's prefix cache
never hits across repeats) and runs all systems on it back to back (A/B/A/B).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks import report
from benchmarks.arguments import arch, block_size, names, positive_int
from benchmarks.engine_profile import profile_tandem, sweep
from benchmarks.engine_systems import HFContinuousSystem, HFStaticSystem, RunResult, TandemSystem, load_hf_model
from benchmarks.engine_workloads import Workload, equal_workload, mixed_workload

HEADERS = ["workload", "system", "useful tok/s (median)", "total tok/s (median)", "min", "max", "spread", "runs"]


# ---- measurement -------------------------------------------------------------
def measure(systems: list, workloads_by_repeat: list[Workload]) -> dict[str, list[RunResult]]:
    """Run every system on each repeat's workload, alternating systems (A/B/A/B)."""
    runs: dict[str, list[RunResult]] = {s.name: [] for s in systems}
    for repeat, workload in enumerate(workloads_by_repeat):
        for system in systems:
            try:
                result = system.run(workload)
                returned = sum(map(len, result.token_ids))
                if returned != workload.num_output_tokens:  # (counted as asked, a run that stopped short gained)
                    raise RuntimeError(f"returned {returned} of the {workload.num_output_tokens} tokens asked")
            except Exception as exc:  # a baseline that cannot run is a finding, not a crash
                print(f"  {workload.name} repeat {repeat}: {system.name} FAILED: {type(exc).__name__}: {exc}")
                runs[system.name].append(RunResult(float("nan"), [], {"error": f"{type(exc).__name__}: {exc}"}))
                continue
            useful = workload.num_output_tokens / result.elapsed_s
            print(f"  {workload.name} repeat {repeat}: {system.name:9s} {result.elapsed_s:7.1f} s  "
                  f"{useful:7.1f} useful tok/s", flush=True)
            runs[system.name].append(result)
    return runs


def summarize(workloads: list[Workload], runs: dict[str, list[RunResult]]) -> dict:
    summary: dict = {}
    for name, results in runs.items():
        ok = [(w, r) for w, r in zip(workloads, results) if r.elapsed_s == r.elapsed_s]
        entry: dict = {"elapsed_s": [r.elapsed_s for r in results], "extra": [r.extra for r in results]}
        if ok:
            entry["useful_tok_s"] = report.spread([w.num_output_tokens / r.elapsed_s for w, r in ok])
            entry["total_tok_s"] = report.spread(
                [(w.num_output_tokens + w.num_prompt_tokens) / r.elapsed_s for w, r in ok]
            )
        summary[name] = entry
    tandem = runs.get("tandem", [])
    for name, results in runs.items():
        if name == "tandem":
            continue
        # Same workload per repeat, so the speed-up is the other system's time over Tandem's.
        paired = [r.elapsed_s / t.elapsed_s for t, r in zip(tandem, results)]
        paired = [p for p in paired if p == p]  # drop failed (NaN) runs
        if paired:
            summary[f"tandem/{name}"] = report.spread(paired)
            summary[f"tandem/{name}"]["identical_outputs"] = [
                sum(a == b for a, b in zip(t.token_ids, r.token_ids)) for t, r in zip(tandem, results)
            ]
    return summary


def table_rows(workload_name: str, summary: dict) -> list[list]:
    rows = []
    for name, entry in summary.items():
        if "/" in name:
            continue
        if "useful_tok_s" not in entry:
            rows.append([workload_name, name, "failed", None, None, None, None, len(entry["elapsed_s"])])
            continue
        useful, total = entry["useful_tok_s"], entry["total_tok_s"]
        rows.append([workload_name, name, useful["median"], total["median"], useful["min"], useful["max"],
                     f"{useful['rel_spread']:.0%}", useful["n"]])
    return rows


def ratio_rows(workload_name: str, summary: dict, num_requests: int) -> list[list]:
    rows = []
    for name, entry in summary.items():
        if "/" not in name:
            continue
        same = "/".join(str(n) for n in entry["identical_outputs"])
        rows.append([workload_name, name, report.fmt_ratio(entry["median"]), report.fmt_ratio(entry["min"]),
                     report.fmt_ratio(entry["max"]), f"{same} of {num_requests}"])
    return rows


# ---- CLI ---------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", type=arch, default="qwen2")
    parser.add_argument("--model", help="checkpoint folder (default: the built-in bench preset)")
    parser.add_argument("--repeats", type=positive_int, default=1, help="repeats of the mixed workload")
    parser.add_argument("--equal-repeats", type=positive_int, default=3, help="repeats of the equal-length workload")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 mixed requests, shorter outputs")
    parser.add_argument("--workloads", type=names("mixed", "equal"), default="mixed,equal",
                        help="comma list of mixed, equal")
    parser.add_argument("--no-hf-cb", action="store_true", help="skip the transformers continuous-batching baseline")
    parser.add_argument("--threads", type=positive_int, default=os.cpu_count(), help="torch threads (both systems)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=positive_int, default=16)
    parser.add_argument("--block-size", type=block_size, default=16)
    parser.add_argument("--prefill-chunk-size", type=positive_int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    parser.add_argument("--max-num-seqs", type=positive_int, default=64)
    parser.add_argument("--kv-cache-mib", type=positive_int, default=1024, help="KV cache size, both systems")
    parser.add_argument("--profile", action="store_true",
                        help="after the comparison, profile Tandem on a batch-64 decode workload")
    parser.add_argument("--sweep", action="store_true",
                        help="Tandem only: time a few engine settings on one mixed workload, then stop")


def resolve_model_dir(args) -> Path:
    if args.model is not None:
        if not args.model.strip():  # (--model "$UNSET": not the built-in model)
            from cluster.cli_error import CliError

            raise CliError("--model is empty: give a checkpoint folder, or leave --model out for the built-in one")
        return Path(args.model)
    from actors.model_builder import ensure_checkpoint

    return Path(ensure_checkpoint("bench", args.arch))


def engine_args(args) -> dict:
    return {
        "block_size": args.block_size,
        "prefill_chunk_size": args.prefill_chunk_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_bytes": args.kv_cache_mib * 2**20,
        "dtype": "float32",
        "device": "cpu",
    }


def main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    machine_at_start = report.machine_info()
    model_dir = resolve_model_dir(args)
    if args.sweep:
        return sweep(model_dir, args)
    out = getattr(args, "out", "benchmarks/results/engine.json")
    tandem = TandemSystem(model_dir, engine_args(args))
    vocab = tandem.llm.engine.model_config.vocab_size
    hf_model = load_hf_model(model_dir)
    systems = {
        "tandem": tandem,
        "hf_static": HFStaticSystem(hf_model, args.hf_batch_size, pad_token_id=0),
        "hf_cb": None if args.no_hf_cb else HFContinuousSystem(
            hf_model, args.max_num_batched_tokens, args.max_num_seqs, args.kv_cache_mib * 2**20),
    }
    warm = equal_workload(2, 32, 4, vocab, seed=10_000)
    for system in systems.values():
        if system is not None:
            system.run(warm)

    results: dict = {"workloads": {}}
    rows, ratios = [], []
    for name in args.workloads:
        workloads, names = workloads_for(name, args, vocab)
        chosen = [systems[n] for n in names if systems[n] is not None]
        print(f"\n{name}: {workloads[0].describe()} x {len(workloads)} repeats", flush=True)
        summary = summarize(workloads, measure(chosen, workloads))
        results["workloads"][name] = {"workload": workloads[0].describe(), "summary": summary}
        rows += table_rows(name, summary)
        ratios += ratio_rows(name, summary, workloads[0].num_requests)

    report.print_table("Throughput (useful = each request's requested output tokens)", HEADERS, rows)
    report.print_table("Tandem speed-up, paired per repeat",
                       ["workload", "ratio", "median", "min", "max", "identical greedy outputs per repeat"], ratios)
    config = {**engine_args(args), "hf_batch_size": args.hf_batch_size, "threads": args.threads}
    report.print_table("Configuration", ["setting", "value"], list(config.items()))
    if args.profile:
        results["profile"] = profile_tandem(model_dir, engine_args(args), 16 if args.quick else 64, vocab, args.seed)
    results.update(config=config, model_dir=str(model_dir), quick=args.quick,
                   machine_at_start=machine_at_start, machine=report.machine_info())
    report.finish("engine", out, results, *headline_figures(results))


def workloads_for(name: str, args, vocab: int) -> tuple[list[Workload], list[str]]:
    """One workload per repeat (fresh prompts each), and the systems that run it."""
    if name == "mixed":
        num, outputs = (16, (16, 64)) if args.quick else (64, (16, 256))
        workloads = [mixed_workload(num, vocab, args.seed + r, output_range=outputs) for r in range(args.repeats)]
        return workloads, ["tandem", "hf_static", "hf_cb"]
    if name == "equal":
        repeats, new_tokens = (1, 16) if args.quick else (args.equal_repeats, 64)
        workloads = [equal_workload(16, 128, new_tokens, vocab, args.seed + 1000 + r) for r in range(repeats)]
        return workloads, ["tandem", "hf_static"]
    raise ValueError(f"unknown workload {name!r}; choose from mixed, equal")


def headline_figures(results: dict) -> tuple[str, str]:
    parts, goals = [], []
    for workload, ratio_name, goal in (("mixed", "tandem/hf_static", "2.0x"), ("mixed", "tandem/hf_cb", "4.0x"),
                                       ("equal", "tandem/hf_static", "1.0x")):
        entry = results["workloads"].get(workload, {}).get("summary", {}).get(ratio_name)
        if entry is not None:
            parts.append(f"{ratio_name} {entry['median']:.2f}x {workload}")
            goals.append(f"{goal} {workload}" if ratio_name != "tandem/hf_cb" else f"{goal} hf_cb")
    return (", ".join(parts) or "no ratios measured"), ", ".join(goals) or "-"
