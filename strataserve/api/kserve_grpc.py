"""KServe v2 gRPC front (`inference.GRPCInferenceService`) over a `ModelServer`, on grpc.aio.

The server runs on the asyncio loop that calls `start_grpc_server` -- the loop uvicorn serves HTTP on -- so
both fronts feed the same dynamic batchers without cross-thread hand-offs:

    handle = await start_grpc_server(model_server, host, port)   # e.g. in the FastAPI lifespan
    ...
    await handle.stop()

Tensors come in as `raw_input_contents` (what tritonclient sends) or typed `contents`, and always go out as
`raw_output_contents`. ModelStreamInfer runs the requests of one stream concurrently (so they batch) and
sends every response of a decoupled model; a failing request sends an `error_message` and the stream goes on
(a decoupled model's error response mid-stream too, as Triton: its later responses still follow).
Errors map from ModelServerError codes to INVALID_ARGUMENT / NOT_FOUND / UNAVAILABLE / ...
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
import numpy as np
from google.protobuf import json_format

from strataserve.api.kserve_codec import check_requested_outputs, check_tensor_parameters, split_request_parameters
from strataserve.api.kserve_grpc_missing import MissingExtensions
from strataserve.api.kserve_tensors import check_shape, tensor_from_raw, tensor_to_raw
from strataserve.api.proto import grpc_service_pb2 as pb
from strataserve.api.proto import grpc_service_pb2_grpc as pb_grpc
from strataserve.types import model_config_pb2
from strataserve.types.tensors import KSERVE_CALLER, KSERVE_DTYPES, InferRequest, InferResponse, InferTensor, ModelServerError

logger = logging.getLogger(__name__)

# datatype -> the InferTensorContents field that carries it (FP16/BF16: raw contents only)
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_EMPTY_FINAL = "triton_enable_empty_final_response"
_FINAL_FLAG = "triton_final_response"


def _bad(message: str) -> ModelServerError:
    return ModelServerError("invalid_argument", message)


# ---------------------------------------------------------------------------------------------- parameters
def _param_value(p: Any) -> Any:
    """InferParameter / ModelRepositoryParameter -> Python value (None when unset)."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _params_to_dict(params: Any) -> dict[str, Any]:
    return {k: _param_value(v) for k, v in params.items()}


def _fill_params(target: Any, params: dict[str, Any]) -> None:
    for key, value in params.items():
        p = target[key]
        if isinstance(value, (bool, np.bool_)):
            p.bool_param = bool(value)
        elif isinstance(value, (int, np.integer)):
            p.int64_param = int(value)
        elif isinstance(value, (float, np.floating)):
            p.double_param = float(value)
        else:
            p.string_param = str(value)


