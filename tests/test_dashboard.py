"""The Grafana dashboard parses, and queries only series Tandem exports: the
scheduler's `/metrics` (`tandem_*`, read from the calls in cluster/ that set
them), the scheduler's counters and histograms as Ray exports them
(`ray_tandem_*`, cluster/metrics_export.py), which are the ones it must sum over
replicas, and the pool manager's Ray metrics (`ray_tandem_*`,
cluster/pool_metrics.py; tests/autoscale_check.py checks those against a live
cluster)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from cluster.metrics_export import ray_name
from cluster.pool_metrics import SERIES

ROOT = Path(__file__).parent.parent
DASHBOARD = ROOT / "manifests" / "grafana-dashboard.json"
METRIC = re.compile(r"\b(?:ray_)?tandem_[a-z0-9_]+\b")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def scheduler_series(kinds=("inc", "set", "set_total", "observe")) -> set[str]:
    """`tandem_<name>` for every `<...>.metrics.inc/set/set_total/observe("<name>", ...)` in
    cluster/ (histograms with their _bucket, _sum and _count series), of the kinds asked for."""
    names = set()
    for path in (ROOT / "cluster").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in kinds and isinstance(node.func.value, ast.Attribute)
                    and node.func.value.attr == "metrics" and node.args and isinstance(node.args[0], ast.Constant)):
                continue
            name = f"tandem_{node.args[0].value}"
            names |= {name + suffix for suffix in HISTOGRAM_SUFFIXES} if node.func.attr == "observe" else {name}
    return names


def queries(dashboard: dict) -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_the_dashboard_parses_and_every_panel_is_complete():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


def replica_series() -> set[str]:
    """The scheduler's per-replica series (counters, histograms) as Ray exports them."""
    return {ray_name(name.removeprefix("tandem_")) for name in scheduler_series(("inc", "observe"))}


def test_every_queried_series_is_exported():
    exported = scheduler_series(("set", "set_total")) | replica_series() | set(SERIES)
    assert {"ray_tandem_requests_total", "ray_tandem_ttft_seconds_bucket", "tandem_kv_blocks_used"} <= exported
    for title, expr in queries(json.loads(DASHBOARD.read_text())):
        used = set(METRIC.findall(expr))
        assert used, f"{title}: no Tandem series in {expr!r}"
        assert used <= exported, f"{title}: {sorted(used - exported)} are not exported by Tandem (per-replica " \
                                 "counts are summed from Ray's export: /metrics through the Serve proxy is one replica's)"


def test_every_exported_family_has_a_panel():
    families = {re.sub(r"_(bucket|sum|count)$", "", n)
                for n in scheduler_series(("set", "set_total")) | replica_series() | set(SERIES)}
    shown = {re.sub(r"_(bucket|sum|count)$", "", n)
             for _, expr in queries(json.loads(DASHBOARD.read_text())) for n in METRIC.findall(expr)}
    assert families <= shown, f"no panel for {sorted(families - shown)}"
