"""The endpoints that act on every worker of the pools, whichever replica they
land on: `/flush_cache` (vLLM's `/reset_prefix_cache`), `/abort_request`,
`/start_profile` and `/stop_profile` (SGLang's, and vLLM's). Thin: each asks the
replica's `PoolView` (cluster/pool_view.py), which its `app.state` gives
(`refreshed_view`, set as the replica starts), about the workers it has, ready
pools or not; the app includes this router (cluster/app.py), so these share its
API key, body limit and JSON errors.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from cluster.api_models import ApiError
from cluster.sglang_body import AbortBody, ProfileBody
from cluster.strict_json import StrictJsonRoute

router = APIRouter(route_class=StrictJsonRoute)  # as the app's (cluster/strict_json.py)


async def _view(request: Request):
    """The replica's PoolView, refreshed (not waiting for ready pools: a request
    to abort, a flush or a profile's end acts on the workers that are up)."""
    return await request.app.state.refreshed_view()


@router.api_route("/flush_cache", methods=["GET", "POST"])  # (SGLang takes both: curl's GET was a 405)
@router.post("/reset_prefix_cache")
async def flush_cache(request: Request):
    """SGLang's, and vLLM's /reset_prefix_cache: every worker's device prefix
    cache forgotten, so that the prompts after it are computed anew (a cold
    benchmark run). Blocks in use keep their KV; the KV store's tiers keep
    their copies (prompts found there are fetched, not computed)."""
    flushed = await (await _view(request)).flush_prefix_caches()
    return {"message": "Cache flushed.", "workers": flushed}


@router.post("/abort_request")
async def abort_request(request: Request, body: AbortBody):
    """SGLang's: end the requests the client named `rid` (or every one,
    `abort_all`) on whichever replica they run; each answers as it stands,
    with finish_reason "abort". Reaches what the workers hold now, not a
    request still being admitted. `aborted`: how many requests (choices)."""
    aborted = await (await _view(request)).abort_named(None if body.abort_all else body.rid)
    return {"aborted": len(aborted)}


@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request, body: ProfileBody | None = None):
    """A torch profiler trace of every worker's engine steps
    (actors/step_profile.py), written under the manifest's `profile_dir` on each
    worker's node when `/stop_profile` ends it, or after `num_steps` steps."""
    folder = request.app.state.settings.profile_dir
    if folder is None:
        raise ApiError(400, "profiling is off: set profile_dir in the manifest's args (the folder the workers "
                            "write their traces to)")
    body = body or ProfileBody()
    traces = await (await _view(request)).start_profiles(folder, body.num_steps, body.record_shapes,
                                                         body.with_stack)
    return {"message": "Profiling.", "num_steps": body.num_steps, "traces": traces}


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(request: Request):
    """End every worker's trace and write it; the traces' paths by worker (a
    worker with none: left out)."""
    traces = await (await _view(request)).stop_profiles()
    if not traces:
        raise ApiError(409, "no profile is running: POST /start_profile first", kind="conflict")
    return {"message": "Profile written.", "traces": traces}
