"""Serving under load over HTTP: TTFT/TBT percentiles, SLO attainment and goodput
against offered rate, for the systems of a scenario (`benchmarks/serve_scenarios.py`).

    tandem bench serve --scenario disagg-vs-colocated [--quick] [--out FILE.json]

Steps, in one Ray cluster holding every system of the scenario (`ServeCluster`):
1. Deploy all systems; warm each up with one request per worker.
2. Calibrate on the baseline: isolated requests (one in flight) of the scenario's
   probe lengths give the isolated TTFT and mean TBT. Unless given explicitly, the
   SLOs are `--ttft-scale` x isolated TTFT and `--tbt-scale` x isolated TBT (as
   DistServe scales SLOs from single-request latency), and the rates swept are the
   scenario's multipliers of 1 / isolated TTFT (one core's prefill rate).
3. Sweep: for each rate, one seeded Poisson workload (`--window-s` x rate requests,
   at least `--min-requests`), run on every system in turn, the order rotating per
   rate (A/B/C, B/C/A, ...), each run drained before the next.
4. Metrics per run and goodput per system (`benchmarks/serving_metrics.py`), for
   each per-request TBT statistic; the headline uses `--tbt-stat`.

Output: the JSON at `--out`; beside it `<stem>.md` (the tables) and the plots
`<stem>_cdf.png` (TTFT and TBT CDFs per rate) and `<stem>_goodput.png`
(attainment and p99 TBT against rate). The p99-TBT ratio in the headline is taken
at the contender's operating point: the highest rate at which it met the
attainment target (the lowest rate if none).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from benchmarks import report
from benchmarks.arguments import arch, attainment_target, positive_float, positive_int, preset, rates
from benchmarks.serve_scenarios import SCENARIOS, Scenario, build_scenario

RUN_HEADERS = ["system", "rate req/s", "requests", "ok", "TTFT p50 s", "TTFT p99 s", "TBT p50 ms", "TBT p99 ms",
               "request TBT p90 ms", "cached", "attainment", "tok/s"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", choices=SCENARIOS, default="disagg-vs-colocated")
    parser.add_argument("--quick", action="store_true", help="tiny model, short requests, two rates: a smoke run")
    parser.add_argument("--preset", type=preset, default=None, help="model preset (default: bench; tiny with --quick)")
    parser.add_argument("--arch", type=arch, default="qwen2")
    parser.add_argument("--rates", type=rates, default=None, help="comma-separated offered rates in req/s (default: calibrated)")
    parser.add_argument("--window-s", type=positive_float, default=None,
                        help="offered window per run (default 50, quick 4)")
    parser.add_argument("--min-requests", type=positive_int, default=5, help="requests per run at least")
    parser.add_argument("--ttft-slo-ms", type=positive_float, default=None,
                        help="TTFT SLO (default: --ttft-scale x isolated)")
    parser.add_argument("--tbt-slo-ms", type=positive_float, default=None,
                        help="TBT SLO (default: --tbt-scale x isolated)")
    parser.add_argument("--ttft-scale", type=positive_float, default=3.0)
    parser.add_argument("--tbt-scale", type=positive_float, default=2.0)
    parser.add_argument("--tbt-stat", choices=["mean", "p90", "max"], default="mean",
                        help="per-request TBT judged against the SLO")
    parser.add_argument("--attainment", type=attainment_target, default=0.9, help="attainment target for goodput")
    parser.add_argument("--chunk", type=positive_int, default=128, help="prefill chunk of colocated-chunked")
    parser.add_argument("--kv-cache-mib", type=positive_int, default=512, help="KV cache per worker")
    parser.add_argument("--probes", type=positive_int, default=3, help="isolated requests for calibration")
    parser.add_argument("--seed", type=int, default=0)


def resolve_defaults(args: argparse.Namespace) -> None:
    args.preset = args.preset or ("tiny" if args.quick else "bench")
    if args.window_s is None:
        args.window_s = 4.0 if args.quick else 50.0
    if args.quick and args.rates is None:
        args.rates = "2,4"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ---- driving the systems ------------------------------------------------------------
def run(url: str, workload, progress: str | None = None):
    from benchmarks.http_client import run_workload

    return asyncio.run(run_workload(url, workload, request_timeout_s=900.0, max_duration_s=3600.0, progress=progress))


def warm_up(urls: dict[str, str], systems: dict[str, dict], vocab: int) -> None:
    """One short request per worker of each system, sent together (so each worker gets one)."""
    from benchmarks import workload as wl
    from benchmarks.serve_scenarios import worker_count

    for name, url in urls.items():
        work = wl.build("warm-up", [0.0] * worker_count(systems[name]), wl.Fixed(64, 4), vocab, seed=10_000)
        records = run(url, work)
        failed = [r.error for r in records if r.status != "ok"]
        if failed:
            raise RuntimeError(f"{name}: warm-up failed: {failed[0]}")


def calibrate(url: str, probe_lengths: tuple[int, int], num_probes: int, vocab: int) -> dict:
    """Isolated TTFT and mean TBT (medians over probes, one request in flight)."""
    from benchmarks import workload as wl
    from benchmarks.serving_metrics import request_tbt_s

    ttfts, tbts = [], []
    for i in range(num_probes):
        (record,) = run(url, wl.build("probe", [0.0], wl.Fixed(*probe_lengths), vocab, seed=20_000 + i))
        if record.status != "ok":
            raise RuntimeError(f"calibration request failed: {record.error}")
        ttfts.append(record.ttft_s)
        tbts.append(request_tbt_s(record, "mean") or 0.0)
    return {"probe_lengths": probe_lengths, "isolated_ttft_s": report.median(ttfts),
            "isolated_tbt_s": report.median(tbts), "ttft_samples_s": ttfts, "tbt_samples_s": tbts}


def sweep(urls: dict[str, str], spec: Scenario, rates: list[float], args, think_s: float):
    """records[system][rate] for every run, systems in rotating order per rate."""
    from tqdm import tqdm

    names = list(urls)
    records: dict[str, dict[float, list]] = {name: {} for name in names}
    workloads = {}
    for i, rate in enumerate(rates):
        num_requests = max(args.min_requests, round(rate * args.window_s))
        workloads[rate] = spec.make_workload(rate, num_requests, args.seed + 1000 * (i + 1), think_s)
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            records[name][rate] = run(urls[name], workloads[rate], progress=f"{name} @ {rate:.3g} req/s")
            ok = sum(r.status == "ok" for r in records[name][rate])
            tqdm.write(f"  {name} @ {rate:.3g} req/s: {ok}/{len(records[name][rate])} ok")
    return records, workloads


# ---- results -------------------------------------------------------------------------
def analyse(spec: Scenario, records, workloads, slo) -> dict:
    from benchmarks.serving_metrics import TBT_STATS, goodput, summarize

    rates = sorted(workloads)
    runs = {name: {rate: summarize(by_rate[rate], slo, len(workloads[rate].requests) / rate) for rate in rates}
            for name, by_rate in records.items()}
    goodputs = {}
    for name, by_rate in runs.items():
        goodputs[name] = {stat: goodput([(rate, by_rate[rate]["attainment_by_tbt_stat"][stat]) for rate in rates],
                                        slo.attainment).as_dict() for stat in TBT_STATS}
    base, contender = spec.baseline, spec.contender
    stat = slo.tbt_stat
    # The last rate the contender met the target at before its first miss (goodput's walk): the highest met
    # anywhere, past a miss, put the ratios where the baseline was deep in overload
    at_rate = goodputs[contender][stat]["last_met"] or rates[0]
    ratios = {
        "goodput": report.ratio(goodputs[contender][stat]["rate"], goodputs[base][stat]["rate"]),
        "at_rate": at_rate,
        "p99_tbt": report.ratio(runs[base][at_rate]["tbt_s"]["p99"], runs[contender][at_rate]["tbt_s"]["p99"]),
        "p50_ttft": report.ratio(runs[base][at_rate]["ttft_s"]["p50"], runs[contender][at_rate]["ttft_s"]["p50"]),
        "p99_tbt_per_rate": {rate: report.ratio(runs[base][rate]["tbt_s"]["p99"], runs[contender][rate]["tbt_s"]["p99"])
                             for rate in rates},
    }
    return {"runs": runs, "goodput": goodputs, "ratios": ratios}


def tables(spec: Scenario, analysis: dict, slo) -> str:
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    rows = []
    for name, by_rate in analysis["runs"].items():
        for rate, s in by_rate.items():
            rows.append([name, rate, s["num_requests"], s["status"].get("ok", 0),
                         s["ttft_s"]["p50"], s["ttft_s"]["p99"], ms(s["tbt_s"]["p50"]), ms(s["tbt_s"]["p99"]),
                         ms(s["request_tbt_s"][slo.tbt_stat]["p90"]), s["cached_fraction"], s["attainment"],
                         s["throughput_tok_s"]])
    text = [f"### serve: {spec.name} (SLO TTFT {slo.ttft_s:.3g} s, TBT {slo.tbt_s * 1e3:.3g} ms by request "
            f"{slo.tbt_stat}, target {slo.attainment:.0%})", "", report.markdown_table(RUN_HEADERS, rows), ""]
    stats = list(next(iter(analysis["goodput"].values())))
    headers = ["system"] + [f"goodput req/s (TBT {s})" for s in stats] + [f"vs {spec.baseline} ({slo.tbt_stat})"]
    base_rate = analysis["goodput"][spec.baseline][slo.tbt_stat]["rate"]
    grows = []
    for name, by_stat in analysis["goodput"].items():
        cells = [goodput_cell(g) for g in by_stat.values()]
        grows.append([name, *cells, report.fmt_ratio(report.ratio(by_stat[slo.tbt_stat]["rate"], base_rate))])
    text += [f"### serve: {spec.name} goodput (DistServe: highest rate meeting the {slo.attainment:.0%} target)", "",
             report.markdown_table(headers, grows)]
    return "\n".join(text)


def goodput_cell(g: dict) -> str:
    if g["kind"] == "above_sweep":
        return f">= {report.fmt(g['rate'])}"
    if g["kind"] == "below_sweep":
        return f"< {report.fmt(g['first_missed'])}"
    return report.fmt(g["rate"])


def plots(out: Path, spec: Scenario, records, analysis, slo) -> list[Path]:
    from benchmarks.serve_plots import cdf_plot, goodput_plot

    rates = sorted(next(iter(analysis["runs"].values())))
    samples = {name: {rate: {"ttft_s": [r.ttft_s for r in recs if r.status == "ok"],
                             "gaps_s": [g for r in recs if r.status == "ok" for g in r.gaps_s]}
                      for rate, recs in by_rate.items()} for name, by_rate in records.items()}
    curves = {name: [(rate, s["attainment"], s["tbt_s"]["p99"]) for rate, s in by_rate.items()]
              for name, by_rate in analysis["runs"].items()}
    goodputs = {name: g[slo.tbt_stat]["rate"] for name, g in analysis["goodput"].items()}
    title = f"{spec.name}: SLO TTFT {slo.ttft_s:.3g} s, TBT {slo.tbt_s * 1e3:.3g} ms ({slo.tbt_stat})"
    return [cdf_plot(out.with_name(out.stem + "_cdf.png"), rates, samples, slo.ttft_s, slo.tbt_s, title),
            goodput_plot(out.with_name(out.stem + "_goodput.png"), curves, goodputs, slo.attainment, title)]


def compact(records) -> dict:
    from benchmarks.serving_metrics import request_tbt_s

    fields = ["index", "status", "prompt_tokens", "output_tokens", "sent_s", "ttft_s", "mean_tbt_s", "max_gap_s",
              "cached_tokens"]
    return {name: {str(rate): {"fields": fields, "rows": [
        [r.index, r.status, r.num_prompt_tokens, r.num_output_tokens, r.sent_s, r.ttft_s, request_tbt_s(r, "mean"),
         request_tbt_s(r, "max"), r.num_cached_tokens] for r in recs]} for rate, recs in by_rate.items()}
        for name, by_rate in records.items()}


def choose_slo_and_rates(args, spec: Scenario, calibration: dict):
    from benchmarks.serving_metrics import Slo

    iso_ttft, iso_tbt = calibration["isolated_ttft_s"], calibration["isolated_tbt_s"]
    slo = Slo(ttft_s=args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else args.ttft_scale * iso_ttft,
              tbt_s=args.tbt_slo_ms / 1e3 if args.tbt_slo_ms else args.tbt_scale * iso_tbt,
              attainment=args.attainment, tbt_stat=args.tbt_stat)
    rates = ([float(r) for r in args.rates.split(",")] if args.rates
             else [round(m / iso_ttft, 4) for m in spec.rate_multipliers])
    # each run: its arrival window, then about one isolated request to drain
    drain_s = iso_ttft + spec.probe_lengths[1] * iso_tbt
    estimate_s = len(spec.systems) * sum(max(args.min_requests / r, args.window_s) + drain_s for r in rates)
    print(f"isolated TTFT {iso_ttft:.3g} s, TBT {iso_tbt * 1e3:.3g} ms -> SLO TTFT {slo.ttft_s:.3g} s, "
          f"TBT {slo.tbt_s * 1e3:.3g} ms; rates {rates} req/s; sweep takes about {estimate_s / 60:.1f} min",
          flush=True)
    return slo, rates


def write_results(args, spec: Scenario, calibration, slo, rates, records, workloads) -> None:
    analysis = analyse(spec, records, workloads, slo)
    text = tables(spec, analysis, slo)
    print("\n" + text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    images = plots(out, spec, records, analysis, slo)
    r = analysis["ratios"]
    figure = (f"{spec.contender}/{spec.baseline} goodput {report.fmt_ratio(r['goodput'])}, "
              f"p99 TBT {spec.baseline}/{spec.contender} {report.fmt_ratio(r['p99_tbt'])}, "
              f"p50 TTFT {spec.baseline}/{spec.contender} {report.fmt_ratio(r['p50_ttft'])} "
              f"at {r['at_rate']:.3g} req/s")
    payload = {
        "scenario": spec.name, "quick": args.quick, "preset": args.preset, "systems": spec.systems,
        "slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s, "attainment": slo.attainment, "tbt_stat": slo.tbt_stat},
        "calibration": calibration, "rates": rates,
        "workloads": {str(rate): w.describe() for rate, w in workloads.items()},
        "runs": {name: {str(rate): v for rate, v in by_rate.items()} for name, by_rate in analysis["runs"].items()},
        "goodput": analysis["goodput"], "ratios": analysis["ratios"],
        "table": str(out.with_suffix(".md")), "plots": [str(p) for p in images],
        "records": compact(records), "machine": report.machine_info(),
    }
    report.finish("serve", out, payload, f"{spec.name}: {figure}", spec.goal)


def main(args: argparse.Namespace) -> None:
    from benchmarks.serve_cluster import ServeCluster
    from benchmarks.serve_scenarios import BENCH_VOCAB, TINY_VOCAB, worker_count

    resolve_defaults(args)
    spec = build_scenario(args.scenario, args)
    vocab = TINY_VOCAB if args.preset == "tiny" else BENCH_VOCAB
    num_workers = sum(worker_count(settings) for settings in spec.systems.values())
    with ServeCluster(num_cpus=max(8, num_workers + 2)) as cluster:
        print(f"deploying {', '.join(spec.systems)} ({args.preset} model, {num_workers} workers) ...", flush=True)
        urls = cluster.deploy(spec.systems)
        warm_up(urls, spec.systems, vocab)
        calibration = calibrate(urls[spec.baseline], spec.probe_lengths, 2 if args.quick else args.probes, vocab)
        slo, rates = choose_slo_and_rates(args, spec, calibration)
        records, workloads = sweep(urls, spec, rates, args, think_s=max(0.5, 2 * calibration["isolated_ttft_s"]))
    write_results(args, spec, calibration, slo, rates, records, workloads)
