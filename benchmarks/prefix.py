"""Prefix reuse through the KV store: multi-turn conversations, with and without it.

Conversations: `--conversations` of `--turns` turns. Each turn's prompt is the whole
conversation so far (the previous prompt, the answer, a new user message), so about
90% of it is shared with the previous turn. Turns go round-robin across
conversations, one request at a time (TTFT is prefill plus transfer, not queueing).

Two P/D pairs run the same conversations side by side, turn by turn (one system,
then the other): both with the device prefix cache, and device pools
(`--device-blocks`) too small to keep every conversation resident between its turns
(the working set of many users exceeds device memory: the case a KV store is for).
- `no store`: what the device cache lost is recomputed and sent again.
- `store`: host memory behind both workers: P loads the stored prefix and computes
  the delta, D loads it too, so P sends only the delta's blocks.
Reported: TTFT median per system, KV bytes moved P -> D, and their ratios.

Hit latency: one prompt of `--hit-tokens` whose blocks are in host memory, on local
disk, or nowhere (recompute), each TTFT measured after the device cache is reset.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time

from benchmarks import report
from benchmarks.arguments import int_between, positive_int, preset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", type=preset, default="bench", help="built-in model preset (bench or tiny)")
    parser.add_argument("--conversations", type=positive_int, default=6)
    parser.add_argument("--turns", type=int_between(2), default=8,  # (its figures are of turns 2 on)
                        help="turns per conversation, at least 2")
    parser.add_argument("--first-tokens", type=positive_int, default=512,
                        help="tokens of each conversation's first prompt")
    parser.add_argument("--user-tokens", type=positive_int, default=32, help="new user tokens per later turn")
    parser.add_argument("--answer-tokens", type=positive_int, default=16, help="tokens generated per turn")
    parser.add_argument("--device-blocks", type=positive_int, default=128, help="KV blocks per worker's device pool")
    parser.add_argument("--hit-tokens", type=positive_int, default=1024,
                        help="prompt length for the hit-latency figures")
    parser.add_argument("--repeats", type=positive_int, default=3, help="hit-latency repeats")
    parser.add_argument("--quick", action="store_true", help="tiny model, few turns: a smoke run")


def _call(prefill, decode, request):
    """TTFT at the client, and P's result (bytes sent, tokens computed)."""
    from cluster.pd_request import DisaggregatedCall

    async def run():
        started = time.perf_counter()
        call = DisaggregatedCall(prefill, decode, request, "gloo")
        ttft, output = None, []
        async for event in call.events():
            if event.error:
                raise RuntimeError(event.error)
            if ttft is None and event.token_ids:
                ttft = time.perf_counter() - started
            output += event.token_ids
        return ttft, call.prefill_result, output

    return asyncio.run(run())


def _pair(name: str, model_dir, config, store_settings):
    import ray

    from actors.worker_base import WorkerOptions
    from cluster.workers import start_worker

    options = WorkerOptions(kv_store=store_settings)
    pair = (start_worker("prefill", f"{name}-p", model_dir, config, options),
            start_worker("decode", f"{name}-d", model_dir, config, options))
    ray.get([w.ping.remote() for w in pair])
    return pair


def _conversations(args, vocab: int, systems: dict) -> tuple[list, dict]:
    from actors.messages import GenerateRequest
    from actors.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=args.answer_tokens, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.first_tokens)] for _ in range(args.conversations)]
    samples = {name: {"ttft_s": [], "bytes_sent": [], "computed_tokens": [], "prompt_tokens": []} for name in systems}
    for turn in range(args.turns):
        user = [[rng.randrange(3, vocab) for _ in range(args.user_tokens)] for _ in prompts]
        answers = {}
        for name, (p, d) in systems.items():
            for c, prompt in enumerate(prompts):
                full = prompt + user[c] if turn else prompt
                ttft, result, output = _call(p, d, GenerateRequest(f"{name}-c{c}-t{turn}", full, params))
                answers.setdefault(c, output)
                if answers[c] != output:
                    raise AssertionError(f"conversation {c} turn {turn}: {name} answered differently")
                s = samples[name]
                s["ttft_s"].append(ttft)
                s["bytes_sent"].append(result.num_bytes_sent)
                s["computed_tokens"].append(result.num_computed_tokens)
                s["prompt_tokens"].append(len(full))
        prompts = [(p + user[c] if turn else p) + answers[c] for c, p in enumerate(prompts)]
        print(f"turn {turn + 1}/{args.turns}: " + ", ".join(
            f"{n} TTFT median {statistics.median(s['ttft_s'][-args.conversations:]):.3f}s"
            for n, s in samples.items()), flush=True)
    return samples


