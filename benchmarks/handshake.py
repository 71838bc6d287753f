"""Handshake: requests that wait for a full decode worker's KV blocks.

    tandem bench handshake [--rounds 2] [--out FILE.json]

System: disaggregated 1 P + 1 D, tiny model, D's KV pool small (`--kv-blocks`
blocks of 16 tokens), the handshake's wait for room `--handshake-s`
(`timeouts.handshake_s`); early rejection off, or on with `--ttft-slo-ms` (the TBT
SLO then far away, so only TTFT predictions reject). Workload (the same every round, open
loop, over HTTP): a steady stream of short requests (`--short-prompt` tokens in,
`--short-output` out, one every `--short-every-ms`, for `--window-s`) that keeps D
full, with a few long prompts (`--long-prompt` tokens: most of D's pool) arriving
among them. While D has no room, each request's handshake waits for a running one
to finish and free its blocks.

Reported per class (short, long), over the rounds: requests served, rejected early
(429), failed (503 after the handshake's wait, or any other error), TTFT median,
p90 and max, the median of the served requests' mean TBT, and the makespan (first
send to last token); with an SLO, the served requests within it, and their share of
the admitted ones (served or failed). Also D's preemptions in the counted rounds
(from /metrics): running requests D preempted by recompute because they outgrew
its pool (actors/decode_room.py).
What it shows: whether a long prompt gets its turn among short ones that keep
arriving, how soon the blocks a finished request frees are taken again, and, with
an SLO, whether admission foresees the wait for them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import re
import time

from benchmarks import report
from benchmarks.arguments import non_negative_floats, non_negative_int, positive_float, positive_int

METRICS_REFRESH_S = 2.0  # the scheduler reads its workers' stats about once a second


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--kv-blocks", type=positive_int, default=64, help="D's (and P's) KV pool, blocks of 16 tokens")
    parser.add_argument("--handshake-s", type=positive_float, default=10.0, help="how long a handshake waits for room")
    parser.add_argument("--window-s", type=positive_float, default=8.0, help="arrival window of the short requests")
    parser.add_argument("--short-every-ms", type=positive_float, default=40.0)
    parser.add_argument("--short-prompt", type=positive_int, default=40)
    parser.add_argument("--short-output", type=positive_int, default=80)
    parser.add_argument("--long-prompt", type=positive_int, default=640)
    parser.add_argument("--long-output", type=positive_int, default=20)
    parser.add_argument("--long-at-s", type=non_negative_floats, default="1,2.5,4",
                        help="arrival times of the long prompts")
    parser.add_argument("--ttft-slo-ms", type=positive_float, default=None,
                        help="turn early rejection on with this TTFT SLO")
    parser.add_argument("--decode-reserve-tokens", type=non_negative_int, default=512,
                        help="room D keeps for each request's next tokens (engine.decode_reserve_tokens; 0: none)")


def workload(args, vocab: int, seed: int):
    """Short requests every `short_every_ms`, long ones at `long_at_s`; returns the
    workload and each request's class."""
    from benchmarks.workload import BenchRequest, Workload

    rng = random.Random(seed)
    arrivals = [(i * args.short_every_ms / 1e3, "short") for i in range(int(args.window_s * 1e3 / args.short_every_ms))]
    arrivals += [(at, "long") for at in args.long_at_s]
    arrivals.sort()
    requests, classes = [], []
    for index, (at, kind) in enumerate(arrivals):
        length, output = (args.short_prompt, args.short_output) if kind == "short" else (args.long_prompt,
                                                                                         args.long_output)
        requests.append(BenchRequest(index, at, [rng.randrange(3, vocab) for _ in range(length)], output))
        classes.append(kind)
    return Workload("handshake", requests), classes


