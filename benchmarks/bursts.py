"""Bursts: does early rejection turn requests away from a lightly loaded cluster?

    tandem bench bursts [--bursts 12] [--size 16] [--shared-prefix 0 [--new-prefix]] [--kv-blocks 1024]
                        [--out FILE.json]

System: disaggregated 1 P + 1 D, tiny model, a KV pool far larger than the load (by default),
early rejection on with a TTFT SLO (`--ttft-slo-ms`; the TBT SLO far away, so
only TTFT predictions reject). Workload (over HTTP): `--bursts` bursts of `--size`
short requests sent at the same instant (`--prompt` random tokens in, `--output`
out, fresh prompts each time, so no prefix hits, or after `--shared-prefix` tokens
every prompt begins with: a system prompt, cached and idle on D between bursts),
`--every-s` apart, so the cluster idles between them; one burst first as a warm-up,
not counted (after one request of it alone where prompts share a prefix, so that the
warm-up burst finds it cached, as later ones do). With `--new-prefix` the warm-up
(its lone request and burst) shares another prefix as long, so that the first
counted burst is the first to send the shared prefix (a new system prompt), after
a warm-up as loaded as a burst; the first burst is reported apart as well.
`--kv-blocks`: each worker's pool.

Reported: requests, rejected (429), served, failed, TTFT median, p90 and max of
the served and how many met the SLO, and the TTFTs the rejections predicted
(from their 429 bodies) and their messages. A request
rejected while every served one met the SLO with room to spare was turned away
for nothing: admission mispredicted a burst's queue, the cluster was not full.
Goal: none rejected while the served requests' worst TTFT is within the SLO.

With `--size 80 --prompt 96 --output 160 --bursts 4 --every-s 10` a burst asks
for more than D's pool (16 blocks a request, 1024 in the pool): its last requests
wait in D's line until the first ones finish, and admission must predict that
wait, not take the burst's own first requests for a line ahead of it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import random
import re

from benchmarks import report
from benchmarks.arguments import non_negative_int, positive_float, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_burst_arguments(parser, num_bursts=12, every_s=3.0)
    parser.add_argument("--ttft-slo-ms", type=positive_float, default=5000.0)
    parser.add_argument("--kv-blocks", type=positive_int, default=1024, help="KV blocks of each worker's pool")
    parser.add_argument("--new-prefix", action="store_true",
                        help="the first counted burst is the first to send --shared-prefix (the warm-up does not)")


def add_burst_arguments(parser: argparse.ArgumentParser, num_bursts: int, every_s: float) -> None:
    """The options of a workload of bursts (this one's, and `tandem bench predictions`')."""
    parser.add_argument("--bursts", type=positive_int, default=num_bursts)
    parser.add_argument("--size", type=positive_int, default=16, help="requests a burst, sent at the same instant")
    parser.add_argument("--every-s", type=positive_float, default=every_s, help="time from one burst to the next")
    parser.add_argument("--prompt", type=positive_int, default=24, help="prompt tokens a request")
    parser.add_argument("--output", type=positive_int, default=16, help="output tokens a request")
    parser.add_argument("--shared-prefix", type=non_negative_int, default=0,
                        help="tokens every prompt begins with (a system prompt), before its fresh ones")


def shared_prefix(args, vocab: int, seed: int = -7) -> list[int]:
    """The `--shared-prefix` tokens every prompt of a run begins with (the same in every run)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(args.shared_prefix)]


def workload(args, vocab: int, seed: int, num_bursts: int, prefix_seed: int = -7):
    """`num_bursts` bursts of `args.size` fresh random prompts, `args.every_s` apart,
    after the shared prefix (`prefix_seed`'s)."""
    from benchmarks.workload import BenchRequest, Workload

    rng = random.Random(seed)
    shared = shared_prefix(args, vocab, prefix_seed)
    requests = []
    for burst in range(num_bursts):
        for _ in range(args.size):
            prompt = shared + [rng.randrange(3, vocab) for _ in range(args.prompt)]
            requests.append(BenchRequest(len(requests), burst * args.every_s, prompt, args.output))
    return Workload("bursts", requests)


