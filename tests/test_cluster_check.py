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


def test_a_role_only_on_node_types_that_are_never_launched_is_reported(tmp_path):
    """A labelled node type at max_workers 0 (not the head) counted as the role's
    home; set by a type's own max_workers or, as Ray defaults it, the cluster's."""
    path = _variant(tmp_path, lambda raw: raw["available_node_types"]["decode_gpu"].update(min_workers=0,
                                                                                           max_workers=0))
    assert any("decode_gpu) have max_workers 0" in p for p in check_cluster_config(path))

    def cluster_wide(raw):
        raw["max_workers"] = 0
        for name in ("prefill_gpu", "decode_gpu"):
            del raw["available_node_types"][name]["max_workers"]
            raw["available_node_types"][name]["min_workers"] = 0

    problems = check_cluster_config(_variant(tmp_path, cluster_wide))
    assert sum("the cluster's max_workers is 0" in p for p in problems) == 2

    def capped(raw):  # (found by a review: each type's own max_workers above 0 passed it, under a cap of 0)
        raw["max_workers"] = 0
        for name in ("prefill_gpu", "decode_gpu"):
            raw["available_node_types"][name]["min_workers"] = 0

    problems = check_cluster_config(_variant(tmp_path, capped))
    assert sum("no worker node to run on (the cluster's max_workers is 0)" in p for p in problems) == 2

    def head_is_decode(raw):
        raw["available_node_types"]["head"]["labels"]["tandem/role"] = "decode"
        del raw["available_node_types"]["decode_gpu"]

    assert check_cluster_config(_variant(tmp_path, head_is_decode)) == []


def test_a_node_types_max_workers_defaults_to_the_clusters(tmp_path):
    """min_workers 1 with no max_workers of the type's own was read as 1 > 0."""
    path = _variant(tmp_path, lambda raw: raw["available_node_types"]["decode_gpu"].pop("max_workers"))
    assert check_cluster_config(path) == []


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
    assert result.returncode == 2 and "Traceback" not in result.stderr and "is not valid YAML" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 2  # (the heading, then the problem in one line)


def test_malformed_files_and_settings_are_problems_not_tracebacks(tmp_path):
    """Each was an AttributeError, UnicodeDecodeError or RecursionError from the CLI."""
    cases = {
        "labels as a string": lambda raw: raw["available_node_types"]["decode_gpu"].update(labels="tandem/role=decode"),
        "an empty node type": lambda raw: raw["available_node_types"].update(decode_gpu=None),
        "node types as a list": lambda raw: raw.update(available_node_types=["decode_gpu"]),
        "resources as a string": lambda raw: raw["available_node_types"]["decode_gpu"].update(resources="lots"),
        # found by a review: a TypeError (a role as a list is no key), exit code 0
        "a role as a list": lambda raw: raw["available_node_types"]["decode_gpu"]["labels"].update(
            {"tandem/role": ["decode"]}),
    }
    for case, mutate in cases.items():
        problems = check_cluster_config(_variant(tmp_path, mutate))
        assert problems and all("\n" not in p for p in problems), case
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 100_000 + "]" * 100_000)
    assert check_cluster_config(tmp_path / "binary.yaml") == [
        f"cannot read the cluster config: {tmp_path / 'binary.yaml'} is not UTF-8 text (byte 0)"]
    assert check_cluster_config(tmp_path / "deep.yaml") == [
        f"cannot read the cluster config: {tmp_path / 'deep.yaml'} nests too deeply"]
    no_provider = _variant(tmp_path, lambda raw: raw.pop("provider"))
    assert "Ray's cluster schema: 'provider' is required" in check_cluster_config(no_provider)
