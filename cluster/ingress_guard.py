"""What every HTTP request meets outside its endpoint: the API key and the body
size limit on the way in (`RequestGuard`), and on the way out every error as
a JSON body, {"error": {"message", "type", "param", "code"}}, never a traceback: pydantic's
complaints as `field: message`, a worker's refusal as its message, an SLO
rejection as a 429 with Retry-After and its predictions, anything unexpected as a
500 that names only the exception's type (the traceback goes to the log)."""

from __future__ import annotations

import functools
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
import ray
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.messages import error_message
from actors.sampling_params import InvalidRequestError
from cluster.admission import SloRejected
from cluster.api_models import ApiError
from cluster.client_call import open_call
from cluster.config import AppSettings
from cluster.prompt_thread import BODY_BYTES
from cluster.sglang_body import MANY, ONE

log = logging.getLogger("tandem.app")


def install_guard(app: FastAPI) -> None:
    """The error handlers and the guard, on `app` (whose `state.settings`, once
    set, the guard reads)."""
    for kind, handler in ((ApiError, _refused), (RequestValidationError, _validation_error),
                          (StarletteHTTPException, _http_error), (InvalidRequestError, _refused),
                          (SloRejected, _refused), (Exception, _unexpected)):
        app.add_exception_handler(kind, handler)
    app.add_middleware(RequestGuard, owner=app)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError):
    """A 400 saying each problem; `param`: the first problem's field, as OpenAI names one."""
    content_type = request.headers.get("content-type", "")
    errors = exc.errors()
    param = _field(errors[0]) if errors and errors[0]["type"] != "json_invalid" else ""
    return _error(ApiError(400, "; ".join(problem(e, content_type) for e in errors) or "invalid request body",
                           param=param or None))


def _field(error: dict) -> str:
    """The body field a pydantic error is about ("" for the body as a whole)."""
    return ".".join(str(p) for p in error["loc"] if p not in ("body", ONE, MANY))


def problem(error: dict, content_type: str = "") -> str:
    """One pydantic error as `field: message` (the body's own checks: the message)."""
    if error["type"] == "json_invalid":
        reason = error.get("ctx", {}).get("error", "")
        return f"the body is not valid JSON: {reason} (at character {error['loc'][-1]})"
    if error["type"] == "model_attributes_type" and tuple(error["loc"]) == ("body",):
        if isinstance(error.get("input"), bytes):  # FastAPI reads a body not said to be JSON as bytes
            return f"the body must be a JSON object sent as application/json, not {content_type or 'untyped'}"
        return f"the body must be a JSON object, not {_json_kind(error.get('input'))}"
    where = _field(error)
    message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _json_kind(value) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false",
            type(None): "null"}.get(type(value), "that")


async def _http_error(_: Request, exc: StarletteHTTPException):
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    return _error(ApiError(exc.status_code, str(exc.detail), kind=kind, headers=exc.headers))


def refusal(exc: Exception) -> ApiError | None:
    """A request's refusal as the client is told it (None: not a refusal, but
    unexpected): its own, a worker's (its message, not its traceback), or an
    SLO rejection (429 with Retry-After and its predictions). Also what a
    background response's failure says (cluster/app.py)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, error_message(exc))
    if isinstance(exc, SloRejected):
        return ApiError(
            429, str(exc), kind="slo_rejection", headers={"Retry-After": str(exc.retry_after_s)},
            predicted_ttft_ms=round(exc.best.ttft_s * 1e3, 1), target_ttft_ms=round(exc.ttft_slo_s * 1e3, 1),
            predicted_tbt_ms=round(exc.best.tbt_s * 1e3, 1), target_tbt_ms=round(exc.tbt_slo_s * 1e3, 1))
    return None


async def _refused(_: Request, exc: Exception):
    return _error(refusal(exc))


async def _unexpected(_: Request, exc: Exception):
    log.exception("unhandled error")
    return _error(ApiError(500, f"internal error: {type(exc).__name__}", kind="internal_error"))


def _is_key(authorization: str, key: str) -> bool:
    """Whether an Authorization header carries the API key, compared in constant
    time (`hmac.compare_digest`): `!=` stops at the first byte that differs, and
    how long it took says how many were right."""
    return hmac.compare_digest(authorization.encode(), f"Bearer {key}".encode())


class RequestGuard:
    """API key (every endpoint but /health) and the request body size limit, as
    plain ASGI middleware: Starlette's `@app.middleware("http")` wraps every
    request and response in extra tasks and streams, about a millisecond each.

    It also turns Serve's way of saying the client left into ASGI's: once the
    proxy has cancelled a request, the replica's `receive()` raises
    `TaskCancelledError` instead of answering `http.disconnect`, and a streaming
    response listening for the disconnect let it escape as an unhandled error (a
    traceback in the log for about a third of the streams a client closed)."""

    def __init__(self, asgi_app, owner: FastAPI) -> None:
        self.app = asgi_app
        self.owner = owner  # whose state.settings (set by the Scheduler replica) say the key and the limit

    async def __call__(self, scope, receive, send) -> None:
        receive = functools.partial(_receive_or_disconnect, receive)
        settings: AppSettings | None = getattr(self.owner.state, "settings", None)
        if scope["type"] != "http" or settings is None:
            return await self.app(scope, receive, send)
        open_call()  # before its body is read and its prompt tokenized: an abort asked since ends it
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        key = settings.resolved_api_key
        route = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if key and route != "/health" and not _is_key(headers.get("authorization", ""), key):
            error = ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                             kind="authentication_error")
            return await _error(error)(scope, receive, send)
        limit = settings.limits.max_body_bytes
        too_large = _error(ApiError(413, f"request body over {limit} bytes", kind="request_too_large"))
        length = headers.get("content-length")
        if length is not None and (not (length.isascii() and length.isdigit()) or int(length) > limit):  # ('²': a 500)
            return await too_large(scope, receive, send)
        if scope["method"] == "POST" and length is None:  # chunked: read it all, then replay
            messages, size = [], 0
            while True:
                message = await receive()
                messages.append(message)
                size += len(message.get("body", b""))
                if size > limit:
                    return await too_large(scope, receive, send)
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break

            async def replay():
                return messages.pop(0) if messages else await receive()

            BODY_BYTES.set(size)  # (where its prompt is prepared: cluster/prompt_thread.py)
            return await self.app(scope, replay, send)
        BODY_BYTES.set(int(length or 0))
        return await self.app(scope, receive, send)


async def _receive_or_disconnect(receive):
    try:
        return await receive()
    except ray.exceptions.TaskCancelledError:
        return {"type": "http.disconnect"}
