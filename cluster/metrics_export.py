"""A scheduler replica's counters and histograms, exported through Ray too
(`ray.util.metrics`), each series tagged with the replica that counted it.

Why: `GET /metrics` answers for the replica that takes the scrape, and the Serve
proxy hands each scrape to any replica. With one scheduler replica that is the
whole picture; with more, a counter read through the proxy jumps between the
replicas' values, and Prometheus takes every drop for a restart. Ray's metrics
agent on each node exports every actor's series on the node's metrics port (as
the pool manager's, cluster/pool_metrics.py), so there each replica's counts are
a series of their own, `ray_tandem_requests_total{outcome, replica}`, and
`sum by (outcome)` adds them up. Ray prefixes `ray_`; a counter named
`tandem_requests` is exported as `..._total`, so a name's `_total` is left to
Ray (`ray_name`).

The per-worker gauges (`kv_blocks_used`, `queue_depth`, ...) are not exported:
every replica reads the same figures from the workers, so any replica's
/metrics has them right, and Ray could not drop a gone worker's series.

Cost: 2.3-2.8 us more a call than the in-process count alone (0.6-0.7 us), in
an actor on this machine (docs/benchmarks.md, "By-hand probes (forty-ninth
session)"); the TBT histogram takes one call a streamed event, so 5000 events a
second cost a replica about 1.4% of a core.
"""

from __future__ import annotations

from cluster.metrics import LATENCY_BUCKETS_S


def ray_name(name: str) -> str:
    """The series a scheduler counter or histogram (its /metrics name less
    `tandem_`) is exported as on Ray's metrics port (histograms add _bucket,
    _sum and _count)."""
    return f"ray_tandem_{name}"


class RayExport:
    """`inc` and `observe`, as `Metrics` calls them, through `ray.util.metrics`
    with a `replica` tag (metrics made on first use: Ray needs each one's tag
    keys when it is made, and each call site passes the same labels)."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self._made: dict[str, object] = {}

    def inc(self, name: str, help_text: str, value: float, labels: dict[str, str]) -> None:
        if value > 0:  # (Ray refuses a counter's increment of 0)
            self._metric(name, help_text, labels, histogram=False).inc(value, tags=self._tags(labels))

    def observe(self, name: str, help_text: str, value: float, labels: dict[str, str]) -> None:
        self._metric(name, help_text, labels, histogram=True).observe(value, tags=self._tags(labels))

    def _tags(self, labels: dict[str, str]) -> dict[str, str]:
        return {**{k: str(v) for k, v in labels.items()}, "replica": self.replica}

    def _metric(self, name: str, help_text: str, labels: dict[str, str], histogram: bool):
        metric = self._made.get(name)
        if metric is None:
            from ray.util.metrics import Counter, Histogram

            tag_keys = (*sorted(labels), "replica")
            if histogram:
                metric = Histogram(f"tandem_{name}", description=help_text, boundaries=list(LATENCY_BUCKETS_S),
                                   tag_keys=tag_keys)
            else:
                metric = Counter(f"tandem_{name.removesuffix('_total')}", description=help_text, tag_keys=tag_keys)
            self._made[name] = metric
        return metric
