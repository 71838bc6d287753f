"""The pool manager's signal gauges (cluster/pool_metrics.py): a signal not known
now reads NaN, not its last value. Ray's metric classes are swapped for a
recorder here (what Ray exports is tested in tests/test_dashboard.py and the
cluster tests); what is under test is what PoolMetrics sets."""

from __future__ import annotations

import math

import ray.util.metrics

from cluster.pool_metrics import PoolMetrics


class _Recorded:
    def __init__(self, name: str, description: str = "", tag_keys=()) -> None:
        self.name, self.values = name, {}

    def set(self, value: float, tags: dict) -> None:
        self.values[tags["pool"]] = value

    def inc(self, value: float = 1, tags: dict | None = None) -> None:
        pass


def test_a_signal_not_known_now_is_nan_where_the_pool_had_one(monkeypatch):
    """A window of misses, then silence: the autoscaler read None and the gauge
    kept 0.0, a full outage on the dashboard (and its alert) for good."""
    monkeypatch.setattr(ray.util.metrics, "Gauge", _Recorded)
    monkeypatch.setattr(ray.util.metrics, "Counter", _Recorded)
    metrics = PoolMetrics()
    metrics.signals("prefill", 0.0, 120.0, None)
    metrics.signals("decode", 0.95, None, 0.5)
    metrics.signals("prefill", None, None, None)
    assert math.isnan(metrics.attainment.values["prefill"]) and math.isnan(metrics.backlog.values["prefill"])
    assert "prefill" not in metrics.kv_usage.values  # (never had one: no series)
    assert metrics.attainment.values["decode"] == 0.95 and metrics.kv_usage.values["decode"] == 0.5
    metrics.signals("prefill", 0.5, None, None)
    assert metrics.attainment.values["prefill"] == 0.5


def test_a_workers_own_counts_are_counters_and_go_with_it():
    """The scheduler's /metrics (cluster/metrics.py): a count a worker keeps since
    it started is typed a counter at its latest reading (as a gauge, `delta` took
    a drop for a fall); a worker that is gone takes its series with it."""
    from cluster.metrics import Metrics

    metrics = Metrics()
    metrics.set_total("preemptions_total", "preempted", 3, worker="d0", role="decode")
    metrics.set_total("preemptions_total", "preempted", 5, worker="d0", role="decode")  # its latest reading
    metrics.set_total("preemptions_total", "preempted", 1, worker="d1", role="decode")
    metrics.set("queue_depth", "depth", 2, worker="d0", role="decode")
    metrics.inc("requests_total", "requests", outcome="ok")
    rendered = metrics.render()
    assert "# TYPE tandem_preemptions_total counter" in rendered
    assert 'tandem_preemptions_total{role="decode",worker="d0"} 5' in rendered
    metrics.forget(worker="d0")
    rendered = metrics.render()
    assert 'worker="d0"' not in rendered and 'tandem_preemptions_total{role="decode",worker="d1"} 1' in rendered
    assert 'tandem_requests_total{outcome="ok"} 1.0' in rendered
