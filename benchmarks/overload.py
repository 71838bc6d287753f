"""Overload: does early rejection keep the admitted requests within their SLO when
the offered load is twice what the system can serve? Plus the scheduler's overhead.

    tandem bench overload [--quick] [--out FILE.json]

System: disaggregated 1 P + 1 D, a long-tailed chat mix of prompt and output
lengths (Poisson arrivals). Steps, in one Ray cluster:
1. Deploy `no-admission` (`slo.early_rejection: false`); calibrate on it as
   `tandem bench serve` does (isolated TTFT and TBT of a median request; SLO =
   scale x isolated, or fixed with `--ttft-slo-ms` and `--tbt-slo-ms`, so that the
   two sides of an A/B share it). Deploy `admission` (early rejection on) with that
   SLO.
2. Capacity: a rate sweep on `no-admission`; capacity C = its goodput (DistServe:
   the highest rate at which the attainment target is met). When the crossing lies
   outside the sweep, up to two more rates are tried (x1.5 above, /2 below); if the
   lowest still misses, C is the lowest rate tried (an overestimate, flagged
   `below_sweep` in the JSON).
3. At C and at 2C, both apps in turn on the same workload. Reported per run:
   rejected fraction, attainment of all offered requests, attainment of admitted
   ones, goodput (attaining requests per second of the offered window).
   Goals at 2C with admission: attainment of admitted requests >= 90% and goodput
   >= 80% of the goodput of `no-admission` at C.
4. Scheduler overhead: on the tiny model, a one-token request timed through HTTP
   (`/generate`, non-streaming, keep-alive) against the same request driven directly
   on the same P and D from this process (`DisaggregatedCall`, handles from the pool
   manager); fresh prompts each time (no cache hits), alternated. Overhead = median
   of the paired differences (goal <= 10 ms).

Output: the JSON at `--out` and the tables in `<stem>.md` beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from benchmarks import report
from benchmarks import workload as wl
from benchmarks.arguments import arch, attainment_target, positive_float, positive_int, preset, rates

MAX_EXTENSIONS = 2  # extra sweep rates when the capacity is outside the first sweep
RUN_HEADERS = ["app", "load", "rate req/s", "requests", "rejected", "attainment (offered)", "attainment (admitted)",
               "goodput req/s", "TTFT p99 s", "TBT p99 ms"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny model, fixed rates: a smoke run")
    parser.add_argument("--preset", type=preset, default=None, help="model preset (default: bench; tiny with --quick)")
    parser.add_argument("--arch", type=arch, default="qwen2")
    parser.add_argument("--rates", type=rates, default=None, help="capacity sweep rates, req/s (default: calibrated)")
    parser.add_argument("--capacity", type=positive_float, default=None, help="skip the sweep: capacity in req/s")
    parser.add_argument("--window-s", type=positive_float, default=None,
                        help="offered window per run (default 50, quick 4)")
    parser.add_argument("--run-window-s", type=positive_float, default=None,
                        help="offered window of the 1x and 2x runs (default: --window-s)")
    parser.add_argument("--min-requests", type=positive_int, default=5)
    parser.add_argument("--ttft-scale", type=positive_float, default=4.0)
    parser.add_argument("--ttft-slo-ms", type=positive_float, default=None,
                        help="TTFT SLO (default: --ttft-scale x isolated); fixed, so A/B runs share it")
    parser.add_argument("--tbt-slo-ms", type=positive_float, default=None,
                        help="TBT SLO (default: --tbt-scale x isolated)")
    parser.add_argument("--tbt-scale", type=positive_float, default=2.0)
    parser.add_argument("--attainment", type=attainment_target, default=0.9)
    parser.add_argument("--kv-cache-mib", type=positive_int, default=512)
    parser.add_argument("--overhead-pairs", type=positive_int, default=40, help="HTTP/direct pairs for the overhead")
    parser.add_argument("--overhead-only", action="store_true", help="measure only the scheduler overhead")
    parser.add_argument("--seed", type=int, default=0)


def chat_lengths(quick: bool) -> wl.ChatMix:
    if quick:
        return wl.ChatMix(prompt_median=192, output_median=16, sigma=0.7, prompt_range=(16, 768), output_range=(4, 64))
    return wl.ChatMix(prompt_median=384, output_median=64, sigma=0.7, prompt_range=(32, 1536), output_range=(16, 256))


def _runs(urls, workloads, slo, names) -> dict:
    from benchmarks.serve import run
    from benchmarks.serving_metrics import summarize

    out = {}
    for load, (rate, work) in workloads.items():
        for name in names:
            records = run(urls[name], work, progress=f"{name} @ {load} ({rate:.3g} req/s)")
            out[(name, load)] = {"rate": rate, **summarize(records, slo, len(work.requests) / rate)}
    return out


# ---- scheduler overhead ---------------------------------------------------------------
def measure_overhead(cluster, num_pairs: int) -> dict:
    from benchmarks.serve_scenarios import TINY_VOCAB, app_settings

    args = argparse.Namespace(preset="tiny", arch="qwen2", kv_cache_mib=64)
    url = cluster.deploy({"overhead": app_settings(args, mode="disaggregated")})["overhead"]
    members = cluster.members("overhead")
    prefill = next(m.handle for m in members if m.role == "prefill")
    decode = next(m.handle for m in members if m.role == "decode")
    http_s, direct_s = asyncio.run(_overhead_pairs(url, prefill, decode, num_pairs, TINY_VOCAB))
    cluster.undeploy("overhead")
    paired = [h - d for h, d in zip(http_s, direct_s)]
    return {"num_pairs": len(paired), "http_s": report.spread(http_s), "direct_s": report.spread(direct_s),
            "overhead_ms": report.median(paired) * 1e3, "overhead_p90_ms": report.percentile(paired, 90) * 1e3}


async def _overhead_pairs(url, prefill, decode, num_pairs, vocab, warm_up: int = 5):
    import random

    import httpx

    from actors.messages import GenerateRequest
    from actors.sampling_params import SamplingParams
    from cluster.pd_request import DisaggregatedCall

    rng = random.Random(7)
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    http_s, direct_s = [], []
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        for i in range(warm_up + num_pairs):
            prompt = wl.random_tokens(rng, 32, vocab)
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}
            started = time.perf_counter()
            response = await client.post(f"{url}/generate", json=body)
            http = time.perf_counter() - started
            response.raise_for_status()
            prompt = wl.random_tokens(rng, 32, vocab)
            call = DisaggregatedCall(prefill, decode, GenerateRequest(f"direct-{i}", prompt, params), "gloo")
            started = time.perf_counter()
            async for _ in call.events():
                pass
            direct = time.perf_counter() - started
            if i >= warm_up:
                http_s.append(http)
                direct_s.append(direct)
    return http_s, direct_s


# ---- main ----------------------------------------------------------------------------
def _deploy_both(cluster, args, vocab: int, lengths: wl.ChatMix):
    """`no-admission`, calibrated; then `admission` with the SLO the calibration gives
    (or the one given)."""
    from benchmarks.serve import calibrate, warm_up
    from benchmarks.serve_scenarios import app_settings
    from benchmarks.serving_metrics import Slo

    print(f"deploying no-admission ({args.preset} model) ...", flush=True)
    plain = app_settings(args, mode="disaggregated")
    urls = cluster.deploy({"no-admission": plain})
    warm_up(urls, {"no-admission": plain}, vocab)
    calibration = calibrate(urls["no-admission"], (lengths.prompt_median, lengths.output_median), 3, vocab)
    ttft_s = args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else args.ttft_scale * calibration["isolated_ttft_s"]
    tbt_s = args.tbt_slo_ms / 1e3 if args.tbt_slo_ms else args.tbt_scale * calibration["isolated_tbt_s"]
    slo = Slo(ttft_s, tbt_s, args.attainment)
    admitting = app_settings(args, mode="disaggregated", slo={
        "ttft_ms": slo.ttft_s * 1e3, "tbt_ms": slo.tbt_s * 1e3, "attainment": slo.attainment, "early_rejection": True})
    urls.update(cluster.deploy({"admission": admitting}))
    warm_up({"admission": urls["admission"]}, {"admission": admitting}, vocab)
    print(f"SLO TTFT {slo.ttft_s:.3g} s, TBT {slo.tbt_s * 1e3:.3g} ms", flush=True)
    return urls, calibration, slo


def _capacity(url: str, args, slo, make, isolated_ttft_s: float):
    """(capacity req/s, how it was found, the sweep's summaries)."""
    from benchmarks.serve import run
    from benchmarks.serving_metrics import goodput, summarize

    if args.capacity is not None:
        return args.capacity, {"rate": args.capacity, "kind": "given"}, []
    rates = ([float(r) for r in args.rates.split(",")] if args.rates
             else [round(m / isolated_ttft_s, 4) for m in (0.3, 0.5, 0.7, 0.9)])
    sweep = []

    def measure(rate: float) -> None:
        work = make(rate, args.seed + 100 * (len(sweep) + 1))
        records = run(url, work, progress=f"capacity @ {rate:.3g} req/s")
        sweep.append({"rate": rate, **summarize(records, slo, len(work.requests) / rate)})

    for rate in rates:
        measure(rate)
    found = goodput([(s["rate"], s["attainment"]) for s in sweep], slo.attainment)
    for _ in range(MAX_EXTENSIONS):  # the capacity lies outside the sweep: extend it
        if found.kind == "interpolated":
            break
        edge = max(s["rate"] for s in sweep) if found.kind == "above_sweep" else min(s["rate"] for s in sweep)
        measure(round(edge * 1.5 if found.kind == "above_sweep" else edge / 2, 4))
        found = goodput([(s["rate"], s["attainment"]) for s in sweep], slo.attainment)
    if found.kind == "below_sweep":
        return min(s["rate"] for s in sweep), found.as_dict(), sweep
    return found.rate, found.as_dict(), sweep


def _tables(runs: dict, overhead: dict, capacity: float, slo) -> str:
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    rows = [[name, load, r["rate"], r["num_requests"], r["rejected_fraction"], r["attainment"],
             r["attainment_admitted"], r["goodput_req_s"], r["ttft_s"]["p99"], ms(r["tbt_s"]["p99"])]
            for (name, load), r in runs.items()]
    http, direct = overhead["http_s"], overhead["direct_s"]
    return "\n".join([
        f"### overload (capacity {capacity:.3g} req/s; SLO TTFT {slo.ttft_s:.3g} s, TBT {slo.tbt_s * 1e3:.3g} ms "
        f"mean, target {slo.attainment:.0%})", "", report.markdown_table(RUN_HEADERS, rows), "",
        "### scheduler overhead (tiny model, one token)", "",
        report.markdown_table(["path", "median ms", "min ms", "max ms"], [
            ["HTTP /generate", ms(http["median"]), ms(http["min"]), ms(http["max"])],
            ["direct DisaggregatedCall", ms(direct["median"]), ms(direct["min"]), ms(direct["max"])],
            ["overhead (paired median)", overhead["overhead_ms"], None, None]]),
    ])


def main(args: argparse.Namespace) -> None:
    from benchmarks.serve import resolve_defaults
    from benchmarks.serve_cluster import ServeCluster
    from benchmarks.serve_scenarios import BENCH_VOCAB, TINY_VOCAB

    args.rates = args.rates or ("2,4,8" if args.quick else None)
    resolve_defaults(args)
    vocab = TINY_VOCAB if args.preset == "tiny" else BENCH_VOCAB
    lengths = chat_lengths(args.quick)

    def make(rate: float, seed: int, window_s: float | None = None) -> wl.Workload:
        num_requests = max(args.min_requests, round(rate * (window_s or args.window_s)))
        return wl.poisson("chat-mix", rate, num_requests, lengths, vocab, seed)

    if args.overhead_only:
        with ServeCluster() as cluster:
            overhead = measure_overhead(cluster, args.overhead_pairs)
        report.finish("overload", args.out, {"overhead": overhead, "machine": report.machine_info()},
                      f"scheduler overhead {overhead['overhead_ms']:.1f} ms (HTTP {overhead['http_s']['median'] * 1e3:.1f} "
                      f"ms, direct {overhead['direct_s']['median'] * 1e3:.1f} ms)", "<= 10 ms")
        return
    with ServeCluster() as cluster:
        urls, calibration, slo = _deploy_both(cluster, args, vocab, lengths)
        capacity, capacity_info, sweep = _capacity(urls["no-admission"], args, slo, make,
                                                   calibration["isolated_ttft_s"])
        print(f"capacity {capacity:.3g} req/s ({capacity_info['kind']})", flush=True)
        window = args.run_window_s
        loads = {"1x": (capacity, make(capacity, args.seed + 7, window)),
                 "2x": (2 * capacity, make(2 * capacity, args.seed + 8, window))}
        runs = _runs(urls, loads, slo, ["admission", "no-admission"])
        for name in urls:  # their idle schedulers and pool managers still poll: not on the overhead's cores
            cluster.undeploy(name)
        overhead = measure_overhead(cluster, args.overhead_pairs)
    text = _tables(runs, overhead, capacity, slo)
    print("\n" + text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    at_2x, reference = runs[("admission", "2x")], runs[("no-admission", "1x")]
    goodput_share = report.ratio(at_2x["goodput_req_s"], reference["goodput_req_s"])
    figure = (f"at 2x capacity admitted attainment {at_2x['attainment_admitted']:.0%} "
              f"(without admission {runs[('no-admission', '2x')]['attainment']:.0%}), goodput "
              f"{report.fmt_ratio(goodput_share)} of capacity, scheduler overhead {overhead['overhead_ms']:.1f} ms")
    payload = {"quick": args.quick, "preset": args.preset, "capacity_req_s": capacity, "capacity": capacity_info,
               "capacity_sweep": sweep, "calibration": calibration,
               "slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s, "attainment": slo.attainment, "tbt_stat": slo.tbt_stat},
               "runs": {f"{name}@{load}": r for (name, load), r in runs.items()}, "goodput_share_2x": goodput_share,
               "table": str(out.with_suffix(".md")), "overhead": overhead, "machine": report.machine_info()}
    report.finish("overload", out, payload, figure, ">= 90% admitted, >= 0.80x goodput, <= 10 ms overhead")
