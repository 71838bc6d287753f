"""The systems and workloads each `tandem bench serve --scenario` compares.

All systems of a scenario get the same cores (`num_cpus` 1 per worker) and run the
same seeded workload at each rate. Early rejection is off in these scenarios: every
request is served, so attainment measures the system, not the admission policy.

- `disagg-vs-colocated` (2 cores): `disaggregated` 1 P + 1 D over gloo, against
  `colocated` (2 workers, prefill unchunked: `prefill_chunk_size` and
  `max_num_batched_tokens` above the longest prompt) and `colocated-chunked`
  (2 workers, prefill in small chunks mixed with decode steps). Long prompts
  (1k-2k tokens) with long decodes (128-256 tokens). The colocated systems route
  round-robin, the simplest fair spread over two equal workers (the load- and
  cache-aware policies used to tie a busy colocated worker with an idle one; the
  in-flight count now breaks that tie, see cluster/router.py).
- `channels`: disaggregated 1 P + 1 D, KV over `gloo` against `object_store`.
- `routing` (3 workers): 2 P + 1 D with `round_robin`, `least_load` and
  `cache_aware` routing, on multi-turn conversations that share a system prompt
  and extend their own previous turn: prefix hits on the P that served the
  previous turn cut TTFT.

`--quick` swaps in the tiny model, shorter requests and two fixed rates: a smoke
run of the whole pipeline, not a measurement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from benchmarks import workload as wl

SCENARIOS = ("disagg-vs-colocated", "channels", "routing")
TINY_VOCAB, BENCH_VOCAB = 2048, 8192


@dataclass(frozen=True)
class Scenario:
    name: str
    systems: dict[str, dict]  # label -> app settings (cluster.config.AppSettings)
    baseline: str  # SLOs are calibrated on it; ratios are against it
    contender: str  # the system the headline is about
    make_workload: Callable[[float, int, int, float], wl.Workload]  # (req/s, num requests, seed, think_s)
    probe_lengths: tuple[int, int]  # (prompt, output) of the isolated calibration requests
    rate_multipliers: tuple[float, ...]  # of 1 / isolated TTFT, when no --rates are given
    goal: str


def app_settings(args, *, mode: str, channel: str = "gloo", routing: str = "cache_aware", prefill: int = 1,
                 decode: int = 1, colocated: int = 0, chunk: int = 256, batched: int = 1024,
                 slo: dict | None = None) -> dict:
    """Settings for `cluster.app.build_app`; one CPU per worker."""
    pool = lambda replicas: {"replicas": replicas, "num_cpus": 1}  # noqa: E731
    return {
        "model": {"preset": args.preset, "arch": args.arch},
        "mode": mode,
        "channel": channel,
        "routing": routing,
        "engine": {"block_size": 16, "kv_cache_bytes": args.kv_cache_mib * 2**20, "max_num_seqs": 64,
                   "prefill_chunk_size": chunk, "max_num_batched_tokens": batched},
        "prefill": pool(prefill), "decode": pool(decode), "colocated": pool(colocated),
        "slo": slo or {"early_rejection": False},
        "limits": {"max_prompt_tokens": 8000, "max_new_tokens": 2048, "request_timeout_s": 900},
    }


def worker_count(settings: dict) -> int:
    roles = ("colocated",) if settings["mode"] == "colocated" else ("prefill", "decode")
    return sum(settings[role]["replicas"] for role in roles)


def _independent(name: str, lengths, vocab: int):
    def make(rate: float, num_requests: int, seed: int, think_s: float) -> wl.Workload:
        return wl.poisson(name, rate, num_requests, lengths, vocab, seed)

    return make


def _conversations(name: str, vocab: int, turns: int, system_tokens: int, user: tuple, reply: tuple):
    def make(rate: float, num_requests: int, seed: int, think_s: float) -> wl.Workload:
        return wl.multi_turn(name, max(1, num_requests // turns), turns, rate / turns, vocab, seed,
                             system_tokens=system_tokens, user_tokens=user, reply_tokens=reply, think_s=think_s)

    return make


def build_scenario(name: str, args) -> Scenario:
    vocab = TINY_VOCAB if args.preset == "tiny" else BENCH_VOCAB
    if name == "disagg-vs-colocated":
        prompts, outputs = ((256, 1024), (16, 32)) if args.quick else ((1024, 2048), (128, 256))
        longest = prompts[1] + outputs[1]
        systems = {
            "colocated": app_settings(args, mode="colocated", routing="round_robin", colocated=2, chunk=8192,
                                      batched=8192 + 64),
            "colocated-chunked": app_settings(args, mode="colocated", routing="round_robin", colocated=2,
                                              chunk=args.chunk, batched=args.chunk + 64),
            "disaggregated": app_settings(args, mode="disaggregated"),
        }
        assert longest < 8192
        return Scenario(name, systems, "colocated", "disaggregated",
                        _independent("long-prompts", wl.Uniform(prompts, outputs), vocab),
                        (sum(prompts) // 2, sum(outputs) // 2), (0.4, 0.7, 1.0, 1.3),
                        "goodput >= 1.3x colocated, p99 TBT >= 3x lower")
    if name == "channels":
        prompts, outputs = ((128, 512), (8, 16)) if args.quick else ((512, 1536), (32, 64))
        systems = {channel: app_settings(args, mode="disaggregated", channel=channel)
                   for channel in ("gloo", "object_store")}
        return Scenario(name, systems, "gloo", "object_store",
                        _independent("channels", wl.Uniform(prompts, outputs), vocab),
                        (sum(prompts) // 2, sum(outputs) // 2), (0.3, 0.6, 0.9), "report")
    if name == "routing":
        system_tokens, user, reply = (128, (16, 48), (8, 16)) if args.quick else (512, (64, 128), (32, 64))
        systems = {policy: app_settings(args, mode="disaggregated", routing=policy, prefill=2)
                   for policy in ("round_robin", "least_load", "cache_aware")}
        return Scenario(name, systems, "round_robin", "cache_aware",
                        _conversations("multi-turn", vocab, 4, system_tokens, user, reply),
                        (system_tokens + 2 * sum(user) // 2, sum(reply) // 2), (0.5, 1.0, 1.5),
                        "cache_aware p50 TTFT below round_robin")
    raise ValueError(f"unknown scenario {name!r}; choose one of {SCENARIOS}")
