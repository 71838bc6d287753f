"""`tandem check-cluster` on the shipped ray_cluster.yaml and on broken variants."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from cluster.cluster_check import check_cluster_config

SHIPPED = Path(__file__).parent.parent / "ray_cluster.yaml"


def test_the_shipped_cluster_config_is_valid():
    assert check_cluster_config(SHIPPED) == []


def _variant(tmp_path, mutate):
    raw = yaml.safe_load(SHIPPED.read_text())
    mutate(raw)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_missing_decode_role_is_reported(tmp_path):
    path = _variant(tmp_path, lambda raw: raw["available_node_types"]["decode_gpu"]["labels"].clear())
    assert any("decode" in p for p in check_cluster_config(path))


def test_fractional_resources_and_bad_bounds_are_reported(tmp_path):
    def mutate(raw):
        raw["available_node_types"]["prefill_gpu"]["resources"]["GPU"] = 0.5
        raw["available_node_types"]["prefill_gpu"]["min_workers"] = 9

    problems = check_cluster_config(_variant(tmp_path, mutate))
    assert any("integer" in p for p in problems) and any("min_workers" in p for p in problems)


def test_ray_schema_errors_are_reported(tmp_path):
    path = _variant(tmp_path, lambda raw: raw.update(head_node_type="nope"))
    assert any("Ray's cluster schema" in p for p in check_cluster_config(path))


def test_cli_exit_codes(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "cluster.cli", "check-cluster", str(SHIPPED)], capture_output=True, text=True)
    assert ok.returncode == 0 and "valid" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster_name: [unterminated")
    result = subprocess.run([sys.executable, "-m", "cluster.cli", "check-cluster", str(bad)], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr and "cannot read YAML" in result.stderr