# ---------------------------------------------------------------------------------------------- tensors
def _tensor_from_contents(t: Any) -> InferTensor:
    field = _CONTENTS_FIELD.get(t.datatype)
    if t.datatype not in KSERVE_DTYPES:
        raise _bad(f"input '{t.name}': unsupported datatype {t.datatype!r}; use one of {sorted(KSERVE_DTYPES)}")
    if field is None:
        raise _bad(f"input '{t.name}': {t.datatype} data must be sent in raw_input_contents")
    shape = check_shape(t.name, list(t.shape))
    values = getattr(t.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise _bad(f"input '{t.name}': contents.{field} holds {len(values)} elements but shape {shape} needs {count}")
    if t.datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        arr[:] = list(values)
    else:
        try:
            arr = np.asarray(values, dtype=KSERVE_DTYPES[t.datatype])
        except (OverflowError, ValueError) as exc:
            raise _bad(f"input '{t.name}': a value does not fit {t.datatype}: {exc}") from None
    return InferTensor(t.name, t.datatype, shape, arr.reshape(shape), _params_to_dict(t.parameters))


def decode_infer_request(msg: Any) -> tuple[InferRequest, bool]:
    """ModelInferRequest -> (InferRequest, whether the client asked for an empty final stream response)."""
    if not msg.model_name:
        raise _bad("model_name is empty")
    raw = msg.raw_input_contents
    if raw and len(raw) != len(msg.inputs):
        raise _bad(f"raw_input_contents has {len(raw)} entries but the request has {len(msg.inputs)} inputs")
    inputs = []
    for i, t in enumerate(msg.inputs):
        check_tensor_parameters(_params_to_dict(t.parameters), f"input '{t.name}': ")
        if raw:
            inputs.append(tensor_from_raw(t.name, t.datatype, list(t.shape), raw[i], _params_to_dict(t.parameters)))
        else:
            inputs.append(_tensor_from_contents(t))
    for o in msg.outputs:
        check_tensor_parameters(_params_to_dict(o.parameters), f"output '{o.name}': ")
    params = _params_to_dict(msg.parameters)
    empty_final = bool(params.pop(_EMPTY_FINAL, False))
    priority, timeout_us = split_request_parameters(params)
    params = {k: v for k, v in params.items() if k not in ("priority", "timeout")}
    req = InferRequest(
        model_name=msg.model_name,
        model_version=msg.model_version,
        id=msg.id or None,
        inputs=inputs,
        requested_outputs=check_requested_outputs([o.name for o in msg.outputs]),
        parameters=params,
        priority=priority,
        timeout_us=timeout_us,
    )
    return req, empty_final


def encode_infer_response(resp: InferResponse, final: bool | None = None) -> Any:
    """InferResponse -> ModelInferResponse with raw_output_contents; `final` sets triton_final_response."""
    out = pb.ModelInferResponse(model_name=resp.model_name, model_version=resp.model_version, id=resp.id or "")
    _fill_params(out.parameters, resp.parameters)
    if final is not None:
        out.parameters[_FINAL_FLAG].bool_param = final
    for t in resp.outputs:
        o = out.outputs.add(name=t.name, datatype=t.datatype, shape=[int(d) for d in t.shape])
        _fill_params(o.parameters, t.parameters)
        out.raw_output_contents.append(tensor_to_raw(t))
    return out


# ---------------------------------------------------------------------------------------------- servicer
async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, ModelServerError):
        retry = (getattr(exc, "headers", None) or {}).get("Retry-After")  # a router refusal's (a 429)
        if retry:
            context.set_trailing_metadata((("retry-after", retry),))  # as the door sends it
        await context.abort(grpc.StatusCode[exc.grpc_code], exc.message)
    logger.exception("KServe gRPC handler failed", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


class _Servicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, model_server: Any):
        self.ms = model_server

    async def _call(self, context: grpc.aio.ServicerContext, fn: Any) -> Any:
        try:
            out = fn()
            return await out if asyncio.iscoroutine(out) else out
        except Exception as exc:
            await _abort(context, exc)

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=bool(self.ms.live()))

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=bool(self.ms.ready()))

    async def ModelReady(self, request, context):
        async def run() -> Any:
            return pb.ModelReadyResponse(ready=bool(await _maybe(self.ms.model_ready(request.name, request.version))))

        return await self._call(context, run)

    async def ServerMetadata(self, request, context):
        return await self._call(context, lambda: _parse(self.ms.server_metadata(), pb.ServerMetadataResponse()))

    async def ModelMetadata(self, request, context):
        async def run() -> Any:
            return _parse(await _maybe(self.ms.model_metadata(request.name, request.version)),
                          pb.ModelMetadataResponse())

        return await self._call(context, run)

    async def ModelConfig(self, request, context):
        async def run() -> Any:
            doc = await _maybe(self.ms.model_config(request.name, request.version))
            return pb.ModelConfigResponse(config=_parse(doc, model_config_pb2.ModelConfig()))

        return await self._call(context, run)

    async def ModelStatistics(self, request, context):
        async def run() -> Any:
            return _parse(await _maybe(self.ms.statistics(request.name, request.version)),
                          pb.ModelStatisticsResponse())

        return await self._call(context, run)

    async def RepositoryIndex(self, request, context):
        async def run() -> Any:
            out = pb.RepositoryIndexResponse()
            for m in await _maybe(self.ms.repository_index(ready_only=request.ready)):
                out.models.add(**{k: str(m.get(k, "") or "") for k in ("name", "version", "state", "reason")})
            return out

        return await self._call(context, run)

    async def RepositoryModelLoad(self, request, context):
        async def run() -> Any:
            params = _params_to_dict(request.parameters)
            await self.ms.load(request.model_name, params or None)
            return pb.RepositoryModelLoadResponse()

        return await self._call(context, run)

    async def RepositoryModelUnload(self, request, context):
        async def run() -> Any:
            params = _params_to_dict(request.parameters)
            await self.ms.unload(request.model_name, unload_dependents=bool(params.get("unload_dependents")))
            return pb.RepositoryModelUnloadResponse()

        return await self._call(context, run)

    async def ModelInfer(self, request, context):
        _set_caller(context)

        async def run() -> Any:
            req, _ = decode_infer_request(request)
            if self.ms.is_decoupled(req.model_name, req.model_version):
                raise ModelServerError(
                    "invalid_argument",
                    f"model '{req.model_name}' is decoupled (it may send several responses): "
                    "use ModelStreamInfer, or HTTP .../infer with Accept: text/event-stream",
                )
            return encode_infer_response(await self.ms.infer(req))

        return await self._call(context, run)

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator[Any]:
        _set_caller(context)
        queue: asyncio.Queue = asyncio.Queue()
        done = object()
        tasks: set[asyncio.Task] = set()

        async def run_one(msg: Any) -> None:
            try:
                req, empty_final = decode_infer_request(msg)
                if self.ms.is_decoupled(req.model_name, req.model_version) or _streams(self.ms, req):
                    marked = False  # a response went out with triton_final_response true (Triton: no empty one)
                    async for resp in self.ms.infer_stream(req):
                        error = getattr(resp, "error", None)  # modelserver.model.ErrorResponse
                        if isinstance(error, ModelServerError):
                            queue.put_nowait(_stream_error(msg, error.message))
                            continue
                        final = bool(getattr(resp, "final", False))  # modelserver.model.StreamResponse
                        marked = marked or (empty_final and final)
                        queue.put_nowait(pb.ModelStreamInferResponse(
                            infer_response=encode_infer_response(resp, final if empty_final else None)))
                    if empty_final and not marked:
                        last = pb.ModelInferResponse(model_name=req.model_name, model_version=req.model_version)
                        last.id = req.id or ""
                        last.parameters[_FINAL_FLAG].bool_param = True
                        queue.put_nowait(pb.ModelStreamInferResponse(infer_response=last))
                else:
                    resp = await self.ms.infer(req)
                    final = True if empty_final else None
                    queue.put_nowait(pb.ModelStreamInferResponse(infer_response=encode_infer_response(resp, final)))
            except Exception as exc:
                if not isinstance(exc, ModelServerError):
                    logger.exception("KServe gRPC stream request failed")
                text = exc.message if isinstance(exc, ModelServerError) else f"internal error: {type(exc).__name__}: {exc}"
                queue.put_nowait(_stream_error(msg, text))

        async def reader() -> None:
            try:
                async for msg in request_iterator:
                    task = asyncio.create_task(run_one(msg))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
            finally:
                queue.put_nowait(done)

        reader_task = asyncio.create_task(reader())
        try:
            while (item := await queue.get()) is not done:
                yield item
        finally:  # client went away or stream ended: stop what is still running for it
            reader_task.cancel()
            for task in list(tasks):
                task.cancel()