def main(args: argparse.Namespace) -> None:
    from actors.model_builder import ensure_checkpoint
    from benchmarks.http_client import run_workload
    from benchmarks.serve_cluster import ServeCluster
    from benchmarks.serve_scenarios import TINY_VOCAB, app_settings

    ensure_checkpoint("tiny", "qwen2")
    settings = app_settings(argparse.Namespace(preset="tiny", arch="qwen2", kv_cache_mib=0), mode="disaggregated")
    settings["engine"] = {"block_size": 16, "num_kv_blocks": args.kv_blocks, "max_num_seqs": 64,
                          "prefill_chunk_size": 256, "max_num_batched_tokens": 1024,
                          "decode_reserve_tokens": args.decode_reserve_tokens}
    # At most the prompts a pool of kv_blocks serves (with a first token): AppSettings refuses more
    limits = settings["limits"]
    settings["limits"] = {**limits, "max_prompt_tokens": min(limits["max_prompt_tokens"], args.kv_blocks * 16 - 1)}
    settings["timeouts"] = {"handshake_s": args.handshake_s}
    if args.ttft_slo_ms is not None:
        settings["slo"] = {"early_rejection": True, "ttft_ms": args.ttft_slo_ms, "tbt_ms": 60_000}
    records: dict[str, list] = {"short": [], "long": []}
    makespans = []
    with ServeCluster(num_cpus=4) as cluster:
        url = cluster.deploy({"handshake": settings})["handshake"]
        load, classes = workload(args, TINY_VOCAB, seed=-1)
        asyncio.run(run_workload(url, load))  # warm-up round, not counted
        time.sleep(METRICS_REFRESH_S)
        preempted_before = decode_preemptions(url)
        for round_index in range(args.rounds):
            load, classes = workload(args, TINY_VOCAB, seed=round_index)
            done = asyncio.run(run_workload(url, load, request_timeout_s=120))
            for record, kind in zip(done, classes):
                records[kind].append(record)
            ends = [r.sent_s + r.e2e_s for r in done if r.e2e_s is not None]
            makespans.append(max(ends) if ends else float("nan"))
            failed = sum(r.status not in ("ok", "rejected") for r in done)
            rejected = sum(r.status == "rejected" for r in done)
            print(f"round {round_index + 1}: {len(done)} requests, {rejected} rejected, {failed} failed, "
                  f"makespan {makespans[-1]:.1f} s", flush=True)
        time.sleep(METRICS_REFRESH_S)
        preemptions = decode_preemptions(url) - preempted_before
    rows, summary = [], {}
    slo_s = args.ttft_slo_ms / 1e3 if args.ttft_slo_ms is not None else None
    for kind, runs in records.items():
        ttfts = [r.ttft_s for r in runs if r.status == "ok"]
        tbts = [(r.token_times_s[-1] - r.token_times_s[0]) / (r.num_output_tokens - 1)
                for r in runs if r.status == "ok" and r.num_output_tokens > 1]
        rejected = sum(r.status == "rejected" for r in runs)
        errors = collections.Counter(re.sub(r"request \S+ ", "request ", r.error or r.status)[:200]
                                     for r in runs if r.status not in ("ok", "rejected"))
        admitted = len(runs) - rejected
        within = sum(t <= slo_s for t in ttfts) if slo_s is not None else None
        summary[kind] = {"requests": len(runs), "served": len(ttfts), "rejected": rejected,
                         "failed": admitted - len(ttfts), "within_slo": within,
                         "admitted_attainment": within / admitted if within is not None and admitted else None,
                         "ttft_median_s": report.median(ttfts) if ttfts else None,
                         "ttft_p90_s": report.percentile(ttfts, 90) if ttfts else None,
                         "ttft_max_s": max(ttfts) if ttfts else None,
                         "tbt_median_ms": report.median(tbts) * 1e3 if tbts else None, "errors": errors}
        s = summary[kind]
        rows.append([kind, s["requests"], s["served"], s["rejected"], s["failed"], s["within_slo"],
                     s["admitted_attainment"], s["ttft_median_s"], s["ttft_p90_s"], s["ttft_max_s"],
                     s["tbt_median_ms"]])
    report.print_table(f"Requests waiting for a full decode worker ({args.kv_blocks} KV blocks), "
                       f"{args.rounds} rounds, TTFT SLO {args.ttft_slo_ms or '-'} ms",
                       ["class", "requests", "served", "rejected", "failed", "within SLO", "admitted attainment",
                        "TTFT median s", "TTFT p90 s", "TTFT max s", "TBT median ms"], rows)
    print(f"makespan per round: {', '.join(f'{m:.1f} s' for m in makespans)}; D preempted {preemptions} times")
    by_second = _by_second(records["short"], slo_s) if slo_s is not None else []
    if by_second:
        report.print_table("Short requests by the second of the round they arrived in (all rounds)",
                           ["second", "requests", "rejected", "admitted", "within SLO", "TTFT max s"], by_second)
    for kind in records:
        for error, count in summary[kind]["errors"].items():
            print(f"{kind}: {count} failed: {error}")
    long, short = summary["long"], summary["short"]
    payload = {"args": vars(args) | {"func": None}, "summary": summary, "makespan_s": makespans,
               "short_by_second": by_second, "decode_preemptions": preemptions}
    if slo_s is None:
        report.finish("handshake", args.out, payload, f"{long['served']} of {long['requests']} long prompts served "
                      f"among short ones, {short['failed']} short requests failed", "every request served")
    else:
        attainment = short["admitted_attainment"]
        report.finish("handshake", args.out, payload,
                      f"{attainment if attainment is not None else 0:.0%} of the admitted short requests within the "
                      f"TTFT SLO of {args.ttft_slo_ms:g} ms, {short['rejected']} of {short['requests']} rejected",
                      ">= 90% of the admitted")


def decode_preemptions(url: str) -> int:
    """The decode workers' preemptions since they started, as the scheduler last read them (/metrics)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    return sum(round(float(m.group(1)))
               for m in re.finditer(r'^tandem_preemptions_total\{[^}]*role="decode"[^}]*\} ([0-9.e+]+)$', text, re.M))


def _by_second(records, slo_s: float) -> list[list]:
    """Per second of arrival: requests, rejected, admitted, within the SLO, the
    worst TTFT served (where in a round admission's predictions miss)."""
    rows = []
    for second in range(int(max(r.arrival_s for r in records)) + 1):
        runs = [r for r in records if second <= r.arrival_s < second + 1]
        served = [r.ttft_s for r in runs if r.status == "ok"]
        rejected = sum(r.status == "rejected" for r in runs)
        rows.append([second, len(runs), rejected, len(runs) - rejected, sum(t <= slo_s for t in served),
                     max(served) if served else None])
    return rows
