"""KV transfer between P and D: overlap of chunked prefill with chunk-wise transfer,
and channel bandwidth (gloo, object_store), side by side in one run.

Overlap: one request whose prompt is `--chunks` prefill chunks, run A/B/C in turn:
colocated (one engine), disaggregated pipelined (each chunk's blocks sent while the
next computes) and disaggregated serial (all KV sent after the last chunk). TTFT is
measured at the client, from submission to the first token event. "Exposed" is the
transfer time left after P finished its last chunk: the last chunk's arrival at D
minus P's first-token time.

Bandwidth: the same blocks sent P -> D through each channel, in transfer-sized
chunks (as a request's transfer does) and as one raw send of the same total size,
both through D's real receive path.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from benchmarks import report
from benchmarks.arguments import arch, positive_int, preset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", type=preset, default="bench", help="built-in model preset (bench or tiny)")
    parser.add_argument("--arch", type=arch, default="qwen2")
    parser.add_argument("--chunk-tokens", type=positive_int, default=256, help="prefill chunk size")
    parser.add_argument("--chunks", type=positive_int, default=8, help="prompt length in chunks")
    parser.add_argument("--repeats", type=positive_int, default=3, help="A/B/C rounds")
    parser.add_argument("--bandwidth-blocks", type=positive_int, default=128, help="blocks moved per bandwidth run")
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round: a smoke run")


async def _first_token_s(events, started: float) -> float:
    first = None
    async for event in events:
        if first is None and event.token_ids:
            first = time.perf_counter() - started
    return first


def _colocated_ttft(worker, request) -> float:
    from cluster.token_feeds import TokenFeeds, colocated_events

    async def run():
        started = time.perf_counter()
        feeds = TokenFeeds()  # subscribing is timed, as a disaggregated call's is
        try:
            return await _first_token_s(colocated_events(feeds, worker, request), started)
        finally:
            await feeds.close()

    return asyncio.run(run())


def _disaggregated_ttft(prefill, decode, request):
    from cluster.pd_request import DisaggregatedCall

    async def run():
        started = time.perf_counter()
        call = DisaggregatedCall(prefill, decode, request, "gloo")
        ttft = await _first_token_s(call.events(), started)
        return ttft, call.prefill_result

    return asyncio.run(run())


def _overlap(args, model_dir, config) -> tuple[list, dict]:
    import ray

    from actors.messages import GenerateRequest
    from actors.sampling_params import SamplingParams
    from actors.worker_base import WorkerOptions
    from cluster.workers import start_worker

    colocated = start_worker("colocated", "bench-c", model_dir, config)
    decode = start_worker("decode", "bench-d", model_dir, config)
    pipelined = start_worker("prefill", "bench-p-pipelined", model_dir, config)
    serial = start_worker("prefill", "bench-p-serial", model_dir, config, WorkerOptions(pipelined_transfer=False))
    ray.get([w.ping.remote() for w in (colocated, decode, pipelined, serial)])
    prompt_len = args.chunk_tokens * args.chunks
    params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    samples: dict[str, list] = {"colocated": [], "pipelined": [], "serial": []}
    results: dict[str, list] = {"pipelined": [], "serial": []}
    warm = GenerateRequest("warm", [rng.randrange(1000) for _ in range(64)], params)
    _colocated_ttft(colocated, warm)
    _disaggregated_ttft(pipelined, decode, GenerateRequest("warm-p", warm.prompt_token_ids, params))
    _disaggregated_ttft(serial, decode, GenerateRequest("warm-s", warm.prompt_token_ids, params))
    for round_index in range(args.repeats):
        # A fresh prompt per round and system: no prefix-cache hits anywhere.
        def fresh(tag):
            return GenerateRequest(f"{tag}-{round_index}", [rng.randrange(1000) for _ in range(prompt_len)], params)

        samples["colocated"].append(_colocated_ttft(colocated, fresh("c")))
        for name, prefill in (("pipelined", pipelined), ("serial", serial)):
            ttft, result = _disaggregated_ttft(prefill, decode, fresh(name))
            samples[name].append(ttft)
            results[name].append(result)
        print(f"round {round_index + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in samples.items()), flush=True)

    rows, figures = [], {"ttft_s": samples}
    col = statistics.median(samples["colocated"])
    rows.append(["colocated", col, 1.0, "-", "-", "-"])
    for name in ("pipelined", "serial"):
        exposed = [r.chunks[-1].arrived_s - r.first_token_s for r in results[name]]
        per_chunk = [c.arrived_s - c.send_start_s for r in results[name] for c in r.chunks[:-1]] or [
            c.arrived_s - c.send_start_s for r in results[name] for c in r.chunks
        ]
        one_chunk = statistics.median(per_chunk)
        ttft = statistics.median(samples[name])
        figures[name] = {
            "exposed_s": exposed, "one_chunk_transfer_s": one_chunk,
            "num_chunks_sent": [len(r.chunks) for r in results[name]],
            "bytes_sent": [r.num_bytes_sent for r in results[name]],
        }
        rows.append([f"disaggregated, {name}", ttft, ttft / col, statistics.median(exposed) * 1e3,
                     one_chunk * 1e3, statistics.median(exposed) / one_chunk])
    for worker in (colocated, decode, pipelined, serial):
        ray.kill(worker)
    return rows, figures


def _bandwidth(args, model_dir, config) -> tuple[list, dict]:
    import ray

    from actors.messages import GenerateRequest
    from actors.sampling_params import SamplingParams
    from cluster.workers import start_worker

    decode = start_worker("decode", "bw-d", model_dir, config)
    prefill = start_worker("prefill", "bw-p", model_dir, config)
    ray.get([decode.ping.remote(), prefill.ping.remote()])
    num_tokens = args.bandwidth_blocks * config.block_size - 1
    chunk_blocks = max(1, args.chunk_tokens // config.block_size)
    rows, figures = [], {}
    for channel in ("gloo", "object_store"):
        measured = {}
        for label, per_chunk in (("chunked", chunk_blocks), ("raw", args.bandwidth_blocks)):
            runs = []
            for repeat in range(args.repeats + 1):  # the first is a warm-up
                request = GenerateRequest(f"bw-{channel}-{label}-{repeat}", [7] * num_tokens, SamplingParams(max_new_tokens=1))
                reservation = ray.get(decode.reserve.remote(request, "unread", prefill))  # no events read
                seconds = ray.get(prefill.measure_send.remote(reservation, decode, channel, per_chunk))
                ray.get(decode.abort.remote(request.request_id))
                runs.append(sum(seconds))
            measured[label] = statistics.median(runs[1:])
        block_bytes = ray.get(decode.read_blocks.remote([0])).numel() * 4
        total = block_bytes * args.bandwidth_blocks
        chunked_gbps, raw_gbps = total / measured["chunked"] / 1e9, total / measured["raw"] / 1e9
        figures[channel] = {"bytes": total, "chunked_s": measured["chunked"], "raw_s": measured["raw"]}
        rows.append([channel, total / 1e6, chunk_blocks, chunked_gbps, raw_gbps, chunked_gbps / raw_gbps])
    ray.kill(decode)
    ray.kill(prefill)
    return rows, figures


def main(args: argparse.Namespace) -> None:
    import ray

    from actors.config import EngineConfig
    from actors.model_builder import ensure_checkpoint

    if args.quick:
        args.preset, args.repeats, args.chunk_tokens, args.bandwidth_blocks = "tiny", 1, 64, 32
    model_dir = ensure_checkpoint(args.preset, args.arch)
    prompt_len = args.chunk_tokens * args.chunks
    config = EngineConfig(
        block_size=16, prefill_chunk_size=args.chunk_tokens, max_num_batched_tokens=args.chunk_tokens,
        num_kv_blocks=prompt_len // 16 * 3 + 64, enable_prefix_cache=False,
    )
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    print(f"overlap: {args.chunks} chunks of {args.chunk_tokens} tokens, {args.preset} model ...", flush=True)
    overlap_rows, overlap = _overlap(args, model_dir, config)
    print("bandwidth ...", flush=True)
    bandwidth_rows, bandwidth = _bandwidth(args, model_dir, config)

    report.print_table(
        f"TTFT, one {prompt_len}-token prompt ({args.chunks} chunks), median of {args.repeats}",
        ["system", "TTFT s", "vs colocated", "exposed transfer ms", "one chunk transfer ms", "exposed / one chunk"],
        overlap_rows,
    )
    report.print_table(
        "Channel bandwidth P -> D (median)",
        ["channel", "MB moved", "blocks per chunk", "chunked GB/s", "raw GB/s", "chunked / raw"],
        bandwidth_rows,
    )
    pipelined = overlap_rows[1]
    gloo = bandwidth_rows[0]
    settings = {k: v for k, v in vars(args).items() if not callable(v)}
    payload = {"settings": settings, "overlap": overlap, "bandwidth": bandwidth,
               "machine": report.machine_info()}
    report.finish(
        "transfer", args.out, payload,
        f"TTFT disaggregated/colocated {pipelined[2]:.2f}x, exposed {pipelined[5]:.2f} chunks, gloo chunked/raw {gloo[5]:.2f}",
        "<= 1.15x, <= 1.5 chunks, >= 0.5",
    )