def _hit_latency(args, vocab: int, systems: dict) -> dict:
    """TTFT of one prompt whose blocks are in each system's store (or nowhere)."""
    import ray

    from actors.messages import GenerateRequest
    from actors.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    rng = random.Random(1)
    times: dict[str, list[float]] = {name: [] for name in systems}
    for repeat in range(args.repeats):
        prompt = [rng.randrange(3, vocab) for _ in range(args.hit_tokens + 1)]
        for name, (p, d) in systems.items():
            _call(p, d, GenerateRequest(f"hit-warm-{name}-{repeat}", prompt, params))  # computes, writes through
            ray.get([w.kv_store_stats.remote() for w in (p, d)])  # writes done
            ray.get([w.reset_prefix_cache.remote() for w in (p, d)])
            ttft, result, _ = _call(p, d, GenerateRequest(f"hit-{name}-{repeat}", prompt, params))
            times[name].append(ttft)
        print(f"hit latency {repeat + 1}/{args.repeats}: " + ", ".join(f"{n} {t[-1]:.3f}s" for n, t in times.items()),
              flush=True)
    return times


def main(args: argparse.Namespace) -> None:
    import ray

    from actors.config import EngineConfig, ModelConfig
    from actors.kv_store import KVStoreSettings
    from actors.model_builder import ensure_checkpoint

    if args.quick:
        args.preset, args.conversations, args.turns, args.repeats = "tiny", 3, 3, 1
        args.first_tokens, args.device_blocks, args.hit_tokens = 256, 48, 256
    model_dir = ensure_checkpoint(args.preset, "qwen2")
    vocab = ModelConfig.from_hf(model_dir).vocab_size
    config = EngineConfig(block_size=16, prefill_chunk_size=256, max_num_batched_tokens=256,
                          num_kv_blocks=args.device_blocks)
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    scratch = tempfile.mkdtemp(prefix="tandem-bench-prefix-")
    host = KVStoreSettings(host_bytes=4 << 30)
    print(f"{args.conversations} conversations x {args.turns} turns, {args.preset} model, "
          f"{args.device_blocks} device blocks per worker ...", flush=True)
    systems = {"no store": _pair("nostore", model_dir, config, None), "store": _pair("store", model_dir, config, host)}
    samples = _conversations(args, vocab, systems)

    print(f"hit latency, {args.hit_tokens}-token prompt ...", flush=True)
    hit_config = EngineConfig(block_size=16, prefill_chunk_size=256, max_num_batched_tokens=256,
                              num_kv_blocks=args.hit_tokens // 16 + 16)
    for pair in systems.values():
        for worker in pair:
            ray.kill(worker)
    hit_systems = {
        "recompute": _pair("hit-none", model_dir, hit_config, None),
        "host memory hit": _pair("hit-host", model_dir, hit_config, KVStoreSettings(host_bytes=4 << 30)),
        "local disk hit": _pair("hit-disk", model_dir, hit_config, KVStoreSettings(host_bytes=0, disk_path=scratch)),
    }
    hits = _hit_latency(args, vocab, hit_systems)
    for pair in hit_systems.values():
        for worker in pair:
            ray.kill(worker)

    rows, ttft_ratio, bytes_ratio, later_bytes_ratio = summarize(samples, args.conversations)
    report.print_table(
        f"Multi-turn: {args.conversations} conversations x {args.turns} turns (TTFT median over turns 2+)",
        ["system", "TTFT s", "KV MB sent P -> D", "of it turns 2+", "computed / prompt tokens"], rows)
    recompute = statistics.median(hits["recompute"])
    report.print_table(
        f"TTFT of a {args.hit_tokens}-token prompt by where its prefix is (median of {args.repeats})",
        ["source", "TTFT s", "vs recompute"],
        [[n, statistics.median(t), statistics.median(t) / recompute] for n, t in hits.items()])
    settings = {k: v for k, v in vars(args).items() if not callable(v)}
    payload = {"settings": settings, "conversations": samples, "hit_latency_s": hits, "ttft_ratio": ttft_ratio,
               "bytes_ratio": bytes_ratio, "later_turns_bytes_ratio": later_bytes_ratio,
               "machine": report.machine_info()}
    report.finish("prefix", args.out, payload,
                  f"TTFT no store/store {ttft_ratio:.2f}x, KV bytes store/no store {bytes_ratio:.2f} "
                  f"(turns 2+: {later_bytes_ratio:.2f})", ">= 3x, <= 0.2")


def summarize(samples: dict, num_conversations: int) -> tuple[list, float, float, float]:
    """Table rows (no store first, store second) and the ratios: TTFT median over
    turns 2+ (where reuse is possible), KV bytes over the whole run and over turns 2+
    (turn 1 has nothing to reuse, so the whole-run ratio depends on the turn count)."""
    later = slice(num_conversations, None)
    rows = []
    for name, s in samples.items():
        rows.append([name, statistics.median(s["ttft_s"][later]), sum(s["bytes_sent"]) / 1e6,
                     sum(s["bytes_sent"][later]) / 1e6, sum(s["computed_tokens"]) / sum(s["prompt_tokens"])])
    (_, none_ttft, none_mb, none_later_mb, _), (_, store_ttft, store_mb, store_later_mb, _) = rows
    return rows, none_ttft / store_ttft, store_mb / none_mb, store_later_mb / none_later_mb