def main(args: argparse.Namespace) -> None:
    from actors.model_builder import ensure_checkpoint
    from benchmarks.http_client import run_workload
    from benchmarks.serve_cluster import ServeCluster
    from benchmarks.serve_scenarios import TINY_VOCAB, app_settings

    ensure_checkpoint("tiny", "qwen2")
    settings = app_settings(argparse.Namespace(preset="tiny", arch="qwen2", kv_cache_mib=0), mode="disaggregated",
                            slo={"early_rejection": True, "ttft_ms": args.ttft_slo_ms, "tbt_ms": 60_000})
    settings["engine"] = {"block_size": 16, "num_kv_blocks": args.kv_blocks, "max_num_seqs": 64,
                          "prefill_chunk_size": 256, "max_num_batched_tokens": 1024}
    with ServeCluster(num_cpus=4) as cluster:
        url = cluster.deploy({"bursts": settings})["bursts"]
        warm_up = workload(args, TINY_VOCAB, seed=-1, num_bursts=1, prefix_seed=-8 if args.new_prefix else -7)
        if args.shared_prefix:  # one request first: the system prompt cached on P and D, as in a steady state
            asyncio.run(run_workload(url, dataclasses.replace(warm_up, requests=warm_up.requests[:1])))
        asyncio.run(run_workload(url, warm_up))  # warm-up, not counted
        records = asyncio.run(run_workload(url, workload(args, TINY_VOCAB, seed=0, num_bursts=args.bursts),
                                           request_timeout_s=120))
    slo_s = args.ttft_slo_ms / 1e3
    ttfts = [r.ttft_s for r in records if r.status == "ok"]
    rejected = [r for r in records if r.status == "rejected"]
    failed = [r for r in records if r.status not in ("ok", "rejected")]
    bodies = [_error_body(r.error) for r in rejected]
    predicted = [b["predicted_ttft_ms"] / 1e3 for b in bodies if "predicted_ttft_ms" in b]
    messages = collections.Counter(re.sub(r"\d+ ms", "N ms", b.get("message", "?"))[:160] for b in bodies)
    summary = {"requests": len(records), "rejected": len(rejected), "served": len(ttfts), "failed": len(failed),
               "within_slo": sum(t <= slo_s for t in ttfts),
               "ttft_median_s": report.median(ttfts) if ttfts else None,
               "ttft_p90_s": report.percentile(ttfts, 90) if ttfts else None,
               "ttft_max_s": max(ttfts) if ttfts else None,
               "rejected_predicted_ttft_s": [min(predicted), max(predicted)] if predicted else None,
               "rejections": dict(messages), "first_burst": _first_burst(records, args.size)}
    shared = f"{args.shared_prefix} shared + " if args.shared_prefix else ""
    report.print_table(f"{args.bursts} bursts of {args.size} requests ({shared}{args.prompt} tokens in, {args.output} "
                       f"out) {args.every_s:g} s apart, TTFT SLO {args.ttft_slo_ms:g} ms, {args.kv_blocks} KV blocks",
                       ["requests", "rejected", "served", "failed", "within SLO", "TTFT median s", "TTFT p90 s",
                        "TTFT max s"],
                       [[summary[k] for k in ("requests", "rejected", "served", "failed", "within_slo",
                                              "ttft_median_s", "ttft_p90_s", "ttft_max_s")]])
    first = summary["first_burst"]
    first_worst = "-" if first["ttft_max_s"] is None else f"{first['ttft_max_s']:.2f} s"
    print(f"the first burst: {first['rejected']} of {args.size} rejected, {first['failed']} failed, the served's TTFT "
          f"at most {first_worst}")
    if predicted:
        print(f"the rejections predicted TTFTs of {min(predicted):.2f}-{max(predicted):.2f} s")
    for message, count in messages.most_common(5):
        print(f"rejected {count}: {message}")
    worst = f"{summary['ttft_max_s']:.2f} s" if ttfts else "-"
    report.finish("bursts", args.out, {"args": vars(args) | {"func": None}, "summary": summary},
                  f"{len(rejected)} of {len(records)} rejected, {len(failed)} failed, the served's TTFT at most "
                  f"{worst} against an SLO of {slo_s:g} s", "none rejected while every served TTFT meets the SLO")


def _first_burst(records, size: int) -> dict:
    """The first counted burst's outcome (with `--new-prefix`, the first to send the shared prefix)."""
    first = [r for r in records if r.index < size]
    ttfts = [r.ttft_s for r in first if r.status == "ok"]
    return {"rejected": sum(r.status == "rejected" for r in first),
            "failed": sum(r.status not in ("ok", "rejected") for r in first),
            "ttft_max_s": max(ttfts) if ttfts else None}


def _error_body(text: str | None) -> dict:
    """The `error` object of a 429's JSON body; from what the record kept of a
    long one (its first 300 characters), the message and the predicted TTFT."""
    try:
        return json.loads(text or "")["error"]
    except (ValueError, KeyError, TypeError):
        found = {}
        if message := re.search(r'"message":"([^"]*)"', text or ""):
            found["message"] = message.group(1)
        if ttft := re.search(r'"predicted_ttft_ms":([\d.]+)', text or ""):
            found["predicted_ttft_ms"] = float(ttft.group(1))
        return found
