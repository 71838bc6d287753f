"""Start worker actors from plain settings: kind, resources, labels.

The worker classes live in `actors/`; this is where they become Ray actors, with the
resources and the `label_selector` the manifest names (e.g. `{"tandem/role":
"prefill"}` so P lands on prefill nodes).
"""

from __future__ import annotations

from pathlib import Path

import ray

from actors.colocated_worker import ColocatedWorker
from actors.config import EngineConfig, ModelLocation
from actors.decode_worker import DecodeWorker
from actors.prefill_worker import PrefillWorker
from actors.worker_base import WorkerOptions

WORKER_CLASSES = {"prefill": PrefillWorker, "decode": DecodeWorker, "colocated": ColocatedWorker}


def start_worker(
    kind: str,
    worker_id: str,
    model: str | Path | ModelLocation,
    engine_config: EngineConfig,
    options: WorkerOptions | None = None,
    *,
    num_cpus: float = 1,
    num_gpus: float = 0,
    label_selector: dict[str, str] | None = None,
    name: str | None = None,
    detached: bool = False,
):
    """A new worker actor (returns its handle at once; the engine loads inside)."""
    if kind not in WORKER_CLASSES:
        raise ValueError(f"unknown worker kind {kind!r}; choose one of {sorted(WORKER_CLASSES)}")
    actor_options: dict = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=1000, max_restarts=0)
    if label_selector:
        actor_options["label_selector"] = dict(label_selector)
    if name:
        actor_options["name"] = name
    if detached:
        actor_options["lifetime"] = "detached"
    cls = ray.remote(WORKER_CLASSES[kind])
    model = model if isinstance(model, ModelLocation) else str(model)
    return cls.options(**actor_options).remote(worker_id, model, engine_config, options)
