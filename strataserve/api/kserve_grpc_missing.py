"""Triton's gRPC extension methods this server lacks (shared memory, trace, logging), answered UNIMPLEMENTED with
a message that names the extension and what to do instead.

Without this handler gRPC itself answers UNIMPLEMENTED "Method not found!", which tritonclient prints as is and
which does not tell a user whether the name, the server or the feature is at fault. The HTTP front says the same
for these routes (``api/errors.py``).
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import empty_pb2

SERVICE = "/inference.GRPCInferenceService/"
_SHARED_MEMORY = ("this server has no shared-memory extension (system or CUDA); send tensors in the request "
                  "(raw_input_contents) and read them from the response")
_TRACE_LOG = "this server has no trace or logging extension"
MISSING: dict[str, str] = {
    **{f"{kind}SharedMemory{verb}": _SHARED_MEMORY
       for kind in ("System", "Cuda") for verb in ("Status", "Register", "Unregister")},
    "TraceSetting": _TRACE_LOG,
    "LogSettings": _TRACE_LOG,
}


class MissingExtensions(grpc.GenericRpcHandler):
    """Serves only the method names in MISSING (every other method is the servicer's or gRPC's own 'not found')."""

    def service(self, handler_call_details: Any) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if not method.startswith(SERVICE) or method[len(SERVICE):] not in MISSING:
            return None
        message = f"{method[len(SERVICE):]}: {MISSING[method[len(SERVICE):]]}"

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

        # read as an Empty message (its fields kept as unknown ones): the door's interceptor sizes every request
        return grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=empty_pb2.Empty.FromString)
