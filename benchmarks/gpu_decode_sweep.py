"""Launch shapes of the Triton paged decode attention, timed side by side on CUDA
(issue: GPU path): what `num_splits`, `split_keys` and the pipelining should be.

    python -m benchmarks.gpu_decode_sweep --out-dir "$OUT"     # under a minute on the H200
    python -m benchmarks.gpu_decode_sweep --device cpu --shapes 64x24,8x200   # the plumbing, CPU

For qwen2.5-0.5b's attention (14 heads, 2 KV heads, head_dim 64, blocks of 16), in
bfloat16, on a layer's view of a 4-layer cache laid out as the engine lays it out
(a block's layers side by side, so one layer's blocks are strided), with each
sequence's blocks scattered over the cache: every (splits allowed, fewest keys a
split, Triton's num_stages) of the grid below at batch 64 x 160, 1056 and 4096
tokens of context (near the GPU check's decode MBU contexts) and 8 x 4096, timed by
CUDA-graph replay (`cuda_time_ms`), each checked against the torch reference (max
abs error). Results, fastest first per shape, go to `<out>/gpu_decode_sweep.json`,
with the launch the dispatcher picks (`dispatched`) and how far it is from the
best, and `ok`: every launch within `TOLERANCE` of the reference (the exit status
says it too; the errors were recorded and never judged). The tile (128 keys) and
the warps (4) are the kernel's defaults: the third H200 call's sweep found them
best at every shape (docs/benchmarks.md). On CPU
(`--device cpu`) the kernel runs under Triton's interpreter, in float16 (its bf16
is wrong there: errors of 8e8 under Triton 3.9's interpreter, 0.0006 in float16),
with Triton's default pipelining only (the interpreter has none), and the times
are wall times of one call: a check of the plumbing, not a measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

SHAPES = ((64, 160), (64, 1056), (64, 4096), (8, 4096))  # batch, context
# (splits allowed, fewest keys a split) per batch; one split reads every key
LAUNCHES = {64: ((1, 256), (4, 128), (4, 256), (4, 1024), (8, 256)), 8: ((8, 128), (16, 128), (32, 128))}
STAGES = (None, 2, 4)  # None: Triton's default
TOLERANCE = 3e-2  # max abs error of a half-precision launch (outputs about 1 in size; the kernel check's)


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        shapes = tuple(tuple(int(n) for n in pair.split("x")) for pair in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch x context pairs, as 64x160,8x4096; got {text!r}") from None
    if any(len(shape) != 2 or shape[0] not in LAUNCHES or shape[1] < 1 for shape in shapes):
        raise argparse.ArgumentTypeError(f"batches {sorted(LAUNCHES)} and contexts of at least 1; got {text!r}")
    return shapes


def main(args: argparse.Namespace) -> dict:
    device = args.device
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # (before Triton is first imported)
    import torch

    from benchmarks.gpu_timing import cuda_time_ms, timed
    from kernels import triton_attention
    from kernels.attention import decode_attention

    def checked(call, want) -> tuple[float, float]:
        """The call's max abs error and its time, ms: on CUDA timed apart (graph
        replays); on CPU, where the interpreter's time means nothing but the
        plumbing is checked, the checking run's own (a second run doubled the
        test's 38 s)."""
        out = []
        ms = timed(torch, device, lambda: out.append(call())) * 1e3
        error = (out[0].float() - want).abs().max().item()
        return error, (cuda_time_ms(call) if device == "cuda" else ms)
    dtype, stage_counts = (torch.bfloat16, STAGES) if device == "cuda" else (torch.float16, (None,))
    heads, kv_heads, head_dim, block_size, layers = 14, 2, 64, 16, 4
    generator = torch.Generator(device=device).manual_seed(0)
    results = {}
    for batch, context in args.shapes:
        per_seq = -(-context // block_size)
        num_blocks = batch * per_seq + 1
        cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, device=device,
                            dtype=dtype, generator=generator)
        layer = cache[:, 1]
        shuffled = torch.randperm(num_blocks - 1, device=device, generator=generator)
        tables = shuffled[: batch * per_seq].view(batch, per_seq)
        q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype, generator=generator)
        lens = torch.full((batch,), context, device=device, dtype=torch.int32)
        want = decode_attention(q.float(), layer.float(), tables, lens, 0.125)
        kv_bytes = batch * context * kv_heads * head_dim * 2 * 2
        rows = []
        for (splits, keys), stages in itertools.product(LAUNCHES[batch], stage_counts):
            def call(splits=splits, keys=keys, stages=stages):
                return triton_attention.paged_decode_attention(q, layer, tables, lens, 0.125, splits=splits,
                                                               min_split_keys=keys, num_stages=stages)
            error, ms = checked(call, want)
            rows.append({"splits": splits, "split_keys": keys, "stages": stages, "us": round(ms * 1e3, 2),
                         "kv_gb_s": round(kv_bytes / ms / 1e6, 1), "max_abs_err": error})
        rows.sort(key=lambda row: row["us"])
        dispatched = {"splits": triton_attention.num_splits(batch, kv_heads, device),
                      "split_keys": triton_attention.split_keys(batch, kv_heads, device)}
        error, ms = checked(lambda: triton_attention.paged_decode_attention(q, layer, tables, lens, 0.125), want)
        dispatched["us"], dispatched["max_abs_err"] = round(ms * 1e3, 2), error
        dispatched["over_best"] = round(dispatched["us"] / rows[0]["us"], 3)
        results[f"batch{batch}_ctx{context}"] = {"dispatched": dispatched, "rows": rows}
        print(f"batch {batch} x {context}: best {rows[0]}, dispatched {dispatched}", flush=True)
    results["ok"] = all(row["max_abs_err"] < TOLERANCE for shape in results.values()
                        for row in [*shape["rows"], shape["dispatched"]])
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_decode_sweep.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "gpu-results"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shapes", type=_shapes, default=SHAPES,
                        help="batch x context pairs, as 64x160,8x4096 (batches 64 and 8: LAUNCHES' keys)")
    raise SystemExit(0 if main(parser.parse_args())["ok"] else 1)
