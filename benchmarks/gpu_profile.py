"""Where a GPU's time goes: the kernels of a prefill and of a decode forward, and the
host's share of an engine decode step (issue: GPU path).

    python -m benchmarks.gpu_profile --device cuda --out-dir "$OUT"
    python -m benchmarks.gpu_profile --device cpu        # the plumbing, tiny model

`benchmarks/gpu_check.py` measures MFU and MBU; this says why they are what they
are, in one run (its three parts took 6 to 8 s on the H200, the model load aside):
- `prefill`: one `--prefill-tokens` prefill (the roofline's engine settings): its
  wall time (three runs), each kernel's device time under torch's profiler, summed
  by name, and cProfile's top functions (where the host's time goes).
- `decode_forward`: the decode forward at `--decode-batch` sequences of 160 and 1056
  tokens of context, its padded static step run eagerly under the profiler (a
  graph's kernels are the same kernels; eagerly each is reported by name), and the
  captured graph replayed back to back (the time the kernels take with no launch
  gaps).
- `engine_decode`: 32 engine decode steps at `--decode-batch` (CUDA graphs and
  overlapped decode, the defaults), after a warm-up: wall time a step, the CUDA
  runtime calls a step makes and their host time (what a sandboxed host pays for
  each), and cProfile's top functions by own time.
- `kernel_floor`: what a forward of many small kernels costs before any of them
  does its work, from the decode forward's own kernel count (`kernels_per_step`,
  counted from `decode_forward`'s profile): that many one-element adds replayed
  from one CUDA graph (the fixed cost a kernel pays inside a graph: launch, ramp,
  tail), and the model's weights read once each by a `sum` a tensor (QKV, output,
  gate-up and down of every layer and the LM head, in the forward's order) against
  the same bytes read by one kernel: the best a kernel-per-op forward's weight
  reads can reach, and so a ceiling on its decode MBU that no kernel's own speed
  lifts. On CPU the same calls run eagerly (the plumbing; times mean nothing).
Results go to `<out>/gpu_profile.json`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.arguments import positive_int
from benchmarks.gpu_timing import static_decode_step_s, timed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default=None, help="default: qwen2.5-0.5b on cuda, tiny on cpu")
    parser.add_argument("--prefill-tokens", type=positive_int, default=None, help="default: 4096 on cuda, 512 on cpu")
    parser.add_argument("--decode-batch", type=positive_int, default=64)
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "gpu-results"))


def kernel_table(prof, rows: int = 15) -> dict:
    """Device time summed by kernel name (microseconds), largest first, and the host
    time of the CUDA runtime calls by name: what the profiler saw."""
    device_us: dict[str, float] = defaultdict(float)
    device_calls: dict[str, int] = defaultdict(int)
    runtime_us: dict[str, float] = defaultdict(float)
    runtime_calls: dict[str, int] = defaultdict(int)
    for event in prof.events():
        kind = str(getattr(event, "device_type", "")).rsplit(".", 1)[-1]
        if kind == "CUDA":
            total = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            device_us[event.name] += total
            device_calls[event.name] += 1
        elif event.name.startswith("cuda") and kind == "CPU":
            runtime_us[event.name] += event.cpu_time_total
            runtime_calls[event.name] += 1
    top = sorted(device_us.items(), key=lambda item: -item[1])[:rows]
    return {
        "device_us_total": sum(device_us.values()),
        "kernels": [{"name": name[:90], "us": round(us, 1), "calls": device_calls[name]} for name, us in top],
        "runtime_calls": {name: {"calls": runtime_calls[name], "host_us": round(us, 1)}
                          for name, us in sorted(runtime_us.items(), key=lambda item: -item[1])},
    }


def _synchronize(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _profiler(torch, device: str):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def profile_prefill(torch, llm, device: str, prefill_tokens: int) -> dict:
    from actors.sampling_params import SamplingParams

    rng = random.Random(1)
    vocab = min(llm.engine.model_config.vocab_size, 8000)
    one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    prompt = [rng.randrange(3, vocab) for _ in range(prefill_tokens)]
    llm.generate([prompt], [one])  # warm-up: the same shapes
    walls = [timed(torch, device, lambda: llm.generate([prompt], [one])) * 1e3 for _ in range(3)]
    with _profiler(torch, device) as prof:
        llm.generate([prompt], [one])
        _synchronize(torch, device)
    return {"tokens": prefill_tokens, "wall_ms": walls, **kernel_table(prof),
            "cprofile": _cprofiled(lambda: (llm.generate([prompt], [one]), _synchronize(torch, device)))}


def _cprofiled(fn, rows: int = 30) -> list[str]:
    """cProfile's top functions by own time, then by cumulative time, over one call."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    lines = []
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(rows)
        lines += [line for line in text.getvalue().splitlines() if line.strip()][: rows + 5]
    return lines


