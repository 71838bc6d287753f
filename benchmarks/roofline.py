"""Roofline: this machine's measured peaks, and how close Tandem's prefill and decode get.

1. Peak float32 matmul FLOP/s: `torch.matmul` into a preallocated output, square
   sizes up to 3072, best of several.
2. Peak memory bandwidth: a 256 MiB tensor `copy_` into a preallocated destination
   (bytes read + written / time) and a `sum` (bytes read / time), best of several;
   the higher of the two is the roof (so MBU is not flattered).
   Both peaks are measured before and after the engine runs and the higher is
   kept: on a shared machine a peak taken in a busy moment would flatter MFU/MBU.
3. Prefill MFU: one 2048-token prompt through the engine in one chunk.
   Model FLOPs = 2 * matmul params * tokens + causal attention FLOPs
   (num_layers * 4 * num_heads * head_dim * T(T+1)/2) + the LM head on the sampled
   row; MFU = FLOPs / time / peak FLOP/s.
4. Decode MBU at batch 1: the same prompt, then `--decode-tokens` greedy tokens;
   bytes per step = every weight a step reads (the linear layers, the LM head, the
   norms) + the KV cache it attends to (num_layers * 2 * context * kv_heads *
   head_dim * 4); MBU = bytes / median step time / peak bandwidth.

The same figures for Hugging Face transformers (one forward of the prompt, and
`generate` at batch 1) are printed beside Tandem's as a reference, measured
alternately with Tandem's (A/B, then B/A) on fresh prompts: prefill takes the best
repeat, decode the median repeat.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

from benchmarks import report
from benchmarks.arguments import arch, int_between, positive_int


# ---- machine peaks -------------------------------------------------------------
def best_time(fn, repeats: int) -> float:
    fn()  # warm-up: first touch of outputs, library initialisation
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def peak_matmul_flops(sizes=(1024, 2048, 3072), repeats: int = 5) -> dict:
    import torch

    results = {}
    for n in sizes:
        a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        seconds = best_time(lambda: torch.matmul(a, b, out=out), repeats)
        results[n] = 2 * n**3 / seconds
    return {"flops": max(results.values()), "by_size": results}


def peak_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 10) -> dict:
    import torch

    src = torch.empty(num_bytes // 4).uniform_()
    dst = torch.empty_like(src)
    copy_bps = 2 * num_bytes / best_time(lambda: dst.copy_(src), repeats)
    sum_bps = num_bytes / best_time(lambda: src.sum(), repeats)
    return {"bytes_per_s": max(copy_bps, sum_bps), "copy_bytes_per_s": copy_bps, "sum_bytes_per_s": sum_bps}


# ---- model arithmetic -----------------------------------------------------------
def model_counts(model) -> dict:
    """Parameter counts of a Tandem `ForCausalLM`: matmul weights per token, the LM
    head, and every weight a decode step reads."""
    if model.config.is_moe:  # (a token reads its experts only: another count)
        from actors.config import CheckpointError

        raise CheckpointError("the roofline counts a dense model's weights; a mixture of experts is not modelled")
    layers = model.model.layers
    linear = sum(
        m.weight.numel()
        for layer in layers
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    )
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    small = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 1)  # norms, biases
    return {
        "params_total": sum(p.numel() for p in model.parameters()),
        "params_linear": linear,
        "params_lm_head": head.numel(),
        "params_read_per_decode_step": linear + head.numel() + small,
    }


def prefill_flops(config, counts: dict, num_tokens: int) -> float:
    dense = 2 * counts["params_linear"] * num_tokens + 2 * counts["params_lm_head"]
    attention = config.num_layers * 4 * config.num_heads * config.head_dim * num_tokens * (num_tokens + 1) / 2
    return dense + attention


def kv_bytes(config, context_tokens: float, element_size: int = 4) -> float:
    return config.num_layers * 2 * context_tokens * config.num_kv_heads * config.head_dim * element_size


# ---- measurements -----------------------------------------------------------------
def random_prompt(num_tokens: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(num_tokens)]


class TandemTarget:
    name = "tandem"

    def __init__(self, llm) -> None:
        self.llm = llm

    def prefill_s(self, prompt: list[int]) -> float:
        from actors.sampling_params import SamplingParams

        started = time.perf_counter()
        self.llm.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True))
        return time.perf_counter() - started

    def decode_step_s(self, prompt: list[int], num_tokens: int) -> float:
        """The mean gap between consecutive output tokens at batch 1, as
        transformers' is taken (`HFTarget`: the time its N - 1 later tokens took):
        MBU is bytes over time, and the median left out the slow steps (a new KV
        block, a collection), a row of the two compared that gained by it."""
        from actors.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=num_tokens, temperature=0, ignore_eos=True)
        stamps = self.llm.generate([prompt], params)[0].token_times_s
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


class HFTarget:
    name = "hf (reference)"

    def __init__(self, model) -> None:
        self.model = model

    def prefill_s(self, prompt: list[int]) -> float:
        import torch

        ids = torch.tensor([prompt])
        started = time.perf_counter()
        with torch.inference_mode():
            self.model(ids, logits_to_keep=1)
        return time.perf_counter() - started

    def decode_step_s(self, prompt: list[int], num_tokens: int) -> float:
        """Mean decode step of `generate` at batch 1: (time for N tokens - time for 1) / (N - 1)."""
        import torch

        ids = torch.tensor([prompt])

        def run(n: int) -> float:
            started = time.perf_counter()
            with torch.inference_mode():
                self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                    do_sample=False, pad_token_id=0)
            return time.perf_counter() - started

        return (run(num_tokens) - run(1)) / (num_tokens - 1)


def measure_targets(targets: list, args, vocab: int) -> dict[str, dict[str, list[float]]]:
    """Prefill and decode of every target, alternating targets within each repeat
    (A/B, then B/A) after one warm-up each; fresh prompts every time."""
    short = random_prompt(64, vocab, args.seed - 1)
    for target in targets:
        target.prefill_s(short)
        target.decode_step_s(short, 4)
    times = {t.name: {"prefill_s": [], "decode_step_s": []} for t in targets}
    for r in range(args.repeats):
        for target in targets if r % 2 == 0 else targets[::-1]:
            times[target.name]["prefill_s"].append(
                target.prefill_s(random_prompt(args.prompt_tokens, vocab, args.seed + r)))
            times[target.name]["decode_step_s"].append(
                target.decode_step_s(random_prompt(args.prompt_tokens, vocab, args.seed + 100 + r), args.decode_tokens))
        print(f"  repeat {r}: " + ", ".join(
            f"{n} prefill {t['prefill_s'][-1]:.2f} s, decode {t['decode_step_s'][-1] * 1e3:.1f} ms/step"
            for n, t in times.items()), flush=True)
    return times


# ---- CLI --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", type=arch, default="qwen2")
    parser.add_argument("--model", help="checkpoint folder (default: the built-in bench preset)")
    parser.add_argument("--threads", type=positive_int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--prompt-tokens", type=positive_int, default=2048)
    parser.add_argument("--decode-tokens", type=int_between(2), default=32, help="(a gap needs two tokens)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="repeats of prefill and decode per system (after a warm-up)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers reference rows")
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> None:
    import torch

    from actors.llm import LLM

    torch.set_num_threads(args.threads)
    if args.model:
        model_dir = Path(args.model)
    else:
        from actors.model_builder import ensure_checkpoint

        model_dir = Path(ensure_checkpoint("bench", args.arch))
    out = getattr(args, "out", "benchmarks/results/roofline.json")

    print("measuring peaks ...", flush=True)
    peaks = [(peak_matmul_flops(), peak_bandwidth())]
    chunk = max(args.prompt_tokens, 512)
    llm = LLM(model_dir, prefill_chunk_size=chunk, max_num_batched_tokens=chunk, enable_prefix_cache=False,
              dtype="float32", device="cpu")
    config, vocab = llm.engine.model_config, llm.engine.model_config.vocab_size
    targets = [TandemTarget(llm)]
    if not args.no_hf:
        from benchmarks.engine_systems import load_hf_model

        targets.append(HFTarget(load_hf_model(model_dir)))
    print("prefill and decode, systems alternating ...", flush=True)
    timings = measure_targets(targets, args, vocab)
    print("measuring peaks again ...", flush=True)
    peaks.append((peak_matmul_flops(), peak_bandwidth()))

    matmul = max((p[0] for p in peaks), key=lambda m: m["flops"])
    bandwidth = max((p[1] for p in peaks), key=lambda b: b["bytes_per_s"])
    counts = model_counts(llm.engine.runner.model)
    context = args.prompt_tokens + args.decode_tokens / 2
    work = {"flops": prefill_flops(config, counts, args.prompt_tokens),
            "step_bytes": counts["params_read_per_decode_step"] * 4 + kv_bytes(config, context)}
    results: dict = {"peak_matmul": matmul, "peak_bandwidth": bandwidth, "peaks_before_after": peaks,
                     "model": counts, "prefill_flops": work["flops"], "decode_bytes_per_step": work["step_bytes"],
                     "decode_context_tokens": context}
    for system, t in timings.items():
        results[system] = utilisation(work, t["prefill_s"], t["decode_step_s"], matmul["flops"],
                                      bandwidth["bytes_per_s"])

    print_tables(args, results, timings, chunk, model_dir)
    results.update(model_dir=str(model_dir), threads=args.threads, prompt_tokens=args.prompt_tokens,
                   decode_tokens=args.decode_tokens, machine=report.machine_info())
    tandem = results["tandem"]
    report.finish("roofline", out, results,
                  f"prefill MFU {tandem['prefill_mfu']:.2f}, decode MBU {tandem['decode_mbu']:.2f}", ">= 0.5 both")


def utilisation(work: dict, prefill_times: list[float], step_times: list[float], peak_flops: float,
                peak_bps: float) -> dict:
    """Prefill: the best repeat (MFU); decode: the median repeat (MBU)."""
    prefill_s, step_s = min(prefill_times), statistics.median(step_times)
    return {
        "prefill_s": prefill_times, "prefill_best_s": prefill_s,
        "prefill_flops_per_s": work["flops"] / prefill_s, "prefill_mfu": work["flops"] / prefill_s / peak_flops,
        "decode_step_s_by_repeat": step_times, "decode_step_s": step_s,
        "decode_bytes_per_s": work["step_bytes"] / step_s, "decode_mbu": work["step_bytes"] / step_s / peak_bps,
    }


def print_tables(args, results: dict, timings: dict, chunk: int, model_dir: Path) -> None:
    matmul, bandwidth, counts = results["peak_matmul"], results["peak_bandwidth"], results["model"]
    report.print_table("Machine peaks (best of several, before and after the engine)", ["measure", "value"], [
        ["matmul float32 GFLOP/s", matmul["flops"] / 1e9],
        *[[f"  matmul {n}x{n} GFLOP/s", f / 1e9] for n, f in matmul["by_size"].items()],
        ["bandwidth GB/s (roof)", bandwidth["bytes_per_s"] / 1e9],
        ["  copy (read + write) GB/s", bandwidth["copy_bytes_per_s"] / 1e9],
        ["  sum (read) GB/s", bandwidth["sum_bytes_per_s"] / 1e9],
    ])
    rows = [[system, r["prefill_best_s"], r["prefill_flops_per_s"] / 1e9, r["prefill_mfu"],
             r["decode_step_s"] * 1e3, r["decode_bytes_per_s"] / 1e9, r["decode_mbu"]]
            for system, r in ((s, results[s]) for s in timings)]
    report.print_table(
        f"Prefill {args.prompt_tokens} tokens ({results['prefill_flops'] / 1e9:.0f} GFLOP) and batch-1 decode at "
        f"~{results['decode_context_tokens']:.0f} tokens of context "
        f"({results['decode_bytes_per_step'] / 1e6:.0f} MB per step)",
        ["system", "prefill s (best)", "GFLOP/s", "MFU", "decode ms/step (median)", "GB/s", "MBU"], rows)
    report.print_table("Setup", ["setting", "value"], [
        ["model", str(model_dir)], ["threads", args.threads], ["prefill chunk", chunk],
        ["params (total / linear / lm_head)",
         f"{counts['params_total']} / {counts['params_linear']} / {counts['params_lm_head']}"],
    ])
