"""Delivery: the decode rate HTTP clients get from a worker's batch, against its engine alone.

A decode worker's tokens go from its engine thread to its actor's event loop, over
Ray to the scheduler's Serve replica, and out as server-sent events. Each hop costs
CPU a token, taken from the same cores the engine steps on (one core a worker
here; on a GPU server, the host time that bounds a small model's decode step), so
what clients receive can fall well short of what the engine computes. This runs
`--batch` streaming `/generate` requests at once (greedy, `ignore_eos`, equal
lengths) against each system, in turn, and the same requests through the engine
alone (`actors.llm.LLM`, in this process, on one thread, like a worker's one core).
A third system, disaggregated with `--stream-interval` tokens an event (the
`stream_interval` setting), shows what fewer, larger events buy; a fourth, with
`--scheduler-replicas` Serve replicas of the scheduler, what more front-end
processes buy (nothing where the cores are already busy, as on two).

Steady decode rate, both sides measured the same way: the tokens that arrive
between the moment the last request got its first token and the moment the first
request finished (every request of the batch decoding), over that window. The
headline is the decode worker's rate over HTTP against the engine alone.

Where the CPU goes (Linux): each process's CPU time over a whole HTTP run (prefill
included), by role (decode or colocated worker, prefill worker, the scheduler's
Serve replica, Serve's HTTP proxy, this process as the client), in microseconds
a delivered token. On this machine every process shares the same cores, so what
the others spend a token is what the decode worker does not get.

    tandem bench delivery          # tiny preset, batch 64, 3 rounds (about 4 min)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

from benchmarks import report
from benchmarks.arguments import arch, non_negative_int, positive_int, preset

ROLES = {  # role -> what its process's command line holds
    "worker": ("ray::DecodeWorker", "ray::ColocatedWorker"),
    "prefill worker": ("ray::PrefillWorker",),
    "scheduler replica": ("ray::ServeReplica",),
    "HTTP proxy": ("ray::ProxyActor",),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", type=preset, default="tiny")
    parser.add_argument("--arch", type=arch, default="qwen2")
    parser.add_argument("--batch", type=positive_int, default=64, help="requests in flight at once")
    parser.add_argument("--prompt-tokens", type=positive_int, default=64)
    parser.add_argument("--output-tokens", type=positive_int, default=256)
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="rounds (each system and the engine once a round)")
    parser.add_argument("--kv-cache-mib", type=positive_int, default=256)
    parser.add_argument("--stream-interval", type=non_negative_int, default=4,
                        help="also run disaggregated with this stream_interval (tokens an event gathers); 0: not")
    parser.add_argument("--scheduler-replicas", type=non_negative_int, default=0,
                        help="also run disaggregated with this many scheduler (Serve) replicas; 0: not")


def steady_rate(token_times: list[list[float]]) -> float:
    """Tokens a second while every request decodes: between the last first token
    and the first last token (times on one clock, one list per request)."""
    start = max(times[0] for times in token_times)
    end = min(times[-1] for times in token_times)
    if end <= start:
        raise ValueError("no moment when every request was decoding: raise --output-tokens")
    inside = sum(1 for times in token_times for t in times if start < t <= end)
    return inside / (end - start)


def _requests(args, vocab: int, seed: int):
    from benchmarks.workload import BenchRequest

    rng = random.Random(seed)
    return [BenchRequest(i, 0.0, [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)], args.output_tokens)
            for i in range(args.batch)]


def cpu_seconds_by_role() -> dict[str, float]:
    """CPU time (user + system) so far of every process of each role (the idle system's
    too: they spend little), and of this
    one as "client" (an empty dict off Linux)."""
    if not os.path.isdir("/proc"):
        return {}
    ticks = os.sysconf("SC_CLK_TCK")
    totals = dict.fromkeys([*ROLES, "client"], 0.0)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read(200).decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        role = "client" if int(pid) == os.getpid() else \
            next((r for r, marks in ROLES.items() if command.startswith(marks)), None)
        if role is not None:
            totals[role] += (int(fields[11]) + int(fields[12])) / ticks
    return totals


def _over_http(url: str, requests) -> tuple[float, dict[str, float]]:
    """The steady rate of one batch over HTTP, and CPU us a delivered token by role."""
    from benchmarks.http_client import run_workload
    from benchmarks.workload import Workload

    before = cpu_seconds_by_role()
    records = asyncio.run(run_workload(url, Workload("delivery", requests), max_in_flight=len(requests)))
    after = cpu_seconds_by_role()
    failed = [r for r in records if r.status != "ok"]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(records)} requests failed, e.g. {failed[0].error}")
    num_tokens = sum(r.num_output_tokens for r in records)
    cpu_us = {role: (after[role] - before[role]) / num_tokens * 1e6 for role in after}
    return steady_rate([[r.sent_s + t for t in r.token_times_s] for r in records]), cpu_us


def engine_rate(llm, prompts: list[list[int]], max_new_tokens: int) -> float:
    """The steady rate of a batch through the engine alone (greedy, `ignore_eos`)."""
    from actors.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    return steady_rate([list(out._token_times_s) for out in llm.generate(prompts, params)])


async def feed_rate(prefill, decode, prompts: list[list[int]], max_new_tokens: int, channel: str) -> float:
    """The steady rate of a batch through a P/D pair, read from D's token feed in
    this process (no HTTP; greedy, `ignore_eos`)."""
    from actors.messages import GenerateRequest
    from actors.sampling_params import SamplingParams
    from cluster.pd_request import DisaggregatedCall
    from cluster.token_feeds import TokenFeeds

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    feeds = TokenFeeds()

    async def token_times(i: int, prompt_ids: list[int]) -> list[float]:
        call = DisaggregatedCall(prefill, decode, GenerateRequest(f"feed-rate-{i}", prompt_ids, params), channel,
                                 feeds=feeds)
        times = []
        async for event in call.events():
            if event.error:
                raise RuntimeError(event.error)
            times += [time.perf_counter()] * len(event.token_ids)
        return times

    try:
        return steady_rate(await asyncio.gather(*(token_times(i, ids) for i, ids in enumerate(prompts))))
    finally:
        await feeds.close()


def main(args: argparse.Namespace) -> None:
    import torch

    from actors.llm import LLM
    from actors.model_builder import ensure_checkpoint
    from benchmarks.serve_cluster import ServeCluster
    from benchmarks.serve_scenarios import app_settings

    model_dir = ensure_checkpoint(args.preset, args.arch)
    torch.set_num_threads(1)
    engine_settings = dict(block_size=16, max_num_seqs=args.batch, prefill_chunk_size=256, max_num_batched_tokens=1024,
                           kv_cache_bytes=args.kv_cache_mib * 2**20)
    llm = LLM(model_dir, **engine_settings)
    vocab = llm.engine.model_config.vocab_size
    settings = argparse.Namespace(preset=args.preset, arch=args.arch, kv_cache_mib=args.kv_cache_mib)
    systems = {
        "colocated": app_settings(settings, mode="colocated", colocated=1),
        "disaggregated": app_settings(settings, mode="disaggregated"),
    }
    if args.stream_interval:
        systems[f"disaggregated-interval-{args.stream_interval}"] = {
            **app_settings(settings, mode="disaggregated"), "stream_interval": args.stream_interval}
    if args.scheduler_replicas:
        systems[f"disaggregated-{args.scheduler_replicas}-schedulers"] = {
            **app_settings(settings, mode="disaggregated"), "scheduler_replicas": args.scheduler_replicas}
    for system in systems.values():
        system["engine"]["max_num_seqs"] = args.batch
    rates: dict[str, list[float]] = {name: [] for name in ("engine alone", *systems)}
    cpu_us: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    with ServeCluster(num_cpus=8) as cluster:  # logical CPUs: one a worker
        urls = cluster.deploy(systems)
        for name in systems:  # warm-up: each system's first HTTP requests
            _over_http(urls[name], _requests(args, vocab, seed=-1)[:4])
        engine_rate(llm, [r.prompt_ids for r in _requests(args, vocab, seed=-1)[:4]], args.output_tokens)
        for repeat in range(args.repeats):
            order = ["engine alone", *systems]
            order = order[repeat % len(order):] + order[: repeat % len(order)]
            for name in order:
                requests = _requests(args, vocab, seed=repeat)
                if name == "engine alone":
                    rate = engine_rate(llm, [r.prompt_ids for r in requests], args.output_tokens)
                else:
                    rate, cpu = _over_http(urls[name], requests)
                    cpu_us[name].append(cpu)
                rates[name].append(rate)
                print(f"round {repeat + 1}: {name}: {rate:.0f} tokens/s", flush=True)
    summary = {name: report.spread(values) for name, values in rates.items()}
    alone = summary["engine alone"]["median"]
    report.print_table(
        f"Steady decode rate, batch {args.batch}, {args.prompt_tokens}-token prompts, {args.output_tokens} tokens out, "
        f"median of {args.repeats} (tokens/s)",
        ["path", "tokens/s", "min", "max", "of the engine alone"],
        [[name, s["median"], s["min"], s["max"], report.fmt_ratio(s["median"] / alone)] for name, s in summary.items()],
    )
    roles = [role for role in [*ROLES, "client"] if any(run.get(role) for runs in cpu_us.values() for run in runs)]
    if roles:
        report.print_table(
            "CPU a delivered token, by process role, median (us; the whole run, prefill included)",
            ["system", *roles, "total"],
            [[name, *[report.median([run[role] for run in runs]) for role in roles],
              report.median([sum(run.values()) for run in runs])] for name, runs in cpu_us.items()],
        )
    report.write_json(args.out, {"args": vars(args) | {"func": None}, "rates": rates, "summary": summary,
                                 "cpu_us_a_token": cpu_us})
    share = summary["disaggregated"]["median"] / alone
    print(report.headline("delivery", f"a decode worker delivers {share:.2f}x of its engine's decode rate over HTTP",
                          "close to 1x"))
