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
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import report

HEADERS = ["workload", "system", "useful tok/s (median)", "total tok/s (median)", "min", "max", "spread", "runs"]
SPECIAL_IDS = 3  # the presets' special tokens are ids 0..2; prompts avoid them


# ---- workloads ---------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_new_tokens)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
        }


def mixed_workload(num_requests: int, vocab_size: int, seed: int,
                   prompt_range=(32, 512), output_range=(16, 256)) -> Workload:
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        length = rng.randint(*prompt_range)
        prompts.append([rng.randrange(SPECIAL_IDS, vocab_size) for _ in range(length)])
        outputs.append(rng.randint(*output_range))
    return Workload("mixed", prompts, outputs)


def equal_workload(num_requests: int, prompt_len: int, new_tokens: int, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(SPECIAL_IDS, vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)]
    return Workload("equal", prompts, [new_tokens] * num_requests)


# ---- systems -----------------------------------------------------------------
@dataclass
class RunResult:
    elapsed_s: float
    token_ids: list[list[int]]
    extra: dict = field(default_factory=dict)


class TandemSystem:
    name = "tandem"

    def __init__(self, model_dir: Path, engine_args: dict) -> None:
        from actors.llm import LLM

        self.llm = LLM(model_dir, **engine_args)

    def run(self, workload: Workload) -> RunResult:
        from actors.sampling_params import SamplingParams

        params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in workload.max_new_tokens]
        steps_before = self.llm.engine.num_steps
        started = time.perf_counter()
        outputs = self.llm.generate(workload.prompts, params)
        elapsed = time.perf_counter() - started
        return RunResult(elapsed, [o.token_ids for o in outputs], {
            "num_steps": self.llm.engine.num_steps - steps_before,
            "num_cached_tokens": sum(o.num_cached_tokens for o in outputs),
        })


def load_hf_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as for Tandem
    return model


class HFStaticSystem:
    name = "hf_static"

    def __init__(self, model, batch_size: int, pad_token_id: int) -> None:
        self.model, self.batch_size, self.pad_token_id = model, batch_size, pad_token_id

    def run(self, workload: Workload) -> RunResult:
        import torch

        token_ids: list[list[int]] = []
        num_generated = 0
        started = time.perf_counter()
        for first in range(0, workload.num_requests, self.batch_size):
            prompts = workload.prompts[first : first + self.batch_size]
            wants = workload.max_new_tokens[first : first + self.batch_size]
            width, longest = max(len(p) for p in prompts), max(wants)
            input_ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                    do_sample=False, pad_token_id=self.pad_token_id,
                )
            assert out.shape[1] == width + longest, (out.shape, width, longest)
            token_ids += [row[width : width + n].tolist() for row, n in zip(out, wants)]
            num_generated += len(prompts) * longest
        elapsed = time.perf_counter() - started
        return RunResult(elapsed, token_ids, {"num_generated_tokens_incl_waste": num_generated})


class HFContinuousSystem:
    """transformers' continuous batching manager (what `generate_batch` wraps)."""

    name = "hf_cb"

    def __init__(self, model, max_batch_tokens: int, max_num_seqs: int, kv_cache_bytes: int) -> None:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        page_size = 256
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bytes_per_page = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4 * page_size
        self.model = model
        self.cb_config = ContinuousBatchingConfig(
            page_size=page_size,
            num_blocks=max(8, kv_cache_bytes // bytes_per_page),
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_num_seqs,
        )

    def run(self, workload: Workload) -> RunResult:
        import torch
        from transformers import GenerationConfig

        generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
        with torch.inference_mode():
            manager = self.model.init_continuous_batching(
                generation_config=generation_config, continuous_batching_config=self.cb_config
            )
            manager.warmup()
            started = time.perf_counter()
            manager.start()
            try:
                ids = [
                    manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                    for i, (p, n) in enumerate(zip(workload.prompts, workload.max_new_tokens))
                ]
                results = {}
                while len(results) < len(ids):
                    result = manager.get_result(timeout=1)
                    if result is None and not manager.is_running():
                        raise RuntimeError("transformers continuous batching thread stopped early")
                    if result is not None and result.is_finished():
                        if result.error is not None:
                            raise RuntimeError(f"transformers continuous batching: {result.error}")
                        results[result.request_id] = result
                elapsed = time.perf_counter() - started
            finally:
                manager.stop(block=True, timeout=30)
                manager.destroy()
        return RunResult(elapsed, [list(results[i].generated_tokens) for i in ids])


# ---- measurement -------------------------------------------------------------
def measure(systems: list, workloads_by_repeat: list[Workload]) -> dict[str, list[RunResult]]:
    """Run every system on each repeat's workload, alternating systems (A/B/A/B)."""
    runs: dict[str, list[RunResult]] = {s.name: [] for s in systems}
    for repeat, workload in enumerate(workloads_by_repeat):
        for system in systems:
            try:
                result = system.run(workload)
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
    parser.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    parser.add_argument("--model", help="checkpoint folder (default: the built-in bench preset)")
    parser.add_argument("--repeats", type=int, default=1, help="repeats of the mixed workload")
    parser.add_argument("--equal-repeats", type=int, default=3, help="repeats of the equal-length workload")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 mixed requests, shorter outputs")
    parser.add_argument("--workloads", default="mixed,equal", help="comma list of mixed, equal")
    parser.add_argument("--no-hf-cb", action="store_true", help="skip the transformers continuous-batching baseline")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (both systems)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-chunk-size", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-mib", type=int, default=1024, help="KV cache size, both systems")
    parser.add_argument("--profile", action="store_true",
                        help="after the comparison, profile Tandem on a batch-64 decode workload")
    parser.add_argument("--sweep", action="store_true",
                        help="Tandem only: time a few engine settings on one mixed workload, then stop")