def profile_decode_forward(torch, runner, device: str, batch: int, context_len: int, repeats: int = 20) -> dict:
    """The padded static decode step, eagerly under the profiler, then its graph
    (where there is one) replayed `repeats` times back to back."""
    size = runner.config.block_size
    num_blocks = -(-context_len // size)
    inputs = dict(token_ids=[5] * batch, positions=[context_len - 1] * batch,
                  block_tables=[list(range(i * num_blocks, (i + 1) * num_blocks)) for i in range(batch)])
    eager = runner.static_decode(capture=False)
    eager.run(**inputs)  # warm-up
    _synchronize(torch, device)
    with _profiler(torch, device) as prof:
        eager.run(**inputs)
        _synchronize(torch, device)
    result = {"batch": batch, "context": context_len, "eager_step": kernel_table(prof, rows=25)}
    if runner.decode_graphs is not None:
        result["graph_replay_ms"] = static_decode_step_s(torch, runner, device, batch, context_len, repeats) * 1e3
    return result


def profile_engine_decode(torch, llm, device: str, batch: int, steps: int = 32) -> dict:
    from actors.sampling_params import SamplingParams

    engine = llm.engine
    rng = random.Random(4)
    vocab = min(engine.model_config.vocab_size, 8000)
    params = SamplingParams(max_new_tokens=4 * steps, temperature=0, ignore_eos=True)
    llm.generate([[rng.randrange(3, vocab) for _ in range(128)] for _ in range(batch)], [params] * batch)  # warm-up
    for _ in range(batch):
        engine.add_request([rng.randrange(3, vocab) for _ in range(128)], params)
    while engine.scheduler.waiting or any(r.is_prefill for r in engine.scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()
    wall_ms = timed(torch, device, lambda: [engine.step() for _ in range(steps)]) / steps * 1e3
    with _profiler(torch, device) as prof:
        for _ in range(steps):
            engine.step()
        _synchronize(torch, device)
    lines = _cprofiled(lambda: [engine.step() for _ in range(steps)], rows=25)
    while engine.has_unfinished():
        engine.step()
    table = kernel_table(prof)
    for calls in table["runtime_calls"].values():
        calls["per_step"] = calls["calls"] / steps
    return {"batch": batch, "steps": steps, "wall_ms_per_step": wall_ms, **table, "cprofile": lines}


def _kernels_per_step(decode_forward) -> int:
    """Kernels in the decode forward's eager step (its first profiled context),
    copies left out; 245, the H200 run's count (batch 64), where the profile has
    none (it failed, or ran on CPU)."""
    try:
        kernels = decode_forward[0]["eager_step"]["kernels"]
        return sum(k["calls"] for k in kernels if not k["name"].startswith("Memcpy")) or 245
    except (TypeError, KeyError, IndexError):
        return 245


def kernel_floor(torch, model, device: str, num_kernels: int, repeats: int = 20) -> dict:
    """`num_kernels` empty kernels (one-element adds), then the model's weights
    read once each by a `sum` per tensor against one read of as many bytes, each
    replayed from a CUDA graph (run eagerly on CPU); median device time of
    `repeats` replays."""
    layers = model.model.layers
    weights = [m.weight for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    weights.append(model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight)
    num_bytes = sum(w.numel() * w.element_size() for w in weights)
    one = torch.zeros(1, device=device)
    flat = torch.empty(num_bytes // weights[0].element_size(), dtype=weights[0].dtype, device=device)
    sums = torch.empty(len(weights), dtype=torch.float32, device=device)
    whole = torch.empty(1, dtype=torch.float32, device=device)

    def empty_kernels():
        for _ in range(num_kernels):
            one.add_(1)

    def weight_reads():
        for i, w in enumerate(weights):
            torch.sum(w, dim=(0, 1), dtype=torch.float32, out=sums[i])

    def one_read():
        torch.sum(flat, dim=0, dtype=torch.float32, out=whole[0])

    with torch.inference_mode():  # (the weights are parameters)
        times_s = {name: _replayed_s(torch, fn, device, repeats) for name, fn in
                   (("empty", empty_kernels), ("weights", weight_reads), ("one_read", one_read))}
    return {"kernels": num_kernels, "empty_kernel_us": times_s["empty"] / num_kernels * 1e6,
            "weight_tensors": len(weights), "weight_bytes": num_bytes,
            "weight_reads_us": times_s["weights"] * 1e6, "one_read_us": times_s["one_read"] * 1e6,
            "weight_reads_over_one_read": times_s["weights"] / times_s["one_read"]}


def _replayed_s(torch, fn, device: str, repeats: int) -> float:
    """Median time of `fn`: replayed from a CUDA graph on CUDA, called on CPU."""
    fn()  # warm-up (library initialisation)
    run = fn
    if device == "cuda":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    samples = sorted(timed(torch, device, run) for _ in range(repeats))
    return samples[len(samples) // 2]


def main(args: argparse.Namespace) -> dict:
    import torch

    from actors.llm import LLM
    from actors.model_builder import ensure_checkpoint

    preset = args.preset or ("qwen2.5-0.5b" if args.device == "cuda" else "tiny")
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    prefill_tokens = args.prefill_tokens or (4096 if args.device == "cuda" else 512)
    model_dir = ensure_checkpoint(preset, "qwen2")
    llm = LLM(model_dir, device=args.device, dtype=dtype,
              kv_cache_bytes=8 * 2**30 if args.device == "cuda" else 256 * 2**20,
              max_num_batched_tokens=max(prefill_tokens, 2048), prefill_chunk_size=prefill_tokens,
              max_num_seqs=max(args.decode_batch, 64), enable_prefix_cache=False)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": args.device, "preset": preset, "dtype": dtype}
    steps = {
        "prefill": lambda: profile_prefill(torch, llm, args.device, prefill_tokens),
        "decode_forward": lambda: [profile_decode_forward(torch, llm.engine.runner, args.device, args.decode_batch, n)
                                   for n in (160, 1056)],
        "engine_decode": lambda: profile_engine_decode(torch, llm, args.device, args.decode_batch),
        "kernel_floor": lambda: kernel_floor(torch, llm.engine.runner.model, args.device,
                                             _kernels_per_step(results.get("decode_forward"))),
    }
    for name, step in steps.items():
        started = time.perf_counter()
        try:
            results[name] = step()
        except Exception as exc:  # record it; the other parts still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {time.perf_counter() - started:.1f} s", flush=True)
        (out_dir / "gpu_profile.json").write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    main(parser.parse_args())
