"""Offline validation of a Serve manifest (tandem check-manifest): Serve's own
config schema, then each Tandem application's `args` as `AppSettings`, before
anything starts. `serve run` on a manifest with a misspelt setting builds the app
four times, logs each failure's traceback and then waits on; `make serve` runs
this first and stops at the first line. A RayService manifest's `serveConfigV2`
is checked the same way. Returns a list of problems; empty means valid."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

IMPORT_PATH = "cluster.app:build_app"


def check_manifest(path: str | Path) -> list[str]:
    from ray.serve.schema import ServeDeploySchema

    from cluster.config import AppSettings

    try:
        raw = yaml.safe_load(Path(path).read_text())
        if isinstance(raw, dict) and raw.get("kind") == "RayService":
            raw = yaml.safe_load(raw["spec"]["serveConfigV2"])
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        return [f"cannot read a Serve config ({exc})"]
    if not isinstance(raw, dict):
        return ["expected a mapping at the top level"]
    try:
        schema = ServeDeploySchema.model_validate(raw)
    except ValidationError as exc:
        return [f"Serve's config schema: {_where(e)}: {e['msg']}" for e in exc.errors()]
    problems = []
    for application in schema.applications:
        if application.import_path != IMPORT_PATH:
            continue  # another app in the same config: not Tandem's to check
        try:
            AppSettings.model_validate(application.args)
        except ValidationError as exc:
            problems += [f"application {application.name!r}: {_where(e) or 'args'}: {_message(e)}"
                         for e in exc.errors()]
    if not any(a.import_path == IMPORT_PATH for a in schema.applications):
        problems.append(f"no application has import_path {IMPORT_PATH}")
    return problems


def _where(error: dict) -> str:
    return ".".join(str(p) for p in error["loc"])


def _message(error: dict) -> str:
    return "unknown setting" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
