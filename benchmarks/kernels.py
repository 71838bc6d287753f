"""Kernels: the C++ CPU kernels against torch on the bench model's shapes.

1. Linear layers: one decode step's worth of matrix products (every linear layer of
   the `bench` preset's 12 layers and the LM head, 356 MB of float32 weights, so
   nothing stays in cache between repeats) at M input rows, through
   `torch.nn.functional.linear` (MKL) and through the C++ small-batch kernel
   (`kernels/csrc/small_linear.cpp`, called directly, ignoring its MAX_ROWS
   hand-over). This is how `kernels.cpu_linear.MAX_ROWS` is chosen: the largest M
   where the C++ kernel is still faster.
2. Decode attention over a paged cache, 12 layers: the torch reference
   (`kernels.attention.decode_attention`) against the C++ kernel, at batch 1 with
   a 2064-token context (the roofline's decode step) and at batches 16 and 64.
3. Sampling a batch of 64 rows (`kernels.sampling`): sorting the whole vocabulary
   for every random row (`reference_sample`) against `sample` (no sort for an
   unfiltered row, a window of the best for a filtered one), for the bench
   model's vocabulary and Qwen2.5's, with a temperature alone (the default
   request), top_k 50, top_p 0.9, top_k 20 with top_p 0.8 (Qwen2.5 Instruct's
   defaults) and min_p 0.05 alone (over peaked logits, as a trained model's are).
4. The block tables of a static decode step, host side, 64 sequences of 8, 64 and
   256 blocks in steady decoding: every table converted afresh
   (`padded_int64_rows`) against the rows kept from step to step
   (`actors.block_table_rows`).

Each row times the two implementations alternately (A/B, B/A), median of repeats,
with achieved GB/s (bytes a step must read) and GFLOP/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import report
from benchmarks.arguments import names, non_negative_int, positive_int, positive_ints

HIDDEN, INTERMEDIATE, KV_HEADS, HEADS, HEAD_DIM, LAYERS, VOCAB = 768, 2304, 4, 12, 64, 12, 8192


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=non_negative_int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--rows", type=positive_ints, default="1,2,4,8,16,32,64,128,256",
                        help="input rows M for the linear layers")
    parser.add_argument("--repeats", type=positive_int, default=9)
    parser.add_argument("--sections", type=names("linear", "attention", "sampling", "block_tables", "none"),
                        default="linear,attention,sampling,block_tables", help="which tables to run (none: no table)")


def alternate(first, second, repeats: int) -> tuple[float, float]:
    """Median seconds of each, run alternately after a warm-up of each."""
    first(), second()
    times = ([], [])
    for r in range(repeats):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for which in order:
            fn = (first, second)[which]
            started = time.perf_counter()
            fn()
            times[which].append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])


def linear_rows(args, cpu_linear) -> list[dict]:
    import torch

    torch.manual_seed(0)
    shapes = [(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
              (HIDDEN, INTERMEDIATE)]
    weights = [torch.randn(n, k) for _ in range(LAYERS) for n, k in shapes] + [torch.randn(VOCAB, HIDDEN)]
    weight_bytes = sum(w.numel() * 4 for w in weights)
    flops_per_row = sum(2 * w.numel() for w in weights)
    module = cpu_linear.load()
    results = []
    for m in args.rows:
        inputs = {k: torch.randn(m, k) for k in (HIDDEN, INTERMEDIATE)}

        def torch_step():
            for w in weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w)

        def cpp_step():
            for w in weights:
                module.small_linear(inputs[w.shape[1]], w, None)

        torch_s, cpp_s = alternate(torch_step, cpp_step, args.repeats)
        results.append({"rows": m, "torch_s": torch_s, "cpp_s": cpp_s, "speedup": torch_s / cpp_s,
                        "torch_gb_per_s": weight_bytes / torch_s / 1e9, "cpp_gb_per_s": weight_bytes / cpp_s / 1e9,
                        "torch_gflop_per_s": m * flops_per_row / torch_s / 1e9,
                        "cpp_gflop_per_s": m * flops_per_row / cpp_s / 1e9})
        print(f"linear M={m}: torch {torch_s * 1e3:.1f} ms, C++ {cpp_s * 1e3:.1f} ms", flush=True)
    return results


def attention_rows(args, cpu_attention) -> list[dict]:
    import torch

    from kernels.attention import decode_attention

    torch.manual_seed(1)
    block_size, results = 16, []
    for batch, context in ((1, 2064), (16, 192), (64, 300)):
        blocks_each = -(-context // block_size)
        cache = torch.randn(batch * blocks_each + 8, LAYERS, 2, block_size, KV_HEADS, HEAD_DIM)
        tables = torch.randperm(cache.shape[0])[: batch * blocks_each].view(batch, blocks_each)
        lens = torch.full((batch,), context)
        q = torch.randn(batch, HEADS, HEAD_DIM)

        def run(fn):
            return lambda: [fn(q, cache[:, layer], tables, lens, HEAD_DIM**-0.5) for layer in range(LAYERS)]

        torch_s, cpp_s = alternate(run(decode_attention), run(cpu_attention.paged_decode_attention), args.repeats)
        kv_bytes = LAYERS * 2 * batch * context * KV_HEADS * HEAD_DIM * 4
        results.append({"batch": batch, "context": context, "torch_s": torch_s, "cpp_s": cpp_s,
                        "speedup": torch_s / cpp_s, "torch_gb_per_s": kv_bytes / torch_s / 1e9,
                        "cpp_gb_per_s": kv_bytes / cpp_s / 1e9})
        print(f"attention batch {batch} x {context}: torch {torch_s * 1e3:.1f} ms, C++ {cpp_s * 1e3:.1f} ms", flush=True)
    return results


SAMPLING_SETTINGS = [  # name, top_k, top_p, min_p
    ("temperature 1", 0, 1.0, 0.0), ("top_k 50", 50, 1.0, 0.0), ("top_p 0.9", 0, 0.9, 0.0),
    ("top_k 20 + top_p 0.8", 20, 0.8, 0.0), ("min_p 0.05", 0, 1.0, 0.05),
]


def sampling_rows(args) -> list[dict]:
    import torch

    from kernels.sampling import reference_sample, sample, uniform_draws

    torch.manual_seed(2)
    batch, results = 64, []
    for vocab in (VOCAB, 151_936):
        logits = torch.randn(batch, vocab) * 4  # peaked: a few tokens hold most of the mass
        for name, top_k, top_p, min_p in SAMPLING_SETTINGS:
            columns = ([1.0] * batch, [top_k] * batch, [top_p] * batch)
            draws = uniform_draws(range(batch), [0] * batch)

            def run(fn):
                return lambda: fn(logits, *columns, draws, [min_p] * batch)

            sort_s, ours_s = alternate(run(reference_sample), run(sample), max(3, args.repeats // 3))
            results.append({"vocab": vocab, "setting": name, "full_sort_s": sort_s, "sample_s": ours_s,
                            "speedup": sort_s / ours_s})
            print(f"sampling {name}, vocab {vocab}: full sort {sort_s * 1e3:.1f} ms, sample {ours_s * 1e3:.1f} ms",
                  flush=True)
    return results


def block_table_rows(args) -> list[dict]:
    import random

    from actors.block_table_rows import BlockTableRows
    from actors.host_tensors import padded_int64_rows

    rng, batch, results = random.Random(3), 64, []
    for blocks in (8, 64, 256):
        tables = [[rng.randrange(100_000) for _ in range(blocks)] for _ in range(batch)]
        used = [blocks] * batch
        kept = BlockTableRows(batch, blocks, pad=0)
        kept.update(tables, used, batch)

        def rebuild():
            for _ in range(100):
                padded_int64_rows([t[:blocks] for t in tables], pad=0)

        def keep():
            for _ in range(100):
                kept.update(tables, used, batch)

        rebuilt_s, kept_s = (t / 100 for t in alternate(rebuild, keep, args.repeats))
        results.append({"blocks": blocks, "rebuilt_s": rebuilt_s, "kept_s": kept_s, "speedup": rebuilt_s / kept_s})
        print(f"block tables, {batch} x {blocks} blocks: rebuilt {rebuilt_s * 1e3:.3f} ms, kept {kept_s * 1e3:.3f} ms",
              flush=True)
    return results


def main(args: argparse.Namespace) -> None:
    import torch

    from kernels import cpu_attention, cpu_linear

    if args.threads:
        torch.set_num_threads(args.threads)
    sections = set(args.sections)
    results: dict = {"threads": torch.get_num_threads(), "max_rows": cpu_linear.MAX_ROWS,
                     "machine": report.machine_info()}
    headline = []
    if sections & {"linear", "attention"} and (cpu_linear.load() is None or cpu_attention.load() is None):
        raise SystemExit(f"the C++ kernels do not build here: {cpu_linear.build_error() or cpu_attention.build_error()}")
    if "linear" in sections:
        linear = results["linear"] = linear_rows(args, cpu_linear)
        report.print_table(
            f"Linear layers of one bench-model decode step ({torch.get_num_threads()} threads; "
            f"kernels.cpu_linear.MAX_ROWS = {cpu_linear.MAX_ROWS})",
            ["rows M", "torch ms", "C++ ms", "C++ speed-up", "torch GB/s", "C++ GB/s", "torch GFLOP/s",
             "C++ GFLOP/s"],
            [[r["rows"], r["torch_s"] * 1e3, r["cpp_s"] * 1e3, r["speedup"], r["torch_gb_per_s"], r["cpp_gb_per_s"],
              r["torch_gflop_per_s"], r["cpp_gflop_per_s"]] for r in linear])
        fewest = min(linear, key=lambda r: r["rows"])
        faster_up_to = max((r["rows"] for r in linear if r["speedup"] > 1.0), default=0)
        headline.append(f"C++ linear {fewest['speedup']:.2f}x torch at M={fewest['rows']}, faster up to "
                        f"M={faster_up_to}")
    if "attention" in sections:
        attention = results["attention"] = attention_rows(args, cpu_attention)
        report.print_table(
            "Decode attention, 12 layers, paged cache (block 16)",
            ["batch", "context", "torch ms", "C++ ms", "C++ speed-up", "torch GB/s", "C++ GB/s"],
            [[r["batch"], r["context"], r["torch_s"] * 1e3, r["cpp_s"] * 1e3, r["speedup"], r["torch_gb_per_s"],
              r["cpp_gb_per_s"]] for r in attention])
        headline.append(f"decode attention {attention[0]['speedup']:.1f}x at batch 1")
    if "sampling" in sections:
        sampling = results["sampling"] = sampling_rows(args)
        report.print_table(
            "Sampling 64 rows: a full sort a row against sample()",
            ["vocab", "setting", "full sort ms", "sample ms", "speed-up"],
            [[r["vocab"], r["setting"], r["full_sort_s"] * 1e3, r["sample_s"] * 1e3, r["speedup"]] for r in sampling])
        default = next(r for r in sampling if r["vocab"] != VOCAB and r["setting"] == "temperature 1")
        headline.append(f"sampling {default['speedup']:.1f}x a full sort at a 152k vocabulary")
    if "block_tables" in sections:
        tables = results["block_tables"] = block_table_rows(args)
        report.print_table(
            "Block tables of a static decode step, host side, 64 sequences",
            ["blocks a sequence", "rebuilt ms", "kept ms", "speed-up"],
            [[r["blocks"], r["rebuilt_s"] * 1e3, r["kept_s"] * 1e3, r["speedup"]] for r in tables])
        headline.append(f"block tables kept {tables[-1]['speedup']:.0f}x faster at {tables[-1]['blocks']} blocks")
    goal = (f"faster than torch up to MAX_ROWS={cpu_linear.MAX_ROWS}" if "linear" in sections
            else "faster than a full sort, the same tokens for filtered rows")
    report.finish("kernels", args.out, results, "; ".join(headline), goal)
