"""Which errors of a call to a worker say the worker died.

Ray raises `RayActorError` for a call whose actor is gone, and one of its
subclasses, `ActorUnavailableError`, for an actor unreachable for now (a network
fault, a node under pressure), which may answer again. A worker found dead is
reported to the pool manager, which kills and replaces it: one only unreachable
must not be, nor its requests counted lost with it. The workers' own watchdogs
read the two the same way (`WorkerBase._is_dead`).
"""

from __future__ import annotations

import ray


def actor_died(error: BaseException | None) -> bool:
    """Whether `error` (a call's, or None) says its actor died."""
    return isinstance(error, ray.exceptions.RayActorError) and not isinstance(
        error, ray.exceptions.ActorUnavailableError)


def actor_unavailable(error: BaseException | None) -> bool:
    """Whether `error` says its actor is unreachable for now (not dead)."""
    return isinstance(error, ray.exceptions.ActorUnavailableError)
