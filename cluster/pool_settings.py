"""What a redeploy can change of worker pools that outlived the scheduler replicas
before it.

The pools belong to a detached pool manager (cluster/pool_manager.py) that a new
scheduler replica finds by `pool_name`, so a redeploy (`serve deploy` or `serve
run` of an edited manifest) meets pools started from the manifest before. Of the
settings those workers were started from, a redeploy changes live the pools'
sizes and placement (`PoolManager.apply_pools`) and the autoscaler's knobs and
SLO targets (`PoolAutoscaler.retune`). The rest, `POOL_OWNED`, is what a worker
is started with (the model, the engine, the KV store, ...) and whether there are
P and D pools at all (`mode`): it stays the pools' own until they are torn down.

A replica that used its manifest's values of those beside such pools would
tokenize for one checkpoint while the workers run another, or index prefixes in
blocks of another size: garbage, or limits the workers do not have. So such a
redeploy is refused, as Kubernetes refuses an edit of a StatefulSet's immutable
fields: `check_redeploy`, from the app builder, fails the deploy with each value
the manifest changed and how to apply them (`serve shutdown`, `tandem teardown`,
then deploy), and the replicas deployed before go on serving. Where the builder
cannot see the cluster (`serve run` of an import path builds the app before it
connects to Ray), the replica finds the same at its first refresh and answers
503 naming them (`PoolView.refresh`). Rolling replacement of the workers (new
ones started from the new settings, the old drained) would apply them without a
teardown; it needs the replicas of each manifest to route to their own
generation of workers only, and is not built.
"""

from __future__ import annotations

import ray

from cluster.config import AppSettings
from cluster.pool_manager import NAMESPACE

# Dotted paths into AppSettings: a section, or one field of it.
POOL_OWNED = ("model.path", "model.preset", "model.arch", "mode", "engine", "kv_store", "stream_interval",
              "timeouts.transfer_s", "timeouts.reservation_ttl_s", "response_store_mib")

HOW_TO_APPLY = ("to apply them, tear the pools down: `serve shutdown`, `tandem teardown`, then deploy again (or deploy "
                "the manifest the pools were started from)")


def _get(data: dict, path: str):
    """The value at a dotted path; None where a dump has no such key (a pool
    manager started by an older version)."""
    for key in path.split("."):
        data = data.get(key) if isinstance(data, dict) else None
    return data


def differences(running, deployed, path: str) -> list[str]:
    """`path: running -> deployed` for each leaf under `path` whose values differ."""
    if isinstance(running, dict) and isinstance(deployed, dict):
        return [line for key in sorted(running.keys() | deployed.keys())
                for line in differences(running.get(key), deployed.get(key), f"{path}.{key}")]
    return [] if running == deployed else [f"{path}: {running!r} -> {deployed!r}"]


def pools_keep(running: dict, deployed: dict) -> list[str]:
    """Each `POOL_OWNED` value a manifest (`deployed`, a settings dump) changed of
    the pools' (`running`: `PoolManager.running_settings`), as `path: theirs ->
    the manifest's`; empty when the pools could have been started from it."""
    running = _as_dumped_now(running)
    return [line for path in POOL_OWNED for line in differences(_get(running, path), _get(deployed, path), path)]


def _as_dumped_now(running: dict) -> dict:
    """A dump of an older version as this one dumps it: a checkpoint folder's
    `model.arch` was the default "qwen2", unread; it is none now (a redeploy over
    such pools was refused for it)."""
    model = running.get("model")
    if isinstance(model, dict) and model.get("path") is not None and model.get("arch") is not None:
        return {**running, "model": {**model, "arch": None}}
    return running


def redeploy_refusal(pool_name: str, kept: list[str]) -> str:
    return (f"the running worker pools {pool_name!r} keep the settings they were started from; this manifest changes "
            f"{'; '.join(kept)}: {HOW_TO_APPLY}")


def check_redeploy(deployed: AppSettings) -> None:
    """Raise ValueError (`redeploy_refusal`) when pools of `deployed.pool_name` run and
    keep settings `deployed` changes; nothing when none run, or Ray is not
    connected yet (the replica checks again: `PoolView.refresh`)."""
    if not ray.is_initialized():
        return
    try:
        pool = ray.get_actor(deployed.pool_name, namespace=NAMESPACE)
        running = ray.get(pool.running_settings.remote(), timeout=60)
    except (ValueError, ray.exceptions.RayError, AttributeError):  # none, going away, or older than this check
        return
    kept = pools_keep(running, deployed.model_dump())
    if kept:
        raise ValueError(redeploy_refusal(deployed.pool_name, kept))
