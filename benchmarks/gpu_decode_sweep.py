"""Launch shapes of the Triton paged decode attention, timed side by side on CUDA
(issue: GPU path): what `num_splits`, the tile and the warps should be.

    python -m benchmarks.gpu_decode_sweep --out-dir "$OUT"     # under a minute on the H200

For qwen2.5-0.5b's attention (14 heads, 2 KV heads, head_dim 64, blocks of 16), in
bfloat16, on a layer's view of a 4-layer cache laid out as the engine lays it out
(a block's layers side by side, so one layer's blocks are strided), with each
sequence's blocks scattered over the cache: every (splits, tile, warps) of the grid
below at batch 64 x 160, 1056 and 4096 tokens of context (near the GPU check's
decode MBU contexts) and 8 x 4096, timed by CUDA-graph replay (`cuda_time_ms`), each
checked against the torch reference (max abs error). Results, fastest first per
shape, go to `<out>/gpu_decode_sweep.json`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

SHAPES = ((64, 160), (64, 1056), (64, 4096), (8, 4096))  # batch, context
SPLITS = {64: (1, 2, 4, 8), 8: (4, 8, 16, 32)}
TILES = (64, 128)
WARPS = (4, 8)


def main(args: argparse.Namespace) -> dict:
    import torch

    from benchmarks.gpu_check_kernels import cuda_time_ms
    from kernels import triton_attention
    from kernels.attention import decode_attention

    heads, kv_heads, head_dim, block_size, layers = 14, 2, 64, 16, 4
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = {}
    for batch, context in SHAPES:
        per_seq = -(-context // block_size)
        num_blocks = batch * per_seq + 1
        cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, device="cuda",
                            dtype=torch.bfloat16, generator=generator)
        layer = cache[:, 1]
        shuffled = torch.randperm(num_blocks - 1, device="cuda", generator=generator)
        tables = shuffled[: batch * per_seq].view(batch, per_seq)
        q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        want = decode_attention(q.float(), layer.float(), tables, lens, 0.125)
        kv_bytes = batch * context * kv_heads * head_dim * 2 * 2
        rows = []
        for splits, tile, warps in itertools.product(SPLITS[batch], TILES, WARPS):
            def call(splits=splits, tile=tile, warps=warps):
                return triton_attention.paged_decode_attention(q, layer, tables, lens, 0.125, splits=splits, tile=tile,
                                                               num_warps=warps)
            error = (call().float() - want).abs().max().item()
            ms = cuda_time_ms(call)
            rows.append({"splits": splits, "tile": tile, "warps": warps, "us": round(ms * 1e3, 2),
                         "kv_gb_s": round(kv_bytes / ms / 1e6, 1), "max_abs_err": error})
        rows.sort(key=lambda row: row["us"])
        default = triton_attention.num_splits(batch, kv_heads)
        results[f"batch{batch}_ctx{context}"] = {"default_splits": default, "rows": rows}
        print(f"batch {batch} x {context}: best {rows[0]}, default splits {default}", flush=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_decode_sweep.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "gpu-results"))
    main(parser.parse_args())
