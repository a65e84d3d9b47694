"""BLS for in-process Python models: `InferenceRequest.exec` / `async_exec` (decoupled too) and Triton's model
management calls (`pb_utils.is_model_ready`, `load_model`, `unload_model`).

Model code runs on its own threads; every call here runs on the server's event loop
(`run_coroutine_threadsafe`) and the model's thread waits for it, or awaits it from its instance loop.
A failed call comes back as an error response carrying the Triton code of the server's error (NOT_FOUND for
an unknown model, ...), as in Triton; a decoupled call gives an iterator over the callee's responses. A call runs
in the context of the model's thread, which holds the caller of the requests it executes (``batcher.py``): behind
the router, a call that reaches an LLM is checked and charged as that caller's (``router/repo_llm.py``).
"""

from __future__ import annotations

import asyncio
import json
import queue
from typing import Any, AsyncIterator, Callable

from strataserve.modelserver import pb_runtime
from strataserve.modelserver.pb_errors import TritonModelException, bls_error
from strataserve.types.tensors import InferRequest, InferResponse, InferTensor, ModelServerError, kserve_dtype_of

_DONE = object()


def _server(what: str) -> tuple[Any, asyncio.AbstractEventLoop]:
    server = pb_runtime.current_server()
    loop = getattr(server, "loop", None)
    if server is None or loop is None:
        raise TritonModelException(f"{what} works only in an in-process Python model of a running server (not "
                                   "with EXECUTION_ISOLATION 'process')")
    try:
        if asyncio.get_running_loop() is loop:
            raise TritonModelException(f"{what} cannot be called on the server's event loop")
    except RuntimeError:
        pass  # no loop on this thread: the usual case
    return server, loop


def _request(req: Any) -> InferRequest:
    return InferRequest(
        model_name=req.model_name(), model_version="" if req._model_version < 0 else str(req._model_version),
        id=req.request_id() or None,
        inputs=[InferTensor(t.name(), kserve_dtype_of(t.as_numpy()), list(t.as_numpy().shape), t.as_numpy())
                for t in req.inputs()],
        requested_outputs=req.requested_output_names() or None,
        parameters=json.loads(req.parameters() or "{}"),
    )


def response_of(resp: InferResponse) -> Any:
    from strataserve.modelserver import pb_utils

    error = getattr(resp, "error", None)  # a decoupled callee's error response mid-stream
    if isinstance(error, ModelServerError):
        return error_response(error, resp.model_name)
    return pb_utils.InferenceResponse([pb_utils.Tensor(o.name, o.data) for o in resp.outputs],
                                      parameters=dict(resp.parameters) or None)


def error_response(exc: BaseException, callee: str) -> Any:
    from strataserve.modelserver import pb_utils

    if not isinstance(exc, ModelServerError):
        raise exc
    return pb_utils.InferenceResponse(error=bls_error(exc, callee))


def _timeout_s(req: Any) -> float | None:
    return req.timeout() / 1e6 if req.timeout() else None


def _timed_out(req: Any) -> ModelServerError:
    return ModelServerError("deadline_exceeded", f"BLS request to model '{req.model_name()}' did not finish "
                            f"within its timeout of {req.timeout()} us")


async def _infer(server: Any, req: Any) -> InferResponse:
    try:
        return await asyncio.wait_for(server.infer(_request(req)), _timeout_s(req))
    except asyncio.TimeoutError:
        raise _timed_out(req) from None


async def _pump(server: Any, req: Any, put: Callable[[Any], None]) -> None:
    """Every response of a (decoupled) call to ``put``, then _DONE; an error ends the call."""
    try:
        async with asyncio.timeout(_timeout_s(req)):
            async for resp in server.infer_stream(_request(req)):
                put(response_of(resp))
    except TimeoutError:
        put(error_response(_timed_out(req), req.model_name()))
    except ModelServerError as e:
        put(error_response(e, req.model_name()))
    finally:
        put(_DONE)


def exec_request(req: Any, decoupled: bool) -> Any:
    server, loop = _server("InferenceRequest.exec() (BLS)")
    if decoupled:
        return ResponseIterator(server, loop, req)
    try:
        return response_of(asyncio.run_coroutine_threadsafe(_infer(server, req), loop).result())
    except ModelServerError as e:
        return error_response(e, req.model_name())


async def async_exec_request(req: Any, decoupled: bool) -> Any:
    server, loop = _server("InferenceRequest.async_exec() (BLS)")
    if decoupled:
        return ResponseIterator(server, loop, req)
    try:
        return response_of(await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_infer(server, req), loop)))
    except ModelServerError as e:
        return error_response(e, req.model_name())


class ResponseIterator:
    """The responses of a decoupled BLS call, as they come; `cancel()` cancels the call. Iterable as in Triton
    (`for r in ...`, also after `await async_exec(decoupled=True)`) and, without blocking an event loop,
    with `async for`."""

    def __init__(self, server: Any, loop: asyncio.AbstractEventLoop, req: Any):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._done = False
        self._future = asyncio.run_coroutine_threadsafe(_pump(server, req, self._items.put), loop)

    def _take(self) -> Any:
        item = _DONE if self._done else self._items.get()
        self._done = item is _DONE
        return item

    def __iter__(self) -> "ResponseIterator":
        return self

    def __next__(self) -> Any:
        item = self._take()
        if item is _DONE:
            raise StopIteration
        return item

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        item = await asyncio.get_running_loop().run_in_executor(None, self._take)
        if item is _DONE:
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        self._future.cancel()


# ------------------------------------------------------------------------------------------- model management
def _control(what: str, make: Callable[[Any], Any]) -> Any:
    server, loop = _server(f"pb_utils.{what}")
    ctx = pb_runtime.current()
    if ctx is not None and ctx.initializing and what != "is_model_ready":
        raise TritonModelException(f"pb_utils.{what} cannot be called from initialize(): the server is loading "
                                   "this model; call it from execute()")
    try:
        return asyncio.run_coroutine_threadsafe(make(server), loop).result()
    except ModelServerError as e:
        raise TritonModelException(e.message) from None


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    async def ready(server: Any) -> bool:
        return bool(server.model_ready(model_name, str(model_version)))

    return _control("is_model_ready", ready)


def load_model(model_name: str, config: str = "", files: dict | None = None) -> None:
    """Triton's BLS model loading: only in explicit model control mode (the server refuses it otherwise)."""
    if files:
        raise TritonModelException("pb_utils.load_model: file overrides ('files') are not supported")
    if config and not isinstance(config, str):
        raise TritonModelException("pb_utils.load_model: 'config' must be a JSON string")
    _control("load_model", lambda server: server.load(model_name, {"config": config} if config else None))


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    _control("unload_model", lambda server: server.unload(model_name, unload_dependents=unload_dependents))
