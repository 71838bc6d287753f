"""Autoscaling under a step of load: pool sizes, offered load and SLO attainment
over time; how fast a new worker serves after the SLO is breached; whether the
pools oscillate.

    tandem bench autoscale [--quick] [--out benchmarks/results/autoscale.json]

System: an autoscaling Ray cluster on this machine (autoscaler v2 with the fake
multi-node provider, benchmarks/fake_cluster.py): the head (no CPUs for workers:
Serve's proxy, the scheduler replica, the pool manager) and `prefill` / `decode`
node types labelled `tandem/role`, one CPU each, at most `--max-workers` nodes
each, none at the start. The Tandem app runs under Serve and is driven over HTTP.

Steps:
1. Calibrate: deploy a fixed 1 P + 1 D app, warm it up, time isolated requests
   of the median lengths: SLO TTFT = `--ttft-scale` x isolated TTFT, TBT =
   `--tbt-scale` x isolated TBT; the prefill backlog thresholds follow from the
   measured prefill rate (up: the prompt tokens one prefill worker clears in half
   the TTFT SLO; down: an eighth of that). Delete the app.
2. Deploy the autoscaled app: P and D pools start at 1 and may grow to
   `--max-workers`, early rejection off (every request is served, so attainment
   shows the system), the autoscaling knobs below; warm it up.
3. Step workload, open loop, seeded Poisson: `--low-rate` for `--low-s`, then
   `--high-rate` for `--high-s`, then `--low-rate` for `--after-s` (by default the
   rates are 0.3 and 1.3 x 1 / isolated TTFT: the high one is beyond what one
   prefill worker clears). Then no load until both pools are back at 1 (at most
   `--settle-s`).
4. Report (benchmarks/autoscale_timeline.py): per scale-up after the step, the
   SLO breach, decision, ready and serving times (goal: breach to the new worker
   serving <= 30 s); the most scale-downs within 60 s of a scale-up (goal <= 1);
   attainment per phase; the plot `<stem>.png` (pool sizes, offered load,
   attainment per `--bin-s` bin) and the tables `<stem>.md`.

`--quick`: the tiny model, fixed rates, short phases and short cooldowns: a smoke
run of the pipeline, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections import Counter
from pathlib import Path

from benchmarks import report
from benchmarks import workload as wl
from benchmarks.arguments import arch, attainment_target, non_negative_float, positive_float, positive_int, preset

ROLES = ("prefill", "decode")
PHASE_HEADERS = ["phase", "from s", "to s", "requests", "ok", "attainment", "TTFT p50 s", "TTFT p99 s",
                 "TBT p50 ms", "TBT p99 ms"]
REACTION_HEADERS = ["pool", "signal", "breach s", "decided s", "ready s", "serving s", "step to serving s",
                    "breach to serving s"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny model, short phases: a smoke run")
    parser.add_argument("--preset", type=preset, default=None, help="model preset (default: bench; tiny with --quick)")
    parser.add_argument("--arch", type=arch, default="qwen2")
    parser.add_argument("--low-rate", type=positive_float, default=None, help="req/s before and after the step")
    parser.add_argument("--high-rate", type=positive_float, default=None, help="req/s during the step")
    parser.add_argument("--low-s", type=non_negative_float, default=None,
                        help="seconds at the low rate first (default 30)")
    parser.add_argument("--high-s", type=positive_float, default=None, help="seconds at the high rate (default 90)")
    parser.add_argument("--after-s", type=non_negative_float, default=None,
                        help="seconds at the low rate after (default 30)")
    parser.add_argument("--settle-s", type=positive_float, default=None, help="longest wait for the pools to shrink")
    parser.add_argument("--max-workers", type=positive_int, default=2, help="most workers (and nodes) per pool")
    parser.add_argument("--ttft-scale", type=positive_float, default=4.0)
    parser.add_argument("--tbt-scale", type=positive_float, default=3.0)
    parser.add_argument("--attainment", type=attainment_target, default=0.9)
    parser.add_argument("--kv-cache-mib", type=positive_int, default=512)
    parser.add_argument("--bin-s", type=positive_float, default=5.0, help="bin width of the plot's load and attainment")
    parser.add_argument("--seed", type=int, default=0)


def resolve_defaults(args: argparse.Namespace) -> None:
    quick = args.quick
    args.preset = args.preset or ("tiny" if quick else "bench")
    for name, full, short in (("low_s", 30.0, 10.0), ("high_s", 90.0, 40.0), ("after_s", 30.0, 10.0),
                              ("settle_s", 240.0, 90.0)):
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    if quick:
        args.low_rate = args.low_rate or 2.0
        args.high_rate = args.high_rate or 12.0
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def lengths(args) -> wl.Uniform:
    """Prefill-heavy requests: the step is a prompt-token step."""
    if args.preset == "tiny":
        return wl.Uniform((1024, 1536), (4, 8))
    return wl.Uniform((384, 768), (8, 24))


def knobs(args, backlog_up_tokens: int) -> dict:
    """The autoscaling settings: Tandem's defaults, shorter windows for --quick."""
    backlog = {"prefill_backlog_up_tokens": backlog_up_tokens,
               "prefill_backlog_down_tokens": max(1, backlog_up_tokens // 8)}
    if args.quick:
        return {**backlog, "interval_s": 1.0, "window_s": 10.0, "scale_up_cooldown_s": 5.0,
                "scale_down_cooldown_s": 20.0, "drain_grace_s": 2.0}
    return backlog


def app_settings(args, *, name: str, autoscale: bool, slo: dict, autoscaling: dict | None = None) -> dict:
    def pool(role: str) -> dict:
        bounds = {"min_replicas": 1, "max_replicas": args.max_workers} if autoscale else {}
        return {"replicas": 1, **bounds, "num_cpus": 1, "label_selector": {"tandem/role": role}}

    return {
        "model": {"preset": args.preset, "arch": args.arch},
        "mode": "disaggregated", "channel": "gloo", "routing": "cache_aware",
        "engine": {"block_size": 16, "kv_cache_bytes": args.kv_cache_mib * 2**20, "max_num_seqs": 64,
                   "prefill_chunk_size": 256, "max_num_batched_tokens": 1024},
        "prefill": pool("prefill"), "decode": pool("decode"),
        "slo": slo, **({"autoscaling": autoscaling} if autoscaling else {}),
        "limits": {"max_prompt_tokens": 8000, "max_new_tokens": 2048, "request_timeout_s": 900},
        "pool_name": f"bench-pool-{name}",
    }


# ---- the cluster ------------------------------------------------------------------------
class AppOnFakeCluster:
    """Serve on a fake autoscaling cluster; apps deployed and deleted by name."""

    def __init__(self, args) -> None:
        from benchmarks.fake_cluster import FakeAutoscalingCluster, fake_node_type

        types = {role: fake_node_type({"CPU": 1}, {"tandem/role": role}, max_workers=args.max_workers)
                 for role in ROLES}
        self.cluster = FakeAutoscalingCluster(types, head_cpus=0, idle_timeout_s=10.0)
        self.port: int | None = None

    def __enter__(self) -> AppOnFakeCluster:
        import ray
        from ray import serve

        from benchmarks.serve_cluster import free_port

        self.cluster.__enter__()
        ray.init(address=self.cluster.address, log_to_driver=False)
        self.port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": self.port})
        return self

    def __exit__(self, *exc) -> None:
        from ray import serve

        try:
            serve.shutdown()
        finally:
            self.cluster.stop()

    def deploy(self, name: str, settings: dict, timeout_s: float = 600.0) -> str:
        from ray import serve

        from benchmarks.serve_cluster import wait_healthy
        from cluster.app import build_app

        serve.run(build_app(settings), name=name, route_prefix=f"/{name}", blocking=False)
        url = f"http://127.0.0.1:{self.port}/{name}"
        wait_healthy(url, timeout_s)
        return url

    def delete(self, name: str, pool_name: str) -> None:
        import ray
        from ray import serve

        serve.delete(name)
        pool = ray.get_actor(pool_name, namespace="tandem")
        ray.get(pool.shutdown.remote())
        ray.kill(pool)


def pool_manager(settings: dict):
    import ray

    return ray.get_actor(settings["pool_name"], namespace="tandem")


def wait_at_min(pool, settle_s: float) -> float | None:
    """Seconds until every pool is back to one serving worker with none starting
    or draining (from the scaling events); None if not within `settle_s`."""
    import ray

    from benchmarks.autoscale_timeline import pool_sizes, to_events

    started = time.monotonic()
    while time.monotonic() - started < settle_s:
        sizes = pool_sizes(to_events(ray.get(pool.scaling_events.remote()), 0.0), ROLES)
        if all(steps and steps[-1][1:] == (1, 0, 0) for steps in sizes.values()):
            return time.monotonic() - started
        time.sleep(1.0)
    return None


# ---- the run ------------------------------------------------------------------------------
def calibrate_slo(bench, args, vocab: int) -> tuple[dict, dict, int]:
    """(SLO settings, calibration, prefill backlog up threshold in tokens)."""
    from benchmarks.serve import calibrate, warm_up

    mix = lengths(args)
    probe = (sum(mix.prompt_range) // 2, sum(mix.output_range) // 2)
    fixed = app_settings(args, name="calibrate", autoscale=False, slo={"early_rejection": False})
    print(f"calibrating on a fixed 1 P + 1 D app ({args.preset} model) ...", flush=True)
    url = bench.deploy("calibrate", fixed)
    warm_up({"calibrate": url}, {"calibrate": fixed}, vocab)
    calibration = calibrate(url, probe, 2 if args.quick else 3, vocab)
    bench.delete("calibrate", fixed["pool_name"])
    iso_ttft, iso_tbt = calibration["isolated_ttft_s"], calibration["isolated_tbt_s"]
    slo = {"ttft_ms": args.ttft_scale * iso_ttft * 1e3, "tbt_ms": args.tbt_scale * iso_tbt * 1e3,
           "attainment": args.attainment, "early_rejection": False}
    # Tokens one prefill worker clears in half the TTFT SLO: the SLO is ttft_scale
    # isolated TTFTs of a median prompt, so that is ttft_scale / 2 median prompts.
    backlog_up = max(1, round(probe[0] * args.ttft_scale / 2))
    return slo, calibration, backlog_up


def summarize_phases(records, slo, phases: list[tuple[str, float, float]]) -> list[dict]:
    from benchmarks.serving_metrics import summarize

    out = []
    for name, start_s, end_s in phases:
        mine = [r for r in records if r.sent_s is not None and start_s <= r.sent_s < end_s]
        if mine:
            out.append({"phase": name, "from_s": start_s, "to_s": end_s, **summarize(mine, slo, end_s - start_s)})
    return out


def tables(phases: list[dict], reactions: list[dict], slo) -> str:
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    phase_rows = [[p["phase"], p["from_s"], p["to_s"], p["num_requests"], p["status"].get("ok", 0), p["attainment"],
                   p["ttft_s"]["p50"], p["ttft_s"]["p99"], ms(p["tbt_s"]["p50"]), ms(p["tbt_s"]["p99"])]
                  for p in phases]
    reaction_rows = [[r["role"], r["signal"], r["breach_s"], r["decided_s"], r["ready_s"], r["serving_s"],
                      r["step_to_serving_s"], r["breach_to_serving_s"]] for r in reactions]
    return "\n".join([
        f"### autoscale: phases (SLO TTFT {slo.ttft_s:.3g} s, TBT {slo.tbt_s * 1e3:.3g} ms mean, "
        f"target {slo.attainment:.0%})", "", report.markdown_table(PHASE_HEADERS, phase_rows), "",
        "### autoscale: scale-ups after the step (seconds from the workload's start)", "",
        report.markdown_table(REACTION_HEADERS, reaction_rows)])


def main(args: argparse.Namespace) -> None:
    import ray

    from benchmarks import autoscale_timeline as tl
    from benchmarks.serve import run, warm_up
    from benchmarks.serve_plots import autoscale_plot
    from benchmarks.serve_scenarios import BENCH_VOCAB, TINY_VOCAB
    from benchmarks.serving_metrics import Slo

    resolve_defaults(args)
    vocab = TINY_VOCAB if args.preset == "tiny" else BENCH_VOCAB
    load_before = report.machine_info().get("loadavg_1m")
    with AppOnFakeCluster(args) as bench:
        slo_settings, calibration, backlog_up = calibrate_slo(bench, args, vocab)
        iso_ttft = calibration["isolated_ttft_s"]
        args.low_rate = args.low_rate or round(0.3 / iso_ttft, 3)
        args.high_rate = args.high_rate or round(1.3 / iso_ttft, 3)
        settings = app_settings(args, name="autoscale", autoscale=True, slo=slo_settings,
                                autoscaling=knobs(args, backlog_up))
        slo = Slo(slo_settings["ttft_ms"] / 1e3, slo_settings["tbt_ms"] / 1e3, args.attainment)
        print(f"SLO TTFT {slo.ttft_s:.3g} s, TBT {slo.tbt_s * 1e3:.3g} ms; backlog up {backlog_up} tokens; "
              f"rates {args.low_rate} -> {args.high_rate} -> {args.low_rate} req/s", flush=True)
        url = bench.deploy("autoscale", settings)
        warm_up({"autoscale": url}, {"autoscale": settings}, vocab)
        pool = pool_manager(settings)
        levels = [(args.low_rate, args.low_s), (args.high_rate, args.high_s), (args.low_rate, args.after_s)]
        work = wl.build("step", wl.arrivals_steps(levels, random.Random(args.seed)), lengths(args), vocab,
                        args.seed + 1)
        print(f"step workload: {len(work.requests)} requests over {args.low_s + args.high_s + args.after_s:.0f} s",
              flush=True)
        t0_wall = time.time()
        records = run(url, work, progress="step workload")
        load_end_s = time.time() - t0_wall
        settled_after_s = wait_at_min(pool, args.settle_s)
        end_s = time.time() - t0_wall
        events = tl.to_events(ray.get(pool.scaling_events.remote()), t0_wall)
        bench.delete("autoscale", settings["pool_name"])

    step_s, back_s = args.low_s, args.low_s + args.high_s
    phases = summarize_phases(records, slo, [("low", 0.0, step_s), ("high", step_s, back_s),
                                             ("low again", back_s, back_s + args.after_s)])
    reactions = tl.reactions(events, records, slo, step_s)
    downs = tl.scale_downs_after_ups(events, 60.0)
    sizes = tl.pool_sizes(events, ROLES)
    rows = tl.bins(records, slo, args.bin_s, load_end_s)
    decisions = [(e.t_s, e.role, e.kind) for e in events if e.kind in ("up", "down")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    title = (f"autoscale ({args.preset}): {args.low_rate:.3g} -> {args.high_rate:.3g} -> {args.low_rate:.3g} req/s; "
             f"SLO TTFT {slo.ttft_s:.3g} s, TBT {slo.tbt_s * 1e3:.3g} ms")
    plot = autoscale_plot(out.with_suffix(".png"), sizes, rows, decisions, slo.attainment, end_s, title)
    text = tables(phases, reactions, slo)
    print("\n" + text)
    out.with_suffix(".md").write_text(text + "\n")

    first = {role: next((r for r in reactions if r["role"] == role and r["serving_s"] is not None), None)
             for role in ROLES}
    served = [f"{role} {r['breach_to_serving_s']:.1f} s" for role, r in first.items() if r]
    failed = sum(r.status != "ok" for r in records)
    failures = Counter(f"{r.status}: {(r.error or '')[:160]}" for r in records if r.status != "ok")
    figure = (f"breach to new worker serving: {', '.join(served) or 'no scale-up served'}; "
              f"scale-downs within 60 s of a scale-up: {max(downs.values(), default=0)}; "
              f"{len(records) - failed}/{len(records)} requests ok; back to min "
              f"{'in %.0f s' % settled_after_s if settled_after_s is not None else 'not within the settle time'}")
    payload = {
        "quick": args.quick, "preset": args.preset,
        "rates": {"low": args.low_rate, "high": args.high_rate},
        "phases_s": {"low": args.low_s, "high": args.high_s, "after": args.after_s},
        "slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s, "attainment": slo.attainment},
        "calibration": calibration, "settings": settings, "workload": work.describe(),
        "phases": phases, "reactions": reactions, "scale_downs_within_60s_of_up": downs,
        "settled_after_load_s": settled_after_s, "load_end_s": load_end_s,
        "num_failed": failed, "failures": dict(failures.most_common(10)), "bins": rows, "pool_sizes": sizes,
        "events": [e.__dict__ for e in events], "plot": str(plot), "table": str(out.with_suffix(".md")),
        "conditions": {"loadavg_1m_before": load_before, "loadavg_1m_after": report.machine_info().get("loadavg_1m")},
        "machine": report.machine_info(),
    }
    report.finish("autoscale", out, payload, figure, "breach to serving <= 30 s, <= 1 scale-down within 60 s")
