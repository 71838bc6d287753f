"""Where Tandem's engine spends a step (`tandem bench engine --profile`) and which
engine settings are fastest (`--sweep`): benchmark instrumentation that wraps the
engine's own objects, nothing in the engine is edited.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

from benchmarks import report
from benchmarks.engine_systems import RunResult, TandemSystem
from benchmarks.engine_workloads import Workload, equal_workload, mixed_workload


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
    objects (the kernels its attention and norm modules hold among them), plus the
    kernel names `actors.model` calls (benchmark instrumentation, nothing is edited).
    Returns a function that puts the kernel names and the modules' kernels back."""
    import actors.model as model_module

    engine.step = timer.wrap("step (total)", engine.step)
    engine.scheduler.schedule = timer.wrap("scheduler.schedule", engine.scheduler.schedule)
    engine.scheduler.update = timer.wrap("scheduler.update", engine.scheduler.update)
    writer = engine.writer
    writer._append = timer.wrap("writer._append (detokenize, stops)", writer._append)
    runner = engine.runner
    runner._metadata = timer.wrap("runner._metadata (step tensors)", runner._metadata)
    runner._sample = timer.wrap("runner._sample (on the device)", runner._sample)
    runner.collect = timer.wrap("runner.collect (tokens to the host)", runner.collect)
    model = runner.model
    if model.config.is_moe:
        from actors.config import CheckpointError

        raise CheckpointError("the profile times a dense model's layers; a mixture of experts is not profiled")
    model.forward = timer.wrap("model forward (total)", model.forward)
    model.compute_logits = timer.wrap("lm_head (compute_logits)", model.compute_logits)
    norms = [module for module in model.modules() if isinstance(module, model_module.RMSNorm)]
    norm_kernels = {norm: (norm.kernel, norm.add_kernel) for norm in norms}
    for norm in norms:
        norm.kernel = timer.wrap("  rms_norm (and the residual add)", norm.kernel)
        norm.add_kernel = timer.wrap("  rms_norm (and the residual add)", norm.add_kernel)
    attention = {layer.self_attn: layer.self_attn.kernels for layer in model.model.layers}  # the runner's picks
    activations = {layer.mlp: layer.mlp.silu_and_mul for layer in model.model.layers}
    for layer in model.model.layers:
        picked = layer.self_attn.kernels
        layer.self_attn.kernels = dataclasses.replace(
            picked,
            prefill_attention=timer.wrap("  prefill_attention", picked.prefill_attention),
            decode_attention=timer.wrap("  decode_attention", picked.decode_attention),
            rope_and_write_kv=timer.wrap("  apply_rope and write_kv_slots", picked.rope_and_write_kv),
        )
        layer.mlp.silu_and_mul = timer.wrap("  silu_and_mul", layer.mlp.silu_and_mul)
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            linear.forward = timer.wrap("  linear layers (qkv, o, gate_up, down)", linear.forward)

    def restore() -> None:
        for mlp, activation in activations.items():
            mlp.silu_and_mul = activation
        for norm, (kernel, add_kernel) in norm_kernels.items():
            norm.kernel, norm.add_kernel = kernel, add_kernel
        for module, picked in attention.items():
            module.kernels = picked

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
    from benchmarks.engine import engine_args

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
