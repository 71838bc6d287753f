"""The pool manager's metrics (its stored responses' too, cluster/response_store.py),
through `ray.util.metrics`: Ray exports them on each
node's metrics port with a `ray_` prefix (counters also get `_total`), beside Ray's
own series; the scheduler's `/metrics` (cluster/metrics.py) does not carry them.

`SERIES` is the catalogue of the names as Prometheus sees them (the Grafana
dashboard and its test read it).
"""

from __future__ import annotations

import math

SERIES = {
    "ray_tandem_autoscale_decisions_total": "counter: scaling decisions by pool, action (up, down) and signal",
    "ray_tandem_pool_workers": "gauge: workers per pool and state (serving, starting, draining)",
    "ray_tandem_pool_slo_attainment": "gauge: windowed attainment, TTFT for prefill and TBT for decode",
    "ray_tandem_pool_prefill_backlog_tokens": "gauge: queued prompt tokens per serving prefill worker",
    "ray_tandem_pool_kv_usage": "gauge: fraction of the decode pool's KV blocks in use",
    "ray_tandem_pool_replacements_total": "counter: dead workers replaced, by pool",
    "ray_tandem_pool_start_failures_total": "counter: workers that failed to start (died starting, start-up profile "
                                            "failed, not placed in time), by pool",
    "ray_tandem_response_store_bytes": "gauge: stored Responses API responses and conversations, bytes of their JSON",
    "ray_tandem_response_store_responses": "gauge: stored Responses API responses",
    "ray_tandem_response_store_conversations": "gauge: stored Conversations API conversations",
    "ray_tandem_response_store_evictions_total": "counter: stored responses and conversations evicted by the store's "
                                                 "bound",
}


class PoolMetrics:
    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge

        self.decisions = Counter("tandem_autoscale_decisions", description=SERIES[
            "ray_tandem_autoscale_decisions_total"], tag_keys=("pool", "action", "signal"))
        self.workers = Gauge("tandem_pool_workers", description=SERIES["ray_tandem_pool_workers"],
                             tag_keys=("pool", "state"))
        self.attainment = Gauge("tandem_pool_slo_attainment", description=SERIES["ray_tandem_pool_slo_attainment"],
                                tag_keys=("pool",))
        self.backlog = Gauge("tandem_pool_prefill_backlog_tokens",
                             description=SERIES["ray_tandem_pool_prefill_backlog_tokens"], tag_keys=("pool",))
        self.kv_usage = Gauge("tandem_pool_kv_usage", description=SERIES["ray_tandem_pool_kv_usage"],
                              tag_keys=("pool",))
        self.replacements = Counter("tandem_pool_replacements", description=SERIES[
            "ray_tandem_pool_replacements_total"], tag_keys=("pool",))
        self.start_failures = Counter("tandem_pool_start_failures", description=SERIES[
            "ray_tandem_pool_start_failures_total"], tag_keys=("pool",))
        self._known: set[tuple[str, str]] = set()  # (a signal, a pool) that had a value (`signals`)

    def decision(self, pool: str, action: str, signal: str) -> None:
        self.decisions.inc(1, tags={"pool": pool, "action": action, "signal": signal})

    def pool(self, pool: str, num_serving: int, num_starting: int, num_draining: int) -> None:
        for state, count in (("serving", num_serving), ("starting", num_starting), ("draining", num_draining)):
            self.workers.set(count, tags={"pool": pool, "state": state})

    def signals(self, pool: str, attainment: float | None, backlog_per_worker: float | None,
                kv_usage: float | None) -> None:
        """The autoscaler's signals; one not known now (None: too few outcomes in
        the window, say) is NaN where the pool had one. Left at its last value, a
        window of misses and then silence (or a scale step, which starts the
        window again) showed 0% attainment on the dashboard, and fired its alert,
        for good."""
        signals = (("attainment", self.attainment, attainment), ("backlog", self.backlog, backlog_per_worker),
                   ("kv_usage", self.kv_usage, kv_usage))
        for name, gauge, value in signals:
            if value is not None:
                self._known.add((name, pool))
            elif (name, pool) not in self._known:
                continue  # (never had one: no series made)
            gauge.set(math.nan if value is None else value, tags={"pool": pool})

    def replaced(self, pool: str) -> None:
        self.replacements.inc(1, tags={"pool": pool})

    def start_failed(self, pool: str) -> None:
        self.start_failures.inc(1, tags={"pool": pool})


class ResponseStoreMetrics:
    """What the store of responses and conversations holds, and what its bound
    evicted (too many evictions: conversations lost; raise `response_store_mib`)."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge

        self.num_bytes = Gauge("tandem_response_store_bytes", description=SERIES["ray_tandem_response_store_bytes"])
        self.num_responses = Gauge("tandem_response_store_responses",
                                   description=SERIES["ray_tandem_response_store_responses"])
        self.num_conversations = Gauge("tandem_response_store_conversations",
                                       description=SERIES["ray_tandem_response_store_conversations"])
        self.evictions = Counter("tandem_response_store_evictions",
                                 description=SERIES["ray_tandem_response_store_evictions_total"])

    def held(self, num_responses: int, num_conversations: int, num_bytes: int, num_evicted: int) -> None:
        self.num_responses.set(num_responses)
        self.num_conversations.set(num_conversations)
        self.num_bytes.set(num_bytes)
        if num_evicted:
            self.evictions.inc(num_evicted)
