"""The ``Door`` (``api/door.py``) on the KServe gRPC front: an interceptor that checks the ``authorization:
Bearer <key>`` metadata, the drain state, the key's request rate and the queued-bytes budget before a call runs,
and counts the call as in flight until it ends (so a drain waits for it).

The liveness and readiness probes (``ServerLive``, ``ServerReady``) stay open, as ``/v2/health/*`` do over HTTP;
``ServerReady`` answers not-ready while draining.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

import grpc

from strataserve.api.door import Door
from strataserve.api.errors import APIError
from strataserve.api.proto import grpc_service_pb2 as pb

_PREFIX = "/inference.GRPCInferenceService/"
_OPEN = frozenset({_PREFIX + "ServerLive", _PREFIX + "ServerReady"})
_CHARGED = frozenset({_PREFIX + "ModelInfer", _PREFIX + "ModelStreamInfer", _PREFIX + "RepositoryModelLoad",
                      _PREFIX + "RepositoryModelUnload"})  # work, as HTTP's POSTs; reads do not spend the rate
_CODES = {401: grpc.StatusCode.UNAUTHENTICATED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


def _auth(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class DoorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, door: Door) -> None:
        self.door = door

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return handler
        if details.method in _OPEN:
            if details.method.endswith("ServerReady") and self.door.draining:
                async def not_ready(request: Any, context: grpc.aio.ServicerContext) -> Any:
                    return pb.ServerReadyResponse(ready=False)

                return handler._replace(unary_unary=not_ready)
            return handler
        auth = _auth(details.invocation_metadata)
        door, charge = self.door, details.method in _CHARGED
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                nbytes = request.ByteSize()
                await _admit(door, auth, nbytes, charge, context)
                door.enter(nbytes)
                try:
                    return await inner(request, context)
                finally:
                    door.leave(nbytes)

            return handler._replace(unary_unary=unary)
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                await _admit(door, auth, 0, charge, context)
                door.enter(0)
                try:
                    async for response in inner_stream(requests, context):
                        yield response
                finally:
                    door.leave(0)

            return handler._replace(stream_stream=stream)
        return handler


async def _admit(door: Door, auth: str | None, nbytes: int, charge: bool,
                 context: grpc.aio.ServicerContext) -> None:
    try:
        door.authorize(auth)
        door.admit(auth, nbytes, charge)
    except APIError as err:
        retry = (err.headers or {}).get("Retry-After")
        if retry:
            context.set_trailing_metadata((("retry-after", retry),))
        await context.abort(_CODES.get(err.status, grpc.StatusCode.UNKNOWN), err.message)
