"""Offline validation of a cluster-launcher YAML for `ray up` (tandem check-cluster).

Two layers: Ray's own schema (`prepare_config` then `validate_config`, private API
pinned with Ray 2.60, wrapped here) and what Tandem needs on top: a node type
labelled `tandem/role: prefill` and one labelled `decode`, integer resources,
min_workers <= max_workers. Returns a list of problems; empty means valid.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

ROLE_LABEL = "tandem/role"


def check_cluster_config(path: str | Path) -> list[str]:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        return [f"{path}: cannot read YAML ({exc})"]
    if not isinstance(raw, dict):
        return [f"{path}: expected a mapping at the top level"]
    problems = _ray_schema_problems(raw)
    node_types = raw.get("available_node_types") or {}
    roles: dict[str, list[str]] = {}
    for name, node_type in node_types.items():
        labels = (node_type or {}).get("labels") or {}
        role = labels.get(ROLE_LABEL)
        if role:
            roles.setdefault(role, []).append(name)
        for resource, amount in ((node_type or {}).get("resources") or {}).items():
            if not isinstance(amount, int):
                problems.append(f"node type {name}: resource {resource} must be an integer, got {amount!r}")
        low, high = node_type.get("min_workers", 0), node_type.get("max_workers", 0)
        if isinstance(low, int) and isinstance(high, int) and low > high:
            problems.append(f"node type {name}: min_workers {low} > max_workers {high}")
    for role in ("prefill", "decode"):
        if role not in roles:
            problems.append(f"no node type labelled {ROLE_LABEL}: {role} (the {role} pool has nowhere to run)")
    return problems


def _ray_schema_problems(raw: dict) -> list[str]:
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        validate_config(prepare_config(copy.deepcopy(raw)))
    except Exception as exc:  # jsonschema / ValueError from Ray's validator
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return [f"Ray's cluster schema: {message}"]
    return []
