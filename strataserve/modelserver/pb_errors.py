"""`pb_utils.TritonError` and how its codes meet the server's errors, both ways.

A Python model's error response keeps its Triton code up to the client: HTTP status and gRPC status follow
Triton's own mapping (server `http_server.cc` HttpCodeFromError, `grpc_utils.cc` TritonCodeToGrpcCode). A BLS
call that fails comes back to the calling model with the Triton code of the server's error; the router's refusals,
which Triton has no code for (an API key's 403, a 429 with its Retry-After), reach the client as they were when
the model returns the error as it got it.
"""

from __future__ import annotations

from strataserve.types.tensors import ModelServerError


class TritonModelException(Exception):
    """What pb_utils raises into model code."""


class TritonError:
    # TRITONSERVER_Error_Code values, as pb_utils exposes them
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    _refusal: ModelServerError | None = None  # the router's refusal of a BLS call (bls_error)

    def __init__(self, message: str, code: int = 1):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code})"


# Triton code -> (ModelServerError code closest in meaning, HTTP status, gRPC status name)
_STATUS: dict[int, tuple[str, int, str]] = {
    TritonError.UNKNOWN: ("internal", 400, "UNKNOWN"),
    TritonError.INTERNAL: ("internal", 500, "INTERNAL"),
    TritonError.NOT_FOUND: ("not_found", 404, "NOT_FOUND"),
    TritonError.INVALID_ARG: ("invalid_argument", 400, "INVALID_ARGUMENT"),
    TritonError.UNAVAILABLE: ("unavailable", 503, "UNAVAILABLE"),
    TritonError.UNSUPPORTED: ("failed_precondition", 501, "UNIMPLEMENTED"),
    TritonError.ALREADY_EXISTS: ("failed_precondition", 400, "ALREADY_EXISTS"),
    TritonError.CANCELLED: ("invalid_argument", 400, "CANCELLED"),
}
# ModelServerError code -> Triton code (what a BLS caller reads from resp.error().code())
_TRITON_CODE = {
    "not_found": TritonError.NOT_FOUND, "invalid_argument": TritonError.INVALID_ARG,
    "unavailable": TritonError.UNAVAILABLE, "resource_exhausted": TritonError.UNAVAILABLE,
    "deadline_exceeded": TritonError.UNAVAILABLE,  # Triton's request timeouts are UNAVAILABLE
    "internal": TritonError.INTERNAL, "failed_precondition": TritonError.INVALID_ARG,
    "bad_gateway": TritonError.INTERNAL,
}


class TritonStatusError(ModelServerError):
    """A ModelServerError that answers with the HTTP / gRPC status Triton gives its Triton code."""

    def __init__(self, triton_code: int, message: str):
        code, self._http, self._grpc = _STATUS.get(triton_code, _STATUS[TritonError.INTERNAL])
        super().__init__(code, message)
        self.triton_code = triton_code

    @property
    def http_status(self) -> int:
        return self._http

    @property
    def grpc_code(self) -> str:
        return self._grpc


_REFUSALS = ("permission_denied", "resource_exhausted")  # the router's (router/kserve_calls.py); not Triton codes


def bls_error(exc: ModelServerError, callee: str) -> TritonError:
    """A failed BLS call's error as the calling model reads it; the router's refusal (whose message names no
    model) names the model called and is kept beside it."""
    if exc.code not in _REFUSALS:
        return TritonError(exc.message, triton_code_of(exc))
    refusal = ModelServerError(exc.code, f"BLS call to model '{callee}': {exc.message}", exc.headers)
    err = TritonError(refusal.message, triton_code_of(refusal))
    err._refusal = refusal
    return err


def error_from_triton(err: object, model: str) -> ModelServerError:
    """A model's error response (a TritonError, or anything else it put there) -> the client's error."""
    if isinstance(err, TritonError):
        refusal = err._refusal
        if refusal is not None and err.message() == refusal.message:  # passed on as it came: its status, headers
            return ModelServerError(refusal.code, f"model '{model}': {err.message()}", refusal.headers)
        return TritonStatusError(err.code(), f"model '{model}': {err.message()}")
    return ModelServerError("internal", f"model '{model}': {err}")


def triton_code_of(exc: ModelServerError) -> int:
    return getattr(exc, "triton_code", None) if isinstance(exc, TritonStatusError) else \
        _TRITON_CODE.get(exc.code, TritonError.INTERNAL)
