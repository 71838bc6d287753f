"""Offline validation of a Serve manifest (tandem check-manifest): Serve's own
config schema, then each Tandem application's `args` as `AppSettings`, before
anything starts. `serve run` on a manifest with a misspelt setting builds the app
four times, logs each failure's traceback and then waits on; `make serve` runs
this first and stops at the first line. A RayService manifest's `serveConfigV2`
is checked the same way, and so is the port the proxies listen on (Serve's own
schema takes 0 or 99999). Returns a list of problems; empty means valid.

A `model.path` that is a folder on this machine is checked as a worker would load
it (config.json, the tokenizer, each weights file's header), and its context
against `engine.num_kv_blocks` (`AppSettings.kv_pool_problem`); one that is not here
is a problem only with `local` (`make serve`: the manifest is served from here),
as it may name a folder on the cluster's nodes. Otherwise a bad checkpoint fails
the scheduler replica's start in Serve's retries, or the workers' in the pool's
(cluster/restart_backoff.py)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

IMPORT_PATH = "cluster.app:build_app"
DEPLOYMENT = "Scheduler"  # the application's one deployment (cluster/app.py)
MAX_PORT = 65535


def check_manifest(path: str | Path, local: bool = False) -> list[str]:
    from ray.serve.schema import ServeDeploySchema

    from cluster.cluster_check import read_yaml
    from cluster.config import AppSettings

    raw, problem = read_yaml(path, "a Serve config")
    if problem is not None:
        return [problem]
    if isinstance(raw, dict) and raw.get("kind") == "RayService":
        config = (raw.get("spec") or {}).get("serveConfigV2") if isinstance(raw.get("spec"), dict) else None
        if not isinstance(config, str):
            return ["a RayService's spec.serveConfigV2 must be the Serve config as a YAML string (`serveConfigV2: |`), "
                    f"got {type(config).__name__}"]
        try:
            raw = yaml.safe_load(config)
        except yaml.YAMLError as exc:
            return [f"spec.serveConfigV2 is not valid YAML ({' '.join(str(exc).split())})"]
        except RecursionError:
            return ["spec.serveConfigV2 nests too deeply to be a Serve config"]
    if not isinstance(raw, dict):
        return ["expected a mapping at the top level"]
    try:
        schema = ServeDeploySchema.model_validate(raw)
    except ValidationError as exc:
        return [f"Serve's config schema: {_where(e)}: {e['msg']}" for e in exc.errors()]
    problems = []
    port = schema.http_options.port
    if not 1 <= port <= MAX_PORT:
        problems.append(f"http_options.port: {port} is not a TCP port (1 to {MAX_PORT})")
    pools: dict[str, str] = {}  # pool_name -> the first application that names it
    for application in schema.applications:
        problem = _route_prefix_problem(application.route_prefix)
        if problem is not None:
            problems.append(f"application {application.name!r}: route_prefix {application.route_prefix!r} {problem}")
        if application.import_path != IMPORT_PATH:
            continue  # another app in the same config: not Tandem's to check
        try:
            settings = AppSettings.model_validate(application.args)
        except ValidationError as exc:
            problems += [f"application {application.name!r}: {_where(e) or 'args'}: {_message(e)}"
                         for e in exc.errors()]
            continue
        problems += _deployment_problems(application)
        first = pools.setdefault(settings.pool_name, application.name)
        if first != application.name:  # (one pool manager: the second's settings refused, or its sizes taken)
            problems.append(f"application {application.name!r}: pool_name {settings.pool_name!r} is application "
                            f"{first!r}'s too: give each application a pool_name of its own")
        context_tokens, problem = _checkpoint_context(settings.model.path, local)
        if problem is not None:
            problems.append(f"application {application.name!r}: model.path: {problem}")
        problem = settings.kv_pool_problem(context_tokens)  # (a preset's was checked with the settings)
        if problem is not None:
            problems.append(f"application {application.name!r}: args: {problem}")
    if not any(a.import_path == IMPORT_PATH for a in schema.applications):
        problems.append(f"no application has import_path {IMPORT_PATH}")
    return problems


def _deployment_problems(application) -> list[str]:
    """An application's `deployments` overrides Serve would refuse at deploy (a
    name the app has not: "Deployment 'Schedulr' does not exist") or its
    replica at start (a `user_config`: the Scheduler takes none)."""
    problems = []
    for deployment in application.deployments:
        if deployment.name != DEPLOYMENT:
            problems.append(f"application {application.name!r}: deployments: {deployment.name!r} is not one of its "
                            f"deployments (it has one: {DEPLOYMENT})")
        elif "user_config" in deployment.model_fields_set:
            problems.append(f"application {application.name!r}: deployments: {DEPLOYMENT} takes no user_config "
                            "(its settings are the application's args)")
    return problems


def _route_prefix_problem(route_prefix) -> str | None:
    """Why Serve would refuse an application's route prefix at deploy (its
    config schema takes any string), or None."""
    if not isinstance(route_prefix, str):  # (None: not served over HTTP; or Serve's default)
        return None
    if not route_prefix.startswith("/"):
        return "must start with '/'"
    if route_prefix != "/" and route_prefix.endswith("/"):
        return "must not end with '/'"
    if "{" in route_prefix or "}" in route_prefix:
        return "must not hold wildcards ({ or })"
    return None


def _checkpoint_context(path: str | None, local: bool) -> tuple[int | None, str | None]:
    """The context of the checkpoint folder at `path` (None where it is not read
    here), or why it would not load here."""
    try:
        if path is None or not (local or Path(path).is_dir()):
            return None, None
    except OSError as exc:  # (a path too long: Python 3.11's is_dir() lets that through)
        return None, exc.strerror or str(exc)
    from actors.config import CheckpointError, ModelConfig, ModelLocation
    from actors.tokenization import load_tokenizer
    from actors.sampling_defaults import SamplingDefaults
    from actors.weights import check_weights

    try:
        model_dir = ModelLocation(path).resolve()
        config = ModelConfig.from_hf(model_dir)
        load_tokenizer(model_dir)
        check_weights(model_dir, config)  # (names, shapes, types, from the headers: as a worker would load them)
        SamplingDefaults.load(model_dir)
    except CheckpointError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, exc.strerror or str(exc)
    return config.max_position_embeddings, None


def _where(error: dict) -> str:
    return ".".join(str(p) for p in error["loc"])


def _message(error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown setting"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"].endswith("_type"):  # a value of another type: `replicas: "2"` reads as 2 only in lax mode
        value = error["input"]
        message += f", got {type(value).__name__}" + (f" {value!r}" if isinstance(value, (str, int, float)) else "")
    return message
