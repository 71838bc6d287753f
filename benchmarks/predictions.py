"""Predictions: how close admission's predicted TTFT and TBT come to those observed.

    tandem bench predictions [--bursts 8] [--size 16] [--lengths 64,512,1800] [--out FILE.json]

System: disaggregated 1 P + 1 D, tiny model, a KV pool far larger than the load,
early rejection off (every request is served, so every prediction is checked).
The global scheduler runs in this process (benchmarks/scheduler_driver.py: the
deployment's `GlobalScheduler`, without Serve's HTTP hop), its
`WorkerModels.observe_ttft` and `observe_tbt` wrapped to keep what the scheduler
hands them at each first token and each finished request: the prediction the
request was admitted on and the TTFT (the mean gap between tokens) it then
took. Workload: `--bursts` bursts of `--size` short requests started at the same
instant (fresh random prompts, so no prefix hits, after `--shared-prefix` tokens
every prompt begins with), `--every-s` apart; one burst
first as a warm-up, not counted. With `--lengths`, the prompts take those
lengths in turn (in place of `--prompt`), and a second table gives the
same figures by prompt length: a model that sees what a prompt's length costs
leaves residuals flat across lengths too (with `--size 1`, one request at a
time, that is P's prefill model alone).

Reported, by a request's place in its burst (admission order): the median
predicted TTFT without the learned bias (the model: queue, prefill, transfer, D's
line), the median observed TTFT, and the median residual (observed less model);
over all requests, the residuals' 10th, 50th and 90th percentiles, their slope
against the place in the burst (least squares, ms a request ahead), and the mean
absolute error of the whole prediction (bias included), and the share of
requests whose TTFT came within it (with the bias, the `slo.attainment` quantile
of the residuals, about 0.9 is calibrated). A model that sees P's queue as it is
leaves residuals flat across a burst, a latency the bias then covers once; a
slope is what each request ahead costs beyond what the model says. The same for
TBT, over all requests: D's step model predicted at admission for when the
request joins D's batch, against the request's mean gap between tokens; the
share within the model alone (a mean: about half) and within the prediction
(D's learned TBT bias added).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time
from dataclasses import dataclass

from benchmarks import report
from benchmarks.arguments import positive_ints
from benchmarks.bursts import add_burst_arguments, shared_prefix


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_burst_arguments(parser, num_bursts=8, every_s=2.0)
    parser.add_argument("--lengths", type=positive_ints, default=None,
                        help="prompt lengths the requests take in turn (comma-separated; in place of --prompt)")


@dataclass(frozen=True)
class Observed:
    admitted_s: float  # monotonic
    num_prompt_tokens: int
    predicted_s: float  # the whole prediction, bias included
    bias_s: float
    observed_s: float

    @property
    def model_s(self) -> float:
        return self.predicted_s - self.bias_s

    @property
    def residual_s(self) -> float:
        return self.observed_s - self.model_s


def main(args: argparse.Namespace) -> None:
    import ray

    from actors.model_builder import ensure_checkpoint
    from benchmarks.scheduler_driver import run_with_pool
    from benchmarks.serve_scenarios import TINY_VOCAB, app_settings

    ensure_checkpoint("tiny", "qwen2")
    settings = app_settings(argparse.Namespace(preset="tiny", arch="qwen2", kv_cache_mib=0), mode="disaggregated")
    settings["engine"] = {"block_size": 16, "num_kv_blocks": 1024, "max_num_seqs": 64, "prefill_chunk_size": 256,
                          "max_num_batched_tokens": 1024}
    settings["pool_name"] = "bench-predictions-pool"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        bursts, tbts = run_with_pool(settings, lambda pool, app: _drive(pool, app, args, TINY_VOCAB))
    finally:
        ray.shutdown()
    places = [[b[k] for b in bursts if k < len(b)] for k in range(args.size)]
    rows = [[place, len(seen), *_medians_ms(seen)] for place, seen in enumerate(places)]
    every = [o for b in bursts for o in b]
    lengths = sorted({o.num_prompt_tokens for o in every})
    by_length = [[n, len(seen), *_medians_ms(seen)]
                 for n in lengths for seen in [[o for o in every if o.num_prompt_tokens == n]]]
    residuals = [o.residual_s for o in every]
    slope_ms = _slope([(place, o.residual_s) for b in bursts for place, o in enumerate(b)]) * 1e3
    summary = {"requests": len(every), "residual_p10_ms": report.percentile(residuals, 10) * 1e3,
               "residual_median_ms": report.median(residuals) * 1e3,
               "residual_p90_ms": report.percentile(residuals, 90) * 1e3,
               "residual_slope_ms_per_place": slope_ms,
               "mean_abs_error_ms": sum(abs(o.observed_s - o.predicted_s) for o in every) / len(every) * 1e3,
               "bias_median_ms": report.median([o.bias_s for o in every]) * 1e3,
               "within_prediction": _within(every, "predicted_s")}
    tbt_residuals = [o.residual_s for o in tbts]
    tbt = {"requests": len(tbts), "residual_p10_ms": report.percentile(tbt_residuals, 10) * 1e3,
           "residual_median_ms": report.median(tbt_residuals) * 1e3,
           "residual_p90_ms": report.percentile(tbt_residuals, 90) * 1e3,
           "bias_median_ms": report.median([o.bias_s for o in tbts]) * 1e3,
           "within_model": _within(tbts, "model_s"), "within_prediction": _within(tbts, "predicted_s")}
    columns = ["requests", "model ms (median)", "observed ms (median)", "residual ms (median)"]
    tokens_in = ", ".join(map(str, args.lengths)) if args.lengths else args.prompt
    report.print_table(f"{args.bursts} bursts of {args.size} ({tokens_in} tokens in, {args.output} out), by place in "
                       "the burst", ["place", *columns], rows)
    if len(lengths) > 1:
        report.print_table("By prompt length", ["prompt tokens", *columns], by_length)
    report.print_table("All requests", list(summary), [list(summary.values())])
    report.print_table("TBT, all requests", list(tbt), [list(tbt.values())])
    report.finish("predictions", args.out, {"args": vars(args) | {"func": None}, "summary": summary,
                                            "by_place": rows, "by_length": by_length, "tbt": tbt},
                  f"residual slope {slope_ms:.1f} ms a place in the burst, residuals p10-p90 "
                  f"{summary['residual_p10_ms']:.0f} to {summary['residual_p90_ms']:.0f} ms",
                  "a flat slope (|slope| <= 2 ms a place)")


async def _drive(pool, settings, args, vocab: int) -> tuple[list[list[Observed]], list[Observed]]:
    """The bursts, each as the scheduler observed its first tokens, in admission
    order; and every counted request's TBT as the scheduler observed it."""
    from actors.sampling_params import SamplingParams
    from benchmarks.scheduler_driver import build_scheduler, complete, refreshing, wait_ready

    scheduler = build_scheduler(settings, pool)
    seen: list[Observed] = []
    observe = scheduler.view.models.observe_ttft

    def observe_and_keep(prediction, observed_s: float) -> None:
        seen.append(Observed(time.monotonic() - observed_s, prediction.uncached_tokens, prediction.ttft_s,
                             prediction.ttft_bias_s, observed_s))
        observe(prediction, observed_s)

    scheduler.view.models.observe_ttft = observe_and_keep  # the real method, its arguments kept on the way
    tbts: list[Observed] = []
    observe_tbt = scheduler.view.models.observe_tbt

    def observe_tbt_and_keep(prediction, observed_s: float) -> None:
        tbts.append(Observed(time.monotonic(), prediction.uncached_tokens, prediction.tbt_s, prediction.tbt_bias_s,
                             observed_s))
        observe_tbt(prediction, observed_s)

    scheduler.view.models.observe_tbt = observe_tbt_and_keep
    params = SamplingParams(max_new_tokens=args.output, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    lengths = itertools.cycle(args.lengths or [args.prompt])
    shared = shared_prefix(args, vocab)
    bursts = []
    async with refreshing(scheduler):
        await wait_ready(scheduler, timeout_s=300)
        for burst in range(args.bursts + 1):  # the first: a warm-up
            seen.clear()
            num_tbts = len(tbts)
            prompts = [shared + [rng.randrange(3, vocab) for _ in range(next(lengths))] for _ in range(args.size)]
            results = await asyncio.gather(*(complete(scheduler, prompt, params) for prompt in prompts))
            failed = [error for _, error in results if error]
            if failed:
                raise RuntimeError(f"{len(failed)} requests of burst {burst} failed: {failed[0]}")
            if burst:
                bursts.append(sorted(seen, key=lambda o: o.admitted_s))
            else:
                del tbts[num_tbts:]
            await asyncio.sleep(args.every_s)
    return bursts, tbts


def _medians_ms(seen: list[Observed]) -> list[float]:
    return [report.median([getattr(o, name) for o in seen]) * 1e3 for name in ("model_s", "observed_s", "residual_s")]


def _within(seen: list[Observed], predicted: str) -> float:
    """The share of requests whose observed figure came within `predicted` (an attribute)."""
    return sum(o.observed_s <= getattr(o, predicted) for o in seen) / len(seen)


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y on x."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