def resolve_model_dir(args) -> Path:
    if args.model:
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
    for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
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


# ---- profile -------------------------------------------------------------------
class PhaseTimer:
    """Wall time per named phase, by wrapping callables (CPU ops are synchronous, so
    a wrapper's time is the work's time). Times go to the current `bucket`."""

    def __init__(self) -> None:
        self.bucket = "all"
        self.totals: dict[tuple[str, str], float] = {}
        self.counts: dict[tuple[str, str], int] = {}

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = (self.bucket, phase)
                self.totals[key] = self.totals.get(key, 0.0) + time.perf_counter() - started
                self.counts[key] = self.counts.get(key, 0) + 1

        return timed

    def rows(self, bucket: str, num_steps: int) -> list[list]:
        step_s = self.totals.get((bucket, "step (total)"), 0.0)
        rows = []
        for (b, phase), total in sorted(self.totals.items(), key=lambda kv: -kv[1]):
            if b == bucket:
                rows.append([phase, total / max(num_steps, 1) * 1e3, f"{total / step_s:.1%}" if step_s else "-",
                             self.counts[(b, phase)]])
        return rows


def instrument(engine, timer: PhaseTimer):
    """Wrap the engine's phases and the model's kernels with `timer`: this engine's
    objects, plus the kernel names `actors.model` calls (benchmark instrumentation,
    nothing is edited). Returns a function that puts the kernel names back."""
    import actors.model as model_module

    engine.step = timer.wrap("step (total)", engine.step)
    engine.scheduler.schedule = timer.wrap("scheduler.schedule", engine.scheduler.schedule)
    engine.scheduler.update = timer.wrap("scheduler.update", engine.scheduler.update)
    engine._append_token = timer.wrap("engine._append_token (detokenize, stops)", engine._append_token)
    engine._output = timer.wrap("engine._output (RequestOutput)", engine._output)
    runner = engine.runner
    runner._metadata = timer.wrap("runner._metadata (step tensors)", runner._metadata)
    runner._sample = timer.wrap("runner._sample", runner._sample)
    model = runner.model
    model.forward = timer.wrap("model forward (total)", model.forward)
    model.compute_logits = timer.wrap("lm_head (compute_logits)", model.compute_logits)
    kernels = ("decode_attention", "prefill_attention", "write_kv_slots", "apply_rope", "rms_norm")
    originals = {name: getattr(model_module, name) for name in kernels}
    for name, fn in originals.items():
        setattr(model_module, name, timer.wrap(f"  {name}", fn))
    for layer in model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            linear.forward = timer.wrap("  linear layers (qkv, o, gate_up, down)", linear.forward)

    def restore() -> None:
        for name, fn in originals.items():
            setattr(model_module, name, fn)

    return restore


