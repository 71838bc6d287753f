"""The GPU check: one run, on one GPU, of everything a GPU must show (issue: GPU path).

    bash benchmarks/gpu_check.sh                 # on a machine with a CUDA GPU
    python -m benchmarks.gpu_check --device cpu  # the same steps on CPU, tiny model: a smoke run

Steps, each recorded in `<out>/gpu_check.json` (a failing step is recorded and
the others still run):
1. `kernels` (`benchmarks/gpu_check_kernels.py`): every Triton kernel (decode and
   prefill attention, KV slot writes, block gather and scatter) against its torch
   reference (max abs error, or bit-exactness for copies) for a few shapes and
   dtypes; on CUDA also each one's time beside torch's (the reference, SDPA alone,
   torch indexing) at serving-sized shapes.
2. `exactness`: greedy token ids of Tandem's engine against transformers'
   `generate`, float32, same device, same prompts; prompts whole, and again in
   chunks of 40 tokens (the paged prefill over a cached prefix, Triton's on CUDA).
3. `roofline`: the device's measured peaks (matmul FLOP/s in the model dtype, copy
   bandwidth), prefill MFU on one `--prefill-tokens` prompt, eagerly (the default)
   and replayed from a CUDA graph (`prefill_graphs`, which must capture), and decode MBU at batch
   `--decode-batch` (step time from two runs that differ only in decode steps),
   and the decode forward's MBU alone (its CUDA graph replayed back to back: what
   the kernels reach without the engine's host time per step), at 128-token
   prompts (the weights are most of the bytes), 1024-token ones
   (`decode_long_context`: the KV cache about as many bytes as the weights, the
   decode attention kernel's share) and, on CUDA, 4096-token ones
   (`decode_4k_context`: the KV cache three times the weights); FLOPs and bytes
   counted as `tandem bench roofline` counts them.
4. `graphs` (`benchmarks/gpu_check_graphs.py`): decode steps three ways: eager
   (`cuda_graphs: false`), replayed from CUDA graphs, and graphs with overlapped
   decode (`overlap_decode`, the step after launched before this one's tokens are
   read): greedy tokens of a mixed batch
   (float32, so all three must agree), seeded sampling with logprobs (graphs with
   and without overlap must draw the same tokens, their logprobs within
   `LOGPROB_TOLERANCE`; so must graphs with speculative decoding, whose drafts are
   decode rows), greedy tokens with prefill graphs against without (one prompt a
   step, so that every prefill step replays one), the decode step time of each
   mode at batch 1 and `--decode-batch`, and (CUDA) the host syncs in overlapped
   decode steps.
   On CPU the padded static step runs without capture (its twin) and overlap
   saves nothing (a CPU step runs while it is launched).
5. `pd`: a prefill and a decode worker as two Ray actors sharing the one device
   (the object_store channel works within one GPU), against the engine alone: the
   same tokens for one request and for one held to a regex (structured output: the
   masks unpacked on the device, P's first token, D's rest), then the decode rate `--decode-batch` requests
   get from the pair through one token feed (`cluster/token_feeds.py`), as
   `tandem bench delivery` measures it (no HTTP), beside the engine alone's.

The JSON's `goals` (also printed last) reads the roofline against the issue's
goals (prefill MFU 0.5, decode MBU 0.7 at batch 64) and says whether prefill
graphs earned their default (`prefill_graphs_by_default`: captured, faster than
eager, and the graphs step's tokens identical with them).

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here
before Triton is imported) and times are not taken; the step plumbing is what the
smoke run checks (`tests/test_gpu_check.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

from benchmarks.arguments import names, positive_int, preset
from benchmarks.gpu_check_graphs import check_graphs
from benchmarks.gpu_timing import decode_step_s, static_decode_step_s, timed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a smoke run, tiny model)")
    parser.add_argument("--preset", type=preset, default=None, help="model preset (default: qwen2.5-0.5b on cuda, tiny on cpu)")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the roofline and P/D steps on cuda")
    parser.add_argument("--prefill-tokens", type=positive_int, default=None,
                        help="the roofline's prompt (default: 4096 on cuda, 1024 on cpu, inside tiny's context)")
    parser.add_argument("--decode-batch", type=positive_int, default=64)
    parser.add_argument("--steps", type=names("kernels", "exactness", "roofline", "graphs", "pd"),
                        default="kernels,exactness,roofline,graphs,pd")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "gpu-results"))


# ---- 2. exactness ----------------------------------------------------------------
def check_exactness(model_dir: Path, device: str, num_prompts: int = 8, new_tokens: int = 32) -> dict:
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from actors.llm import LLM
    from actors.sampling_params import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randint(8, 200))] for _ in range(num_prompts)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm = LLM(model_dir, device=device, dtype="float32", kv_cache_bytes=256 * 2**20)
    ours = [o.token_ids for o in llm.generate(prompts, [params] * num_prompts)]
    del llm
    # Chunks of 40 tokens: every chunk after a prompt's first goes over a cached prefix that ends
    # mid-block, the paged prefill path (Triton's kernel on CUDA), which whole prompts never take
    llm = LLM(model_dir, device=device, dtype="float32", kv_cache_bytes=256 * 2**20, prefill_chunk_size=40)
    chunked = [o.token_ids for o in llm.generate(prompts, [params] * num_prompts)]
    del llm
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    identical = identical_chunked = 0
    for prompt, tokens, chunked_tokens in zip(prompts, ours, chunked):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        identical += out[0, len(prompt):].tolist() == tokens
        identical_chunked += out[0, len(prompt):].tolist() == chunked_tokens
    return {"prompts": num_prompts, "identical": identical, "identical_chunked": identical_chunked,
            "ok": identical == identical_chunked == num_prompts}


# ---- 3. roofline ------------------------------------------------------------------
def check_roofline(model_dir: Path, device: str, dtype: str, prefill_tokens: int, decode_batch: int) -> dict:
    import random

    import torch

    from actors.llm import LLM
    from actors.sampling_params import SamplingParams
    from benchmarks.roofline import model_counts, prefill_flops

    torch_dtype = getattr(torch, dtype)
    before = _peaks(torch, device, torch_dtype)
    llm = LLM(model_dir, device=device, dtype=dtype, kv_cache_bytes=8 * 2**30 if device == "cuda" else 256 * 2**20,
              max_num_batched_tokens=max(prefill_tokens, 2048), prefill_chunk_size=prefill_tokens,
              max_num_seqs=max(decode_batch, 64), enable_prefix_cache=False)
    config = llm.engine.model_config
    rng = random.Random(1)
    vocab = min(config.vocab_size, 8000)
    one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([[rng.randrange(3, vocab) for _ in range(64)]], [one])  # warm-up
    prompt = [rng.randrange(3, vocab) for _ in range(prefill_tokens)]
    prefill_s = min(timed(torch, device, lambda: llm.generate([prompt], [one])) for _ in range(3))
    # The same prefill replayed from a CUDA graph (`prefill_graphs`, off by default;
    # on CPU its uncaptured twin, for the plumbing), then back to eager for decode.
    runner = llm.engine.runner
    runner.prefill_graphs = runner.static_prefill(capture=device == "cuda")
    graphs_captured = runner.prefill_graphs.is_captured
    llm.generate([prompt], [one])  # warm-up
    prefill_graphs_s = min(timed(torch, device, lambda: llm.generate([prompt], [one])) for _ in range(3))
    runner.prefill_graphs = None
    counts = model_counts(llm.engine.runner.model)
    prefill = prefill_flops(config, counts, prefill_tokens)
    element = torch.tensor([], dtype=torch_dtype).element_size()
    decode = [_decode_bytes(torch, llm, device, decode_batch, prompt_len, rng, counts, element)
              for prompt_len in ((128, 1024, 4096) if device == "cuda" else (128, 160))]
    # The peaks again, the engine's run done: the higher of each (a clock still rising at the first reading
    # made it low, and every utilisation figure high)
    peaks = {name: max(value, before[name]) for name, value in _peaks(torch, device, torch_dtype).items()}
    short, long, *longest = (_with_mbus(figures, peaks["bandwidth_bytes_s"]) for figures in decode)
    return {
        "cuda_graphs": llm.engine.runner.decode_graphs is not None,
        "peaks": peaks, "prefill_tokens": prefill_tokens, "prefill_s": prefill_s,
        "prefill_mfu": prefill / prefill_s / peaks["matmul_flops"],
        "prefill_graphs_captured": graphs_captured, "prefill_graphs_s": prefill_graphs_s,
        "prefill_graphs_mfu": prefill / prefill_graphs_s / peaks["matmul_flops"],
        "decode_batch": decode_batch, **short, "decode_long_context": long,
        "decode_4k_context": longest[0] if longest else None,
        "ok": graphs_captured or device != "cuda",
    }


def _decode_bytes(torch, llm, device: str, batch: int, prompt_len: int, rng, counts: dict, element: int,
                  steps: int = 64) -> dict:
    """A decode step's time and the bytes it reads at `batch` prompts of
    `prompt_len` tokens: the engine's step (the 64 steps timed follow those that
    prefill the batch and a few more: `decode_first_tokens`) and the decode
    forward alone. The bytes a step reads are the weights plus the KV cache it
    attends to."""
    from benchmarks.gpu_timing import decode_first_tokens
    from benchmarks.roofline import kv_bytes

    config = llm.engine.model_config
    context = prompt_len + decode_first_tokens(llm, batch, prompt_len, steps) + steps // 2  # the timed steps' middle
    step_s = decode_step_s(torch, llm, device, batch, prompt_len, steps, rng)
    forward_s = static_decode_step_s(torch, llm.engine.runner, device, batch, context)
    kv = kv_bytes(config, batch * context, element)
    return {"decode_prompt_tokens": prompt_len, "decode_context_tokens": context,
            "decode_step_s": step_s, "decode_step_bytes": counts["params_read_per_decode_step"] * element + kv,
            # (no LM head: the logits are computed after the graph)
            "decode_forward_s": forward_s,
            "decode_forward_bytes": (counts["params_read_per_decode_step"] - counts["params_lm_head"]) * element + kv}


def _with_mbus(figures: dict, bandwidth: float) -> dict:
    return {**figures, "decode_mbu": figures["decode_step_bytes"] / figures["decode_step_s"] / bandwidth,
            "decode_forward_mbu": figures["decode_forward_bytes"] / figures["decode_forward_s"] / bandwidth}


def _peaks(torch, device: str, dtype) -> dict:
    """The device's matmul FLOP/s (`dtype`) and memory bandwidth: on CUDA each the
    fastest of CUDA-graph replays timed with CUDA events (`cuda_time_ms`). Timed
    launch by launch on the wall clock, the host's launch and synchronisation
    were in each figure: a 1 GiB copy takes about 520 us on an H200, and 50 us of
    host time put the bandwidth 10% low, every MBU that much high. Bandwidth is
    the higher of a copy's (read and write) and a sum's (reads alone, as a
    decode step's mostly are), as benchmarks/roofline.py takes it."""
    from benchmarks.gpu_timing import cuda_time_ms

    n = 8192 if device == "cuda" else 1024
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    src = torch.empty((2**30 if device == "cuda" else 2**27) // 4, device=device).uniform_()
    dst = torch.empty_like(src)
    if device == "cuda":
        def seconds(fn):
            return cuda_time_ms(fn, best=True) / 1e3
    else:
        def seconds(fn):
            return min(timed(torch, device, fn) for _ in range(5))
    matmul_s, copy_s, sum_s = seconds(lambda: a @ b), seconds(lambda: dst.copy_(src)), seconds(lambda: src.sum())
    num_bytes = src.numel() * src.element_size()
    copy_bytes_s, sum_bytes_s = 2 * num_bytes / copy_s, num_bytes / sum_s
    return {"matmul_flops": 2 * n**3 / matmul_s, "bandwidth_bytes_s": max(copy_bytes_s, sum_bytes_s),
            "copy_bytes_s": copy_bytes_s, "sum_bytes_s": sum_bytes_s}


# ---- 5. P and D on one device -------------------------------------------------------
def check_pd(model_dir: Path, device: str, dtype: str, decode_batch: int) -> dict:
    import asyncio

    try:
        import ray
    except ImportError as exc:  # (a failure, not a skip: the check's P/D step did not run)
        return {"ok": False, "error": f"Ray could not be imported ({exc}): benchmarks/gpu_wheels.sh gathers it and "
                                      "what it needs for an offline machine"}

    from actors.config import EngineConfig
    from actors.llm import LLM
    from actors.messages import GenerateRequest
    from actors.sampling_params import SamplingParams
    from benchmarks.delivery import engine_rate, feed_rate
    from cluster.pd_request import DisaggregatedCall
    from cluster.workers import start_worker

    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    structured = SamplingParams(max_new_tokens=40, temperature=0, regex=r'\{"id": \d{1,3}, "ok": (true|false)\}')
    prompt = list(range(3, 300))
    # Long enough that every request decodes at once through the pair: on the H200,
    # 256 tokens (~1.5 ms a step) ended the first requests before P had sent the last.
    output_tokens = 1024 if device == "cuda" else 256
    kv_cache_bytes = 2 * 2**30 if device == "cuda" else 512 * 2**20  # the batch's whole contexts fit
    config = EngineConfig(device=device, dtype=dtype, kv_cache_bytes=kv_cache_bytes, max_num_seqs=decode_batch)
    llm = LLM(model_dir, device=device, dtype=dtype, kv_cache_bytes=kv_cache_bytes, max_num_seqs=decode_batch)
    expected, expected_structured = llm.generate([prompt, prompt], [params, structured])
    batch = [[3 + (i * 7 + j) % 1000 for j in range(128)] for i in range(decode_batch)]
    engine_rate(llm, batch[:2], output_tokens)  # warm-up
    alone = engine_rate(llm, batch, output_tokens)
    del llm
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=4, num_gpus=1 if device == "cuda" else 0, include_dashboard=False, log_to_driver=False)
    share = 0.5 if device == "cuda" else 0
    try:
        p = start_worker("prefill", "gpu-p", model_dir, config, num_cpus=1, num_gpus=share)
        d = start_worker("decode", "gpu-d", model_dir, config, num_cpus=1, num_gpus=share)
        ray.get([p.ping.remote(), d.ping.remote()], timeout=300)

        async def run(request_id: str, request_params: SamplingParams):
            call = DisaggregatedCall(p, d, GenerateRequest(request_id, prompt, request_params), "object_store")
            tokens = []
            async for event in call.events():
                if event.error:
                    raise RuntimeError(event.error)
                tokens += event.token_ids
            return tokens, call.prefill_result

        tokens, result = asyncio.run(run("gpu-check", params))
        # Structured output on the device (the packed masks unpacked there), P's first token and D's rest:
        structured_tokens, _ = asyncio.run(run("gpu-check-structured", structured))
        rate = asyncio.run(feed_rate(p, d, batch, output_tokens, "object_store"))
        identical = tokens == expected.token_ids and structured_tokens == expected_structured.token_ids
        return {"identical_to_engine": identical, "tokens": len(tokens),
                "structured_text": expected_structured.text, "bytes_sent": result.num_bytes_sent,
                "batch": decode_batch, "output_tokens": output_tokens, "delivered_tokens_per_s": rate,
                "engine_alone_tokens_per_s": alone,
                "delivered_over_engine": rate / alone, "ok": identical}
    finally:
        if started_ray:
            ray.shutdown()


# ---- the goals ---------------------------------------------------------------
GOALS = {"prefill_mfu": 0.5, "decode_mbu": 0.7}  # on an H200, bf16, qwen2.5-0.5b: a 4k prompt, batch 64


def goals(steps: dict) -> dict | None:
    """The roofline step's figures against the issue's goals, and whether prefill
    graphs earned their default (captured, faster, and the graphs step's tokens
    identical with and without them); None without a roofline."""
    roofline, graphs = steps.get("roofline", {}), steps.get("graphs", {})
    if "prefill_mfu" not in roofline:
        return None
    captured = roofline["prefill_graphs_captured"]
    identical = "prompts" in graphs and graphs.get("identical_with_prefill_graphs") == graphs["prompts"]
    faster = captured and roofline["prefill_graphs_mfu"] > roofline["prefill_mfu"]
    # Met by the engine as it serves by default (prefill graphs off), or by prefill graphs that earned
    # their default here (before, the higher of the two counted, whether the graphs gave the same tokens or not)
    met_by = ("eager" if roofline["prefill_mfu"] >= GOALS["prefill_mfu"] else
              "prefill graphs" if faster and identical and roofline["prefill_graphs_mfu"] >= GOALS["prefill_mfu"]
              else None)
    return {
        "prefill_mfu": {"goal": GOALS["prefill_mfu"], "eager": roofline["prefill_mfu"],
                        "graphs": roofline["prefill_graphs_mfu"] if captured else None,
                        "met": met_by is not None, "met_by": met_by},
        "decode_mbu": {"goal": GOALS["decode_mbu"], "engine": roofline["decode_mbu"],
                       "forward": roofline["decode_forward_mbu"],
                       "engine_long_context": roofline["decode_long_context"]["decode_mbu"],
                       "engine_4k_context": (roofline["decode_4k_context"] or {}).get("decode_mbu"),
                       "met": roofline["decode_mbu"] >= GOALS["decode_mbu"]},
        "prefill_graphs_by_default": faster and identical,
    }


# ---- driver ------------------------------------------------------------------------
def _check_kernels(device: str) -> dict:
    from benchmarks.gpu_check_kernels import check_kernels  # imports Triton: after TRITON_INTERPRET is set

    return check_kernels(device)


def main(args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton
    from actors.model_builder import ensure_checkpoint

    preset = args.preset or ("qwen2.5-0.5b" if args.device == "cuda" else "tiny")
    dtype = args.dtype if args.device == "cuda" else "float32"
    prefill_tokens = args.prefill_tokens or (4096 if args.device == "cuda" else 1024)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": args.device, "preset": preset, "dtype": dtype, "steps": {}}
    model_dir = ensure_checkpoint(preset, "qwen2")
    exact_model_dir = ensure_checkpoint("bench" if args.device == "cuda" else "tiny", "qwen2")
    steps = {
        "kernels": lambda: _check_kernels(args.device),
        "exactness": lambda: check_exactness(exact_model_dir, args.device),
        "roofline": lambda: check_roofline(model_dir, args.device, dtype, prefill_tokens, args.decode_batch),
        "graphs": lambda: check_graphs(model_dir, exact_model_dir, args.device, dtype, args.decode_batch),
        "pd": lambda: check_pd(model_dir, args.device, dtype, args.decode_batch),
    }
    for name in args.steps:
        started = time.perf_counter()
        try:
            results["steps"][name] = steps[name]()
        except Exception as exc:  # record it; the other steps still run
            results["steps"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc()[-3000:]}
        results["steps"][name]["seconds"] = time.perf_counter() - started
        step = results["steps"][name]
        verdict = f"skipped: {step['skipped']}" if "skipped" in step else "ok" if step["ok"] else "FAILED"
        print(f"{name}: {verdict} ({step['seconds']:.1f} s)", flush=True)
        results["goals"] = goals(results["steps"])  # (at each step: a run cut short by its time keeps them)
        (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    results["ok"] = all(step["ok"] for step in results["steps"].values())
    (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps({k: v for k, v in results.items() if k != "steps"}), flush=True)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(0 if main(parser.parse_args())["ok"] else 1)
