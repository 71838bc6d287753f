"""Soak: concurrent streaming clients for a set time; every request ends complete or
deliberately, and memory and KV blocks do not grow.

    tandem bench soak [--quick] [--duration-s 180] [--clients 8] [--out FILE.json]

System: the settings of `manifests/local.yaml` (tiny model, disaggregated 1 P + 1 D,
early SLO rejection on), deployed in a local Ray + Serve (`ServeCluster`).

Load: `--clients` closed-loop clients, each sending one request at a time (a random
think time of up to `--think-s` between requests, half a second after a 429) until
`--duration-s` has passed, from the seeded mix of `benchmarks/soak_traffic.py`:
`/generate` streaming and not, completions streaming and not, chat streaming; token
and text prompts of many lengths; greedy and sampled; stop strings; and some
streams the client hangs up on mid-way (deliberate cancellations), and some it
ends through `/abort_request` (deliberate aborts).

Checks (any miss is a failure named in the headline):
1. every request is complete, a deliberate 429 (SLO admission), a deliberate
   cancellation or a deliberate abort (`benchmarks/soak_verdict.py`); failures are
   counted and examples printed;
2. once the load stops and the last request has ended, every worker comes back to
   idle within `--idle-timeout-s` (no used block, reservation, running or waiting
   request) and `check_accounting()` passes on each; no worker was replaced;
3. RSS of every serving process (workers, scheduler replica, Serve proxy, pool
   manager) at the end of the load against its RSS at the first sample after
   `--warm-up-s`: growth within max(`--rss-tolerance` x baseline,
   `--rss-tolerance-mib`).
Samples every `--sample-every-s` of each process's RSS (`/proc/<pid>/statm`) and
each worker's blocks in use go into the JSON; the server's own request counters
(`/metrics`) are reported beside the client's.

Output: the JSON at `--out` and the tables in `<stem>.md` beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import report
from benchmarks.arguments import fraction, non_negative_float, positive_float, positive_int

APP = "soak"
MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "local.yaml"
REJECTED_BACKOFF_S = 0.5
MAX_EXAMPLES = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a 20 s smoke run (warm-up 5 s, samples every 2.5 s)")
    parser.add_argument("--duration-s", type=positive_float, default=None, help="load time (default 180; quick 20)")
    parser.add_argument("--warm-up-s", type=positive_float, default=None,
                        help="RSS baseline after this (default 30; quick 5)")
    parser.add_argument("--sample-every-s", type=positive_float, default=None,
                        help="sampling period (default 10; quick 2.5)")
    parser.add_argument("--clients", type=positive_int, default=8, help="concurrent closed-loop clients")
    parser.add_argument("--think-s", type=non_negative_float, default=0.2,
                        help="longest random pause between a client's requests")
    parser.add_argument("--cancel-share", type=fraction, default=0.12, help="share of streams cancelled mid-way")
    parser.add_argument("--abort-share", type=fraction, default=0.08,
                        help="share of single-prompt streams ended by /abort_request mid-way")
    parser.add_argument("--request-timeout-s", type=positive_float, default=120.0)
    parser.add_argument("--idle-timeout-s", type=positive_float, default=30.0,
                        help="for the workers to come back to idle")
    parser.add_argument("--rss-tolerance", type=non_negative_float, default=0.10,
                        help="allowed RSS growth, fraction of baseline")
    parser.add_argument("--rss-tolerance-mib", type=non_negative_float, default=50.0,
                        help="allowed RSS growth, MiB (larger wins)")
    parser.add_argument("--manifest", default=str(MANIFEST), help="serve manifest whose first app's args are served")
    parser.add_argument("--seed", type=int, default=0)


@dataclass(frozen=True)
class SoakRecord:
    client: int
    sent_s: float  # from the start of the load
    request: object  # SoakRequest
    response: object  # RawResponse
    verdict: object  # Verdict


def manifest_settings(path: str) -> dict:
    """The first Tandem application's `args` in a Serve config (its pool name
    aside: ServeCluster names the pool), once `tandem check-manifest` finds it
    valid: a file not there, a RayService or a bad setting was a traceback
    (the last one after the cluster was up)."""
    import yaml

    from cluster.cli_error import CliError
    from cluster.manifest_check import IMPORT_PATH, check_manifest

    problems = check_manifest(path)
    if problems:
        raise CliError(f"--manifest {path} is not valid:\n  " + "\n  ".join(problems))
    manifest = yaml.safe_load(Path(path).read_text())
    if manifest.get("kind") == "RayService":
        manifest = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    args = dict(next(a for a in manifest["applications"] if a.get("import_path") == IMPORT_PATH)["args"])
    args.pop("pool_name", None)
    return args


def resolve_defaults(args: argparse.Namespace) -> None:
    quick = args.quick
    args.duration_s = args.duration_s or (20.0 if quick else 180.0)
    args.warm_up_s = args.warm_up_s if args.warm_up_s is not None else (5.0 if quick else 30.0)
    args.sample_every_s = args.sample_every_s or (2.5 if quick else 10.0)
    if args.warm_up_s >= args.duration_s:
        raise SystemExit("--warm-up-s must be shorter than --duration-s")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ---- the load -----------------------------------------------------------------------------
async def _client(index: int, client, url: str, args, vocab: int, started: float, deadline: float,
                  counter, records: list) -> None:
    from benchmarks.soak_traffic import draw_request, send
    from benchmarks.soak_verdict import Outcome, judge

    rng = random.Random(args.seed * 1000 + index)
    while time.perf_counter() < deadline:
        request = draw_request(rng, next(counter), vocab, args.cancel_share, args.abort_share)
        sent_s = time.perf_counter() - started
        response = await send(client, url, request, args.request_timeout_s)
        verdict = judge(request, response)
        records.append(SoakRecord(index, sent_s, request, response, verdict))
        pause = REJECTED_BACKOFF_S if verdict.outcome is Outcome.REJECTED else rng.uniform(0, args.think_s)
        await asyncio.sleep(pause)


async def _sampler(processes, started: float, every_s: float, deadline: float, samples: list) -> None:
    from benchmarks.soak_probes import take_sample

    while True:
        samples.append(await take_sample(processes, time.perf_counter() - started))
        now = time.perf_counter()
        if now >= deadline:
            return
        await asyncio.sleep(min(every_s, deadline - now))


async def run_load(url: str, processes, args, vocab: int):
    """(records, samples during the load, idle check, sample once idle)."""
    import itertools

    import httpx

    from benchmarks.soak_probes import take_sample, wait_idle

    records, samples = [], []
    limits = httpx.Limits(max_connections=args.clients * 2, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s, connect=30.0), limits=limits,
                                 trust_env=False) as client:
        started = time.perf_counter()
        deadline = started + args.duration_s
        counter = itertools.count()
        await asyncio.gather(
            _sampler(processes, started, args.sample_every_s, deadline, samples),
            *(_client(i, client, url, args, vocab, started, deadline, counter, records) for i in range(args.clients)))
        drained_s = time.perf_counter() - started
    idle = await wait_idle([p for p in processes if p.is_worker], args.idle_timeout_s)
    idle["drained_s"] = drained_s
    idle_sample = await take_sample(processes, time.perf_counter() - started)
    return sorted(records, key=lambda r: r.request.index), samples, idle, idle_sample


def server_counters(url: str) -> dict[str, int]:
    """The scheduler's `tandem_requests_total` by outcome, from /metrics."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    return {m.group(1): round(float(m.group(2)))
            for m in re.finditer(r'^tandem_requests_total\{outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M)}


# ---- analysis -------------------------------------------------------------------------------
def count_requests(records) -> dict:
    """Per endpoint (and "all"): how many of each outcome, finish reasons, tokens."""
    from benchmarks.soak_traffic import Endpoint
    from benchmarks.soak_verdict import Outcome

    started_all = (Outcome.OK, Outcome.CANCELLED, Outcome.ABORTED)  # every request of theirs reached the scheduler
    table = {}
    for label, chosen in [(e.label, [r for r in records if r.request.endpoint is e]) for e in Endpoint] + [
            ("all", records)]:
        ok = [r for r in chosen if r.verdict.outcome is Outcome.OK]
        e2e = [r.response.e2e_s for r in ok]
        table[label] = {
            "sent": len(chosen),
            **{o.value: sum(1 for r in chosen if r.verdict.outcome is o) for o in Outcome},
            "finish_stop": sum(1 for r in ok if r.verdict.finish_reason == "stop"),
            "finish_length": sum(1 for r in ok if r.verdict.finish_reason == "length"),
            "output_tokens_counted": sum(r.verdict.num_output_tokens or 0 for r in ok),
            # the scheduler's requests (a batch's prompts x n each): at most these were sent, at least these
            # reached it (a rejected batch: the one refused; the others it started are closed, or never begun)
            "scheduler_requests_sent": sum(r.request.num_answers for r in chosen),
            "scheduler_requests_reached": sum(r.request.num_answers if r.verdict.outcome in started_all
                                              else r.verdict.outcome is Outcome.REJECTED for r in chosen),
            "e2e_s": {"p50": report.median(e2e), "p99": report.percentile(e2e, 99)} if e2e else None,
        }
    return table


def memory_report(processes, samples, idle_sample, args) -> dict:
    from benchmarks.soak_probes import MIB, memory_growth, slope_bytes_per_min

    baseline = next(s for s in samples if s.t_s >= args.warm_up_s)
    end = samples[-1]
    out = {}
    for p in processes:
        growth = memory_growth(baseline.rss_bytes[p.name], end.rss_bytes[p.name], args.rss_tolerance,
                               int(args.rss_tolerance_mib * MIB))
        points = [(s.t_s, s.rss_bytes[p.name]) for s in samples if s.t_s >= baseline.t_s]
        out[p.name] = {"role": p.role, "pid": p.pid, "baseline_t_s": baseline.t_s, "end_t_s": end.t_s, **growth,
                       "slope_bytes_per_min": slope_bytes_per_min(points), "idle_bytes": idle_sample.rss_bytes[p.name],
                       "peak_bytes": max(s.rss_bytes[p.name] for s in samples)}
    return out


def problems(counts, idle, memory, workers_before, workers_after, server) -> list[str]:
    """What failed, one phrase each (empty: the soak passed)."""
    found = []
    total = counts["all"]
    if total["failed"]:
        found.append(f"{total['failed']} failed requests")
    if not total["ok"]:
        found.append("no request completed")
    reached, sent = total["scheduler_requests_reached"], total["scheduler_requests_sent"]
    ended = sum(server.values())
    if not reached <= ended <= sent:
        found.append(f"the scheduler ended {ended:.0f} requests; {reached} reached it, {sent} were sent")
    if not idle["idle"]:
        found.append(f"workers not idle {idle['after_s']:.0f} s after the load: {idle['workers']}")
    bad = [name for name, result in idle["accounting"].items() if result != "ok"]
    if bad:
        found.append(f"accounting failed on {', '.join(bad)}")
    grown = [name for name, m in memory.items() if not m["within"]]
    if grown:
        found.append(f"RSS grew past the tolerance on {', '.join(grown)}")
    if workers_before != workers_after:
        found.append(f"workers changed during the run: {sorted(workers_before)} -> {sorted(workers_after)}")
    return found


# ---- output ---------------------------------------------------------------------------------
def tables(counts, server, samples, memory, idle, processes) -> str:
    from benchmarks.soak_probes import MIB

    mib = lambda b: None if b is None else b / MIB  # noqa: E731
    request_rows = [[label, c["sent"], c["ok"], c["rejected"], c["cancelled"], c["aborted"], c["failed"],
                     c["finish_stop"],
                     c["finish_length"], c["e2e_s"]["p50"] if c["e2e_s"] else None,
                     c["e2e_s"]["p99"] if c["e2e_s"] else None] for label, c in counts.items()]
    workers = [p.name for p in processes if p.is_worker]
    sample_rows = [[round(s.t_s, 1), s.loadavg_1m, *(s.workers[w]["used_blocks"] for w in workers),
                    *(mib(s.rss_bytes[p.name]) for p in processes)] for s in samples]
    memory_rows = [[name, m["role"], mib(m["baseline_bytes"]), mib(m["end_bytes"]), mib(m["growth_bytes"]),
                    None if m["growth_rel"] is None else 100 * m["growth_rel"], mib(m["allowed_bytes"]),
                    mib(m["slope_bytes_per_min"]), mib(m["idle_bytes"]), m["within"]] for name, m in memory.items()]
    idle_rows = [[name, w["used_blocks"], w["reserved"], w["running"], w["waiting"], w["cached_blocks"],
                  idle["accounting"][name]] for name, w in idle["workers"].items()]
    return "\n".join([
        "### soak: requests by endpoint", "",
        report.markdown_table(["endpoint", "sent", "ok", "429", "cancelled", "aborted", "failed", "stop", "length",
                               "e2e p50 s", "e2e p99 s"], request_rows), "",
        "### soak: the scheduler's own count (`tandem_requests_total` by outcome, once idle)", "",
        report.markdown_table([*server, "all"], [[*server.values(), sum(server.values())]]),
        "",
        "### soak: samples (blocks in use per worker, RSS MiB per process)", "",
        report.markdown_table(["t s", "load 1m", *(f"{w} blocks" for w in workers),
                               *(f"{p.name} MiB" for p in processes)], sample_rows), "",
        "### soak: memory growth (end of load against the first sample after warm-up)", "",
        report.markdown_table(["process", "role", "baseline MiB", "end MiB", "growth MiB", "growth %", "allowed MiB",
                               "slope MiB/min", "idle MiB", "within"], memory_rows), "",
        f"### soak: idle check (idle {idle['after_s']:.1f} s after the clients stopped)", "",
        report.markdown_table(["worker", "used blocks", "reserved", "running", "waiting", "cached blocks",
                               "accounting"], idle_rows),
    ])


def headline_figure(counts, idle, memory, args, found) -> str:
    total = counts["all"]
    worst_name, worst = max(memory.items(), key=lambda item: item[1]["growth_bytes"])
    accounting = "ok" if all(v == "ok" for v in idle["accounting"].values()) else "FAILED"
    figure = (f"{total['sent']} requests in {args.duration_s:.0f} s from {args.clients} clients: "
              f"{total['ok']} complete, {total['rejected']} rejected (429), {total['cancelled']} cancelled, "
              f"{total['aborted']} aborted, {total['failed']} failed; "
              f"idle blocks {sum(w['used_blocks'] for w in idle['workers'].values())}, "
              f"accounting {accounting}; largest RSS growth {worst['growth_bytes'] / 2**20:+.1f} MiB ({worst_name})")
    return f"FAIL ({'; '.join(found)}): {figure}" if found else f"pass: {figure}"


def failure_examples(records) -> list[dict]:
    from benchmarks.soak_verdict import Outcome

    failed = [r for r in records if r.verdict.outcome is Outcome.FAILED]
    return [{"index": r.request.index, "endpoint": r.request.endpoint.label, "sent_s": r.sent_s,
             "http_status": r.response.http_status, "reason": r.verdict.reason,
             "last_events": r.response.events[-3:], "body": (r.response.body or "")[:300]} for r in failed[:50]]


def main(args: argparse.Namespace) -> None:
    from benchmarks.serve_cluster import ServeCluster
    from benchmarks.serve_scenarios import TINY_VOCAB
    from benchmarks.soak_probes import find_processes

    resolve_defaults(args)
    settings = manifest_settings(args.manifest)
    load_before = os.getloadavg()[0]
    with ServeCluster(pool_prefix="soak-pool") as cluster:
        print(f"deploying {args.manifest} as {APP!r} ...", flush=True)
        url = cluster.deploy({APP: settings})[APP]
        processes = find_processes(cluster, APP)
        for p in processes:
            print(f"  {p.name:<12} {p.role:<12} pid {p.pid:<8} cluster from {p.cluster_file}", flush=True)
        workers_before = {m.worker_id for m in cluster.members(APP)}
        print(f"soak: {args.clients} clients for {args.duration_s:.0f} s ...", flush=True)
        records, samples, idle, idle_sample = asyncio.run(run_load(url, processes, args, TINY_VOCAB))
        workers_after = {m.worker_id for m in cluster.members(APP)}
        server = server_counters(url)
    counts = count_requests(records)
    memory = memory_report(processes, samples, idle_sample, args)
    found = problems(counts, idle, memory, workers_before, workers_after, server)
    text = tables(counts, server, samples, memory, idle, processes)
    print("\n" + text)
    examples = failure_examples(records)
    for example in examples[:MAX_EXAMPLES]:
        print(f"\nfailed #{example['index']} {example['endpoint']} at {example['sent_s']:.1f} s: {example['reason']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")

    figure = headline_figure(counts, idle, memory, args, found)
    payload = {
        "quick": args.quick, "settings": settings, "manifest": args.manifest,
        "load": {"duration_s": args.duration_s, "clients": args.clients, "think_s": args.think_s,
                 "cancel_share": args.cancel_share, "abort_share": args.abort_share, "warm_up_s": args.warm_up_s,
                 "sample_every_s": args.sample_every_s, "seed": args.seed, "drained_s": idle["drained_s"]},
        "tolerance": {"rss_rel": args.rss_tolerance, "rss_mib": args.rss_tolerance_mib},
        "problems": found, "requests": counts, "server_counters": server, "failures": examples,
        "idle": idle, "memory": memory,
        "processes": [{"name": p.name, "role": p.role, "pid": p.pid, "cluster_file": p.cluster_file}
                      for p in processes],
        "samples": [vars(s) for s in samples], "idle_sample": vars(idle_sample),
        "loadavg_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "table": str(out.with_suffix(".md")), "machine": report.machine_info(),
    }
    report.finish("soak", out, payload, figure,
                  f"0 failed, 0 blocks in use once idle, accounting ok, RSS growth <= max({args.rss_tolerance:.0%}, "
                  f"{args.rss_tolerance_mib:.0f} MiB) per process")