def profile_tandem(model_dir: Path, engine_config: dict, num_requests: int, vocab: int, seed: int,
                   num_profiled_steps: int = 8) -> dict:
    """Phase breakdown of Tandem's steps (prefill-carrying vs decode-only) on mixed
    prompts with 64 new tokens each, and a torch.profiler op table over a few
    decode steps at full batch (those steps are left out of the phase table).
    Prints the tables; returns the figures."""
    from actors.llm import LLM

    workload = mixed_workload(num_requests, vocab, seed + 5000, output_range=(64, 64))
    engine = LLM(model_dir, **engine_config).engine
    timer = PhaseTimer()
    restore = instrument(engine, timer)
    try:
        steps, ops = _drive(engine, workload, timer, num_profiled_steps)
    finally:
        restore()
    result = {"workload": workload.describe(), "steps": steps, "phases_ms_per_step": {}}
    for bucket in ("prefill", "decode"):
        rows = timer.rows(bucket, steps[bucket])
        result["phases_ms_per_step"][bucket] = {r[0].strip(): r[1] for r in rows}
        report.print_table(f"Tandem profile: {bucket} steps ({steps[bucket]} steps; nested rows indented)",
                           ["phase", "ms/step", "of step", "calls"], rows)
    if ops is not None:
        total_us = sum(e.self_cpu_time_total for e in ops)
        top = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:15]
        rows = [[e.key, e.self_cpu_time_total / num_profiled_steps / 1e3, f"{e.self_cpu_time_total / total_us:.1%}",
                 e.count // num_profiled_steps] for e in top]
        result["decode_ops_ms_per_step"] = {r[0]: r[1] for r in rows}
        report.print_table(f"torch.profiler, {num_profiled_steps} decode steps at batch {num_requests} (self CPU time)",
                           ["op", "ms/step", "share", "calls/step"], rows)
    return result


def _drive(engine, workload: Workload, timer: PhaseTimer, num_profiled_steps: int):
    """Step the engine to the end; the first time every request is decoding, run
    `num_profiled_steps` steps under torch.profiler. Returns step counts per bucket
    and the profiler's op averages (None if the batch never filled)."""
    from torch.profiler import ProfilerActivity, profile

    from actors.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    for prompt in workload.prompts:
        engine.add_request(prompt, params)
    steps = {"prefill": 0, "decode": 0, "profiled": 0}
    ops = None
    while engine.has_unfinished():
        running = engine.scheduler.running
        decode_only = not engine.scheduler.waiting and all(not r.is_prefill for r in running)
        if decode_only and ops is None and len(running) == workload.num_requests:
            timer.bucket = "profiled"
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(num_profiled_steps):
                    engine.step()
            steps["profiled"] += num_profiled_steps
            ops = prof.key_averages()
            continue
        timer.bucket = "decode" if decode_only else "prefill"
        steps[timer.bucket] += 1
        engine.step()
    return steps, ops


# ---- sweep ---------------------------------------------------------------------
SWEEP = [  # (block_size, prefill_chunk_size, max_num_batched_tokens)
    (16, 512, 2048),
    (32, 512, 2048),
    (64, 512, 2048),
    (16, 256, 1024),
    (16, 1024, 4096),
]


def sweep(model_dir: Path, args) -> None:
    """Tandem alone on one mixed workload (32 requests; 16 with --quick) for each
    setting in SWEEP, twice in alternating order; reports median useful tok/s."""
    base = engine_args(args)
    systems = []
    for block_size, chunk, budget in SWEEP:
        system = TandemSystem(model_dir, {**base, "block_size": block_size, "prefill_chunk_size": chunk,
                                          "max_num_batched_tokens": budget})
        system.name = f"bs{block_size}/chunk{chunk}/budget{budget}"
        systems.append(system)
    vocab = systems[0].llm.engine.model_config.vocab_size
    for system in systems:
        system.run(equal_workload(2, 32, 4, vocab, seed=10_000))
    num = 16 if args.quick else 32
    workloads = [mixed_workload(num, vocab, args.seed + 2000 + r, output_range=(16, 64) if args.quick else (16, 256))
                 for r in range(2)]
    runs: dict[str, list[RunResult]] = {s.name: [] for s in systems}
    for repeat, workload in enumerate(workloads):
        for system in systems if repeat % 2 == 0 else systems[::-1]:
            result = system.run(workload)
            print(f"  sweep repeat {repeat}: {system.name:26s} {result.elapsed_s:7.1f} s", flush=True)
            runs[system.name].append(result)
    rows = []
    for (block_size, chunk, budget), system in zip(SWEEP, systems):
        rates = [w.num_output_tokens / r.elapsed_s for w, r in zip(workloads, runs[system.name])]
        rows.append([block_size, chunk, budget, report.median(rates), min(rates), max(rates),
                     statistics.median(r.extra["num_steps"] for r in runs[system.name])])
    report.print_table(f"Tandem settings sweep ({num} mixed requests x 2, max_num_seqs {args.max_num_seqs})",
                       ["block_size", "prefill_chunk_size", "max_num_batched_tokens", "useful tok/s (median)",
                        "min", "max", "steps"], rows)
    best = max(rows, key=lambda row: row[3])
    payload = {"sweep": [dict(zip(["block_size", "prefill_chunk_size", "max_num_batched_tokens", "useful_tok_s",
                                   "min", "max", "steps"], row)) for row in rows],
               "workload": workloads[0].describe(), "machine": report.machine_info()}
    out = Path(getattr(args, "out", "benchmarks/results/engine.json"))
    report.finish("engine", out.with_name(out.stem + "_sweep.json"), payload,
                  f"best setting bs{best[0]}/chunk{best[1]}/budget{best[2]} {best[3]:.1f} useful tok/s", "-")
