"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure the API reports.

Handlers turn FastAPI's request-validation failures (its default is 422) into 400s, ``ValueError`` raised while
building a request into 400s, and anything unexpected into a 500 that still carries the OpenAI body.
"""
from __future__ import annotations

import logging
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from strataserve.types.errors import EngineDeadError

log = logging.getLogger("strataserve.api")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error the API answers with ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | int | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(msgspec.json.encode(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(exc: ValueError) -> APIError:
    """SamplingParams and the engine say ``name=value is out of range: ...``; name the param when we can."""
    message = str(exc) or "invalid request"
    head = message.split("=", 1)[0].split("[", 1)[0].strip()  # "logit_bias[7]=150.0 ..." names logit_bias
    param = head if head.isidentifier() and "=" in message else None
    return APIError(400, message, param=param)


def engine_dead(exc: BaseException | None = None) -> APIError:
    detail = f": {exc}" if exc is not None and str(exc) else ""
    # Retry-After: the engine's supervisor restarts it (api/server.py), so a retry may well succeed.
    return APIError(503, f"the inference engine is not running{detail}", code="engine_dead",
                    type="service_unavailable", headers={"Retry-After": "5"})


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    parts = []
    for err in errors[:3]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg')}")
    more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> Response:
        return from_value_error(exc).response()

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> Response:
        return engine_dead(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        err = APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
        if request.url.path.startswith("/v2"):  # KServe's body, which tritonclient reads as a string
            return Response(msgspec.json.encode({"error": _kserve_detail(request.url.path, err.message)}),
                            status_code=err.status, headers=err.headers, media_type="application/json")
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error while serving a request")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


def _kserve_detail(path: str, message: str) -> str:
    if "sharedmemory" in path:
        return (f"{message}: this server has no shared-memory extension (system or CUDA); send tensors in the "
                "request body")
    if path.startswith(("/v2/trace", "/v2/logging")):
        return f"{message}: this server has no trace or logging extension"
    return f"{message}: {path}"
