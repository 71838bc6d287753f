"""Offline validation of a cluster-launcher YAML for `ray up` (tandem check-cluster).

Two layers: Ray's own schema (`prepare_config` then `validate_config`, private API
pinned with Ray 2.60, wrapped here) and what Tandem needs on top: a node type
labelled `tandem/role: prefill` and one labelled `decode` that can be launched
(the head, or a type whose max_workers is above 0: a labelled type at 0 was
counted, and its pool had nowhere to run), integer resources, min_workers <=
max_workers. A type's max_workers defaults as Ray's (0 for the head, else the
cluster's max_workers, itself 2 by default). Returns a list of problems; empty
means valid.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

ROLE_LABEL = "tandem/role"
RAY_DEFAULT_MAX_WORKERS = 2  # ray-schema.json's default for the cluster's max_workers


def check_cluster_config(path: str | Path) -> list[str]:
    raw, problem = read_yaml(path, "the cluster config")
    if problem is not None:
        return [problem]
    if not isinstance(raw, dict):
        return [f"{path}: expected a mapping at the top level"]
    problems = _ray_schema_problems(raw)
    node_types = raw.get("available_node_types") or {}
    if not isinstance(node_types, dict):
        return problems + ["available_node_types must be a mapping of node type names to their settings"]
    roles: dict[str, list[str]] = {}  # role: the node types labelled with it
    launchable: set[str] = set()  # roles some node type with it can be launched for
    cap = raw.get("max_workers", RAY_DEFAULT_MAX_WORKERS)  # (all worker nodes: 0 launches none, whatever a type says)
    any_worker = not isinstance(cap, int) or cap > 0
    for name, node_type in node_types.items():
        shape = _shape_problem(name, node_type)
        if shape is not None:
            problems.append(shape)
            continue
        is_head = name == raw.get("head_node_type")
        low = node_type.get("min_workers", 0)
        high = node_type.get("max_workers", 0 if is_head else raw.get("max_workers", RAY_DEFAULT_MAX_WORKERS))
        labels = node_type.get("labels") or {}
        role = labels.get(ROLE_LABEL) if isinstance(labels, dict) else None
        if not isinstance(labels, dict) or not isinstance(role, (str, type(None))):
            problems.append(f"node type {name}: labels must map names to strings ({ROLE_LABEL}: prefill or decode)")
            continue
        if role:
            roles.setdefault(role, []).append(name)
            if is_head or any_worker and (not isinstance(high, int) or high > 0):
                launchable.add(role)
        for resource, amount in (node_type.get("resources") or {}).items():
            if not isinstance(amount, int):
                problems.append(f"node type {name}: resource {resource} must be an integer, got {amount!r}")
        if isinstance(low, int) and isinstance(high, int) and low > high:
            problems.append(f"node type {name}: min_workers {low} > max_workers {high}")
    for role in ("prefill", "decode"):
        if role not in roles:
            problems.append(f"no node type labelled {ROLE_LABEL}: {role} (the {role} pool has nowhere to run)")
        elif role not in launchable:
            why = "max_workers 0" if any_worker else "no worker node to run on (the cluster's max_workers is 0)"
            problems.append(f"the node types labelled {ROLE_LABEL}: {role} ({', '.join(roles[role])}) have "
                            f"{why} and none is the head: the {role} pool has nowhere to run")
    return list(dict.fromkeys(problems))  # (Ray's schema may say the same)


def _shape_problem(name, node_type) -> str | None:
    """What is not a mapping where a node type, its labels or its resources must be one."""
    if not isinstance(node_type, dict):
        return f"node type {name}: expected a mapping of its settings, got {node_type!r}"
    for field in ("labels", "resources"):
        if not isinstance(node_type.get(field) or {}, dict):
            return f"node type {name}: {field} must be a mapping (name: value), got {node_type[field]!r}"
    return None


def read_yaml(path: str | Path, what: str):
    """(the document, None) or (None, a one-line problem naming `what` it should
    have been): a file that cannot be read, is not UTF-8, is not YAML, or nests
    too deeply to load."""
    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8")), None
    except OSError as exc:
        return None, f"cannot read {what}: {path}: {exc.strerror or exc}"
    except UnicodeDecodeError as exc:
        return None, f"cannot read {what}: {path} is not UTF-8 text (byte {exc.start})"
    except yaml.YAMLError as exc:
        return None, f"cannot read {what}: {path} is not valid YAML ({' '.join(str(exc).split())})"
    except RecursionError:
        return None, f"cannot read {what}: {path} nests too deeply"


def _ray_schema_problems(raw: dict) -> list[str]:
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        validate_config(prepare_config(copy.deepcopy(raw)))
    except KeyError as exc:  # (a required key, as Ray's prepare_config reads it)
        return [f"Ray's cluster schema: {exc.args[0]!r} is required"]
    except Exception as exc:  # jsonschema / ValueError from Ray's validator
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return [f"Ray's cluster schema: {message}"]
    return []
