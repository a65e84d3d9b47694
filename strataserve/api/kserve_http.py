"""KServe v2 / Open Inference Protocol HTTP routes over a `ModelServer` (Triton's HTTP extensions included).

`make_kserve_router(model_server)` returns a FastAPI APIRouter; the app that mounts it owns start-up.
Errors are `{"error": "..."}` with the status that the `ModelServerError` code maps to (400/404/429/503/504);
only a bug in the server itself answers 500. A model name may hold slashes (an LLM served under its folder path,
as the repository index lists it): the per-model paths are read from their end, see kserve_paths.py.

Decoupled models (zero, one or many responses per request) over HTTP -- Triton refuses them on /infer:
- `POST .../infer` with `Accept: text/event-stream` streams each response as an SSE event
  `data: <v2 response JSON>` (tensors inline as JSON), then `data: [DONE]` (generate_stream: JSON events only);
- a plain `POST .../infer` waits for the last response and answers one JSON object
  `{"model_name", "model_version", "id", "responses": [<v2 response JSON>, ...]}`;
- `.../generate_stream` streams them too when the model takes generate-style inputs.
An error before the first response gets its HTTP status; one after it becomes a last event
`data: {"error": "..."}`. A decoupled model's error response that is not its last (Triton goes on after it)
is an event / a `responses` entry `{"error": "..."}` and the later responses follow. The all-JSON forms put BYTES that are not UTF-8 in base64 (`content_type`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from strataserve.api.errors import APIError
from strataserve.api.formatting import line_safe
from strataserve.api.kserve_codec import (
    HEADER_LENGTH,
    decode_http_request,
    decode_json_object,
    decompress,
    encode_http_response,
    json_dumps,
    parameters_of,
    response_to_dict,
)
from strataserve.api.kserve_paths import (
    GET_ROUTES,
    POST_ROUTES,
    REPOSITORY_PREFIX,
    TRACE,
    ModelPath,
    raw_rest,
    split_model_path,
    split_repository_path,
)
from strataserve.api.serving import until_disconnect
from strataserve.types.tensors import KSERVE_CALLER, ModelServerError

logger = logging.getLogger(__name__)

OFFLOAD_BYTES = 1 << 20  # bodies / outputs larger than this are (de)coded on a worker thread
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _guard(fn: Callable[[], Response | Awaitable[Response]]) -> Response:
    """Run a handler, mapping ModelServerError to its status (with the headers a router refusal carries: a
    429's Retry-After) and anything else to a logged 500."""
    try:
        out = fn()
        return await out if inspect.isawaitable(out) else out
    except ModelServerError as exc:
        return _error(exc.http_status, exc.message, getattr(exc, "headers", None))
    except Exception as exc:  # a server bug: report it, keep serving
        logger.exception("KServe HTTP handler failed")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


async def _json_body(request: Request, *, allow_empty: bool = True) -> dict:
    body = decompress(await request.body(), request.headers.get("content-encoding"))
    if not body.strip():
        if allow_empty:
            return {}
        raise ModelServerError("invalid_argument", "request body must be a JSON object, got an empty body")
    return decode_json_object(body)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(json_dumps(obj), status_code=status, media_type="application/json")


async def _maybe(value: Any) -> Any:
    """The model-server surface is sync on a local ModelServer and async on the router's TensorRouter."""
    return await value if inspect.isawaitable(value) else value


async def _json_of(value: Any) -> Response:
    return _json(await _maybe(value))


def _sse(event: Any) -> bytes:
    return b"data: " + line_safe(json_dumps(event)) + b"\n\n"


async def _sse_stream(first: Any, rest: AsyncIterator[Any], to_json: Callable[[Any], Any],
                      done: bool = True) -> AsyncIterator[bytes]:
    """SSE events for an already-started stream; errors after the first event become an error event. ``done``:
    end with ``data: [DONE]`` (infer-SSE; Triton's generate_stream sends JSON objects only, so not there)."""
    try:
        yield _sse(to_json(first))
        async for item in rest:
            yield _sse(to_json(item))
    except ModelServerError as exc:
        yield _sse({"error": exc.message})
        return
    except Exception as exc:
        logger.exception("KServe stream failed")
        yield _sse({"error": f"internal error: {type(exc).__name__}: {exc}"})
        return
    finally:  # also on client disconnect: let the model server stop producing for this request now
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()
    if done:
        yield b"data: [DONE]\n\n"


async def _start_stream(it: AsyncIterator[Any], to_json: Callable[[Any], Any], done: bool = True) -> Response:
    """Pull the first item before answering so an early error still gets its proper HTTP status."""
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        return StreamingResponse(iter([b"data: [DONE]\n\n"] if done else []), media_type="text/event-stream",
                                 headers=_SSE_HEADERS)
    return StreamingResponse(_sse_stream(first, it, to_json, done), media_type="text/event-stream",
                             headers=_SSE_HEADERS)


def make_kserve_router(model_server: Any) -> APIRouter:
    """Routes of the KServe v2 protocol (+ Triton statistics, repository, generate) over `model_server`."""
    ms = model_server
    router = APIRouter()

    # ------------------------------------------------------------------------------ infer + generate
    # Registered first: routes match in order, and infer is the hot path (each route tried costs a regex).
    # One route per method for every per-model path: a model name may hold slashes (kserve_paths.py).
    @router.post("/v2/models/{rest:path}")
    async def model_post(request: Request) -> Response:
        target = split_model_path(raw_rest(request))
        if target is None or target.route not in POST_ROUTES:
            return _no_route(request, target, "GET")
        m, v = target.name, target.version
        KSERVE_CALLER.set((request.headers.get("x-sla-class"), request.headers.get("authorization")))
        if target.route == "infer":
            return await _guard(lambda: _infer(ms, request, m, v))
        stream = target.route == "generate_stream"

        async def generate() -> Response:
            doc = await _json_body(request, allow_empty=False)
            names = {"text_input"}  # the usual body needs no look-up: a model without it would refuse it anyway
            if any(k not in ("parameters", "id", "text_input") for k in doc):  # which other keys are inputs
                meta = await _maybe(ms.model_metadata(m, v))
                names |= {t["name"] for t in meta.get("inputs", ())}
            inputs, params = _generate_args(doc, names)
            if stream:
                return await _start_stream(aiter_of(ms.generate_stream(m, v, inputs, params)), lambda d: d,
                                           done=False)
            try:  # a client that hangs up stops its request
                return _json(await until_disconnect(request, ms.generate(m, v, inputs, params)))
            except APIError as exc:
                if exc.status != 499:
                    raise
                return Response(status_code=499)

        return await _guard(generate)

    # ------------------------------------------------------------------------------------------ health
    @router.get("/v2/health/live")
    async def health_live() -> Response:
        live = ms.live()
        return _json({"live": live}, 200 if live else 503)

    @router.get("/v2/health/ready")
    async def health_ready() -> Response:
        ready = ms.ready()
        return _json({"ready": ready}, 200 if ready else 503)

    @router.get("/v2")
    async def server_metadata() -> Response:
        return await _guard(lambda: _json(ms.server_metadata()))

    # ------------------------------------------------------------------------ statistics (before {m})
    @router.get("/v2/models/stats")
    async def all_stats() -> Response:
        return await _guard(lambda: _json_of(ms.statistics()))

    # ------------------------------------------------------------------------------------ per model
    @router.get("/v2/models/{rest:path}")
    async def model_get(request: Request) -> Response:
        target = split_model_path(raw_rest(request))
        if target is None or target.route not in GET_ROUTES and target.route:
            return _no_route(request, target, "POST")
        m, v, route = target.name, target.version, target.route
        if route == "config":
            return await _guard(lambda: _json_of(ms.model_config(m, v)))
        if route == "stats":
            return await _guard(lambda: _json_of(ms.statistics(m, v)))
        if not route:
            return await _guard(lambda: _json_of(ms.model_metadata(m, v)))

        async def ready() -> Response:
            if await _maybe(ms.model_ready(m, v)):
                return _json({"name": m, "ready": True})
            label = f"'{m}'" + (f" version {v}" if v else "")
            return _error(400, f"model {label} is not ready")

        return await _guard(ready)

    # ----------------------------------------------------------------------------------- repository
    @router.post("/v2/repository/index")
    async def repository_index(request: Request) -> Response:
        async def run() -> Response:
            doc = await _json_body(request)
            return _json(await _maybe(ms.repository_index(ready_only=bool(doc.get("ready", False)))))

        return await _guard(run)

    @router.post("/v2/repository/models/{rest:path}")
    async def repository_control(request: Request) -> Response:
        target = split_repository_path(raw_rest(request, REPOSITORY_PREFIX))
        if target is None:
            return _error(404, f"Not Found: {request.url.path} (this path takes .../NAME/load or .../NAME/unload)")
        name, verb = target

        async def run() -> Response:
            params = _params_of(await _json_body(request))
            if verb == "load":
                await ms.load(name, params or None)
            else:
                await ms.unload(name, unload_dependents=bool(params.get("unload_dependents", False)))
            return _json({})

        return await _guard(run)

    return router


def _stream_item(resp: Any) -> dict:
    error = getattr(resp, "error", None)  # modelserver.model.ErrorResponse: one failed response mid-stream
    return {"error": error.message} if isinstance(error, ModelServerError) else response_to_dict(resp)


def aiter_of(obj: Any) -> AsyncIterator[Any]:
    return obj.__aiter__()


def _no_route(request: Request, target: ModelPath | None, other_method: str) -> Response:
    """404, or 405 where the path is a route of the other method (as separate routes per method answered)."""
    path = request.url.path
    if target is None:
        return _error(404, f"Not Found: {path}")
    if target.route == TRACE:
        return _error(404, f"Not Found: {path}: this server has no trace or logging extension")
    return JSONResponse({"error": f"Method Not Allowed: {request.method} {path} (it takes {other_method})"},
                        status_code=405, headers={"Allow": other_method})


def _params_of(doc: dict) -> dict:
    return parameters_of(doc, "")


def _generate_args(doc: dict, input_names: set[str]) -> tuple[dict, dict]:
    """Triton's generate extension: a top-level key (but 'parameters' and 'id') that names a model input is that
    input; any other is a parameter, as if given in 'parameters' (which wins where both give one)."""
    explicit = _params_of(doc)
    inputs = {k: v for k, v in doc.items() if k not in ("parameters", "id") and k in input_names}
    extra = {k: v for k, v in doc.items() if k not in ("parameters", "id") and k not in input_names}
    return inputs, {**extra, **explicit}


def _payload_bytes(data: Any) -> int:
    arr = np.asarray(data)
    if arr.dtype != object:
        return arr.nbytes
    return sum(len(x) for x in arr.flat if isinstance(x, (bytes, str)))


async def _off_loop(big: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """Run codec work on a thread when it is big, so one large tensor does not stall every other client."""
    return await asyncio.to_thread(fn, *args) if big else fn(*args)


async def _infer(ms: Any, request: Request, m: str, v: str) -> Response:
    raw = await request.body()
    big = len(raw) > OFFLOAD_BYTES
    body = await _off_loop(big, decompress, raw, request.headers.get("content-encoding"))
    decoded = await _off_loop(big or len(body) > OFFLOAD_BYTES, decode_http_request, body,
                              request.headers.get(HEADER_LENGTH), m, v)
    streams = getattr(ms, "streams", None)
    sse = "text/event-stream" in request.headers.get("accept", "")
    if ms.is_decoupled(m, v) or (sse and streams is not None and streams(m, v)):
        stream = aiter_of(ms.infer_stream(decoded.request))
        if sse:
            return await _start_stream(stream, _stream_item)
        responses = [_stream_item(r) async for r in stream]
        version = next((r["model_version"] for r in reversed(responses) if "model_version" in r), v)
        rid = decoded.request.id or ""
        return _json({"model_name": m, "model_version": version, "id": rid, "responses": responses})
    try:  # a client that hangs up takes its request out of the model's queue (as gRPC's cancel does)
        resp = await until_disconnect(request, ms.infer(decoded.request))
    except APIError as exc:
        if exc.status != 499:
            raise
        return Response(status_code=499)  # nobody reads it
    out_bytes = sum(_payload_bytes(t.data) for t in resp.outputs)
    out, header_len = await _off_loop(out_bytes > OFFLOAD_BYTES, encode_http_response, resp, decoded)
    if header_len is None:
        return Response(out, media_type="application/json")
    return Response(out, media_type="application/octet-stream", headers={HEADER_LENGTH: str(header_len)})