def _stream_error(msg: Any, text: str) -> Any:
    # the request's id travels with its error so raw-protocol clients can tell which one failed
    who = pb.ModelInferResponse(model_name=msg.model_name, model_version=msg.model_version, id=msg.id)
    return pb.ModelStreamInferResponse(error_message=text, infer_response=who)


async def _maybe(value: Any) -> Any:
    """Sync on a local ModelServer, async on the router's TensorRouter (upstream models answer over the net)."""
    return await value if inspect.isawaitable(value) else value


def _parse(doc: Any, message: Any) -> Any:
    """The model server's JSON-shaped dicts -> protobuf (unknown keys are ignored, the shapes match)."""
    return json_format.ParseDict(doc, message, ignore_unknown_fields=True)


# ---------------------------------------------------------------------------------------------- server
@dataclass
class GrpcServerHandle:
    server: grpc.aio.Server
    host: str
    port: int  # the bound port (useful when started with port=0)

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.server.stop(grace_s)


async def start_grpc_server(model_server: Any, host: str = "0.0.0.0", port: int = 8001, *, door: Any = None,
                            max_message_bytes: int | None = None,
                            tls: tuple[str, str] | None = None) -> GrpcServerHandle:
    """Start the gRPC front on the running asyncio loop; port=0 picks a free port (see handle.port). ``door``
    (``api/door.py``) adds API keys, rate limits and drain; ``max_message_bytes`` bounds a message each way
    (a larger one fails with RESOURCE_EXHAUSTED); ``tls`` = (certfile, keyfile) serves TLS only."""
    limit = -1 if max_message_bytes is None else max_message_bytes
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
               ("grpc.so_reuseport", 0)]  # a second server on the port must fail, not share its clients
    interceptors = []
    if door is not None:
        from strataserve.api.grpc_door import DoorInterceptor

        interceptors.append(DoorInterceptor(door))
    server = grpc.aio.server(options=options, interceptors=interceptors)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(_Servicer(model_server), server)
    server.add_generic_rpc_handlers((MissingExtensions(),))  # shared memory, trace, log: a clear UNIMPLEMENTED
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if tls is not None:
            with open(tls[0], "rb") as cert, open(tls[1], "rb") as key:
                creds = grpc.ssl_server_credentials([(key.read(), cert.read())])
            bound = server.add_secure_port(address, creds)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # gRPC's own text points at GRPC_VERBOSITY; a taken port is the usual cause
        raise OSError(f"cannot bind the KServe gRPC server to {address}: is another server on the port? (choose "
                      "another with --grpc-port, or 0 for none)") from None
    if not bound:
        raise OSError(f"cannot bind the KServe gRPC server to {address} (port in use?)")
    await server.start()
    return GrpcServerHandle(server, host, bound)


def _streams(ms: Any, req: Any) -> bool:
    """A model that is not decoupled but sends its answer in pieces on a stream (a local text model)."""
    streams = getattr(ms, "streams", None)
    return bool(streams is not None and streams(req.model_name, req.model_version))


def _set_caller(context: Any) -> None:
    """The call's SLA class and key, for a text model's request (router/text_tensors.py); tasks started from
    here (each stream request's) inherit it."""
    meta = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
    KSERVE_CALLER.set((meta.get("x-sla-class"), meta.get("authorization")))
