"""The deployment's pools started where the application is built, before Serve
starts the scheduler replicas.

A replica creates the pool manager (`get_or_create_pool`) in its constructor, and
that comes last in a replica's start: its process, then its imports of
`cluster.app` (torch among them), about 4 s here, then the tokenizer. Only then did
the pool manager's own process and imports begin, and only after them the
workers'. Created by the application builder (`build_app`), the pool manager
starts beside the replicas instead; each replica then finds it by name, as a
replica always finds the one another replica made. Its first worker was asked
for about 3.5 s sooner here, and a served app was healthy about 2 s sooner (the
replicas' own start is now as long as the workers'; docs/benchmarks.md, "Session
57").

Only where the builder can tell the deploy will stand: Ray is connected (`serve
run` with an import path builds before it connects; a config file is built in a
task on the cluster), and the checkpoint is on this node and loads here as a
replica loads it (tokenizer, config.json, generation_config.json). A model that
is wrong must leave no pools behind, starting workers that cannot start while
the deploy fails; and a preset is not built here for this (presets are built on
the nodes that run them). Otherwise the replicas start the pools, as before, and
say what is wrong.
"""

from __future__ import annotations

import ray

from actors.config import ModelConfig
from actors.sampling_defaults import SamplingDefaults
from actors.tokenization import load_tokenizer
from cluster.config import AppSettings
from cluster.pool_manager import get_or_create_pool


def start_pools_early(settings: AppSettings) -> bool:
    """Create the pool manager of `settings` now, where the checkpoint allows it
    (see the module docstring); whether it was asked for."""
    if not ray.is_initialized():
        return False
    model_dir = settings.model.location().present()
    if model_dir is None:
        return False
    try:
        load_tokenizer(model_dir)
        ModelConfig.from_hf(model_dir)
        SamplingDefaults.load(model_dir, settings.sampling_defaults)
    except ValueError:  # a CheckpointError, or a config this server does not run: the replicas say it
        return False
    get_or_create_pool(settings)
    return True
