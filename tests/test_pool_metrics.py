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
