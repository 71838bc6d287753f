"""Multi-node on one machine: labelled prefill and decode nodes (logical GPUs), and
prefix reuse across nodes through the KV store's shared path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_pools_land_on_their_labelled_nodes_and_serve_across_nodes():
    script = Path(__file__).with_name("multinode_check.py")
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(role == node_role for role, node_role in result["placement"].values()), result["placement"]
    assert sorted(r for r, _ in result["placement"].values()) == ["decode", "prefill", "prefill"]
    assert result["error"] is None and len(result["tokens"]) == 6
    assert result["replaced"] is not None and result["replaced"][1] == "prefill"
    reuse = result["reuse"]  # the prefix P on one node computed, P on the other loads
    assert not reuse["same_node"] and reuse["nodes"] == ["prefill", "prefill"]
    assert reuse["prompt_tokens"] == 89 + 6 + 30
    assert reuse["store_loaded_blocks"] == 5  # the first turn's 89-token prompt: 5 full blocks
    assert reuse["computed_tokens"] == reuse["prompt_tokens"] - 5 * 16
    assert reuse["identical"]
