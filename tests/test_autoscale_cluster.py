"""P and D pools scale independently on an autoscaling Ray cluster (autoscaler v2,
fake multi-node provider), in a subprocess: the fake cluster is its own Ray
cluster, apart from this session's (see tests/autoscale_check.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.pool_metrics import SERIES
from tests.test_dashboard import replica_series


@pytest.mark.timeout(1000)
def test_prefill_and_decode_pools_grow_on_their_own_load_and_shrink_when_it_stops():
    script = Path(__file__).with_name("autoscale_check.py")
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=950, env=env,
                          cwd=script.parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in result, json.dumps({k: result.get(k) for k in ("error", "all_events")}, indent=1)
    assert result["nodes_at_start"] == {"prefill": 1, "decode": 1}

    prefill, decode = result["phases"]["prefill_heavy"], result["phases"]["decode_heavy"]
    assert prefill["ups"] == ["prefill"], prefill["events"]  # D left alone
    assert prefill["nodes"]["prefill"] == 2  # the autoscaler launched a prefill node
    assert decode["ups"] == ["decode"], decode["events"]  # P did not grow
    assert decode["nodes"]["decode"] == 2
    # Every request completed, with all its tokens.
    assert prefill["num_requests"] > 0 and prefill["num_failed"] == 0, prefill["failed"]
    assert decode["num_requests"] > 0 and decode["num_failed"] == 0, decode["failed"]
    # Back to min (1 P, 1 D, one node each: the check waits for it) and the drains leaked nothing.
    assert {role for role, _, _ in result["drained"]} == {"prefill", "decode"}
    assert all(used == 0 and "accounting ok" in reason for _, used, reason in result["drained"]), result["drained"]
    # The pool manager's metrics, and the scheduler's counters and histograms
    # (cluster/metrics_export.py), reach the Ray metrics port under the catalogued names.
    assert {"ray_tandem_autoscale_decisions_total", "ray_tandem_pool_workers"} <= set(result["metric_names"])
    assert {"ray_tandem_requests_total", "ray_tandem_ttft_seconds_bucket"} <= set(result["metric_names"])
    assert set(result["metric_names"]) <= set(SERIES) | replica_series()
