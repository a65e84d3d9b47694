"""What a KServe call through the router shares with the ``/v1`` routes: the caller's SLA class and API key
(``KSERVE_CALLER``, set per call by the HTTP and gRPC fronts), an OpenAI-side refusal in KServe's terms, the
outcome a failed call counts under, and the router's admission and per-class trace around an upstream KServe
model's infer (``/v1`` forwards an upstream OpenAI model the same way: one unit of work, traced until it ends).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from strataserve.api.errors import APIError
from strataserve.api.limits import RequestLimits
from strataserve.api.serving import Routed
from strataserve.router.router import outcome_of
from strataserve.router.sla import bearer_key
from strataserve.types.tensors import KSERVE_CALLER, InferRequest, InferResponse, ModelServerError

if TYPE_CHECKING:
    from strataserve.router.backends.kserve_upstream import KServeUpstreamBackend
    from strataserve.router.router import Router
    from strataserve.router.types import Backend

#: output tensor with the tokens an LLM wrote (Triton's vLLM backend, ours), when the caller asked for it
NUM_OUTPUT_TOKENS = "num_output_tokens"
_CODES = {400: "invalid_argument", 403: "permission_denied", 404: "not_found", 413: "invalid_argument",
          429: "resource_exhausted", 499: "unavailable", 504: "deadline_exceeded", 502: "bad_gateway"}


def kserve_error(exc: APIError) -> ModelServerError:
    """An OpenAI-side refusal as the KServe fronts answer it (same status, the message naming the field)."""
    code = _CODES.get(exc.status, "unavailable" if exc.status >= 500 else "invalid_argument")
    return ModelServerError(code, exc.message)


def outcome(exc: BaseException) -> str:
    """The metrics outcome of a call that ended with ``exc``; a ModelServerError counts by its HTTP status, as
    the same APIError would on ``/v1``."""
    if isinstance(exc, ModelServerError):
        return outcome_of(APIError(exc.http_status, exc.message))
    return outcome_of(exc)


def caller_routed(router: Router, backend: Backend, limits: RequestLimits) -> Routed:
    """The call's route: its SLA class from the caller's ``x-sla-class`` and key (APIError 400 for an unknown
    class, 403 for one above the key's)."""
    header, auth = KSERVE_CALLER.get()
    key = bearer_key(auth)
    return Routed(router, backend, router.policy.resolve(header, key), key, limits)


async def infer_upstream(router: Router, backend: KServeUpstreamBackend, request: InferRequest,
                         limits: RequestLimits) -> InferResponse:
    """Forward one infer to an upstream KServe model with the class checks, admission and metrics of ``/v1``.
    Output tokens (hence cost per 1k output tokens) are known only when the answer carries ``num_output_tokens``
    (an LLM asked for it): a tensor answer has no token count to divide the cost by."""
    try:
        routed = caller_routed(router, backend, limits)
        routed.check(1.0)  # the class's TTFT admission (429); an upstream's work is its outstanding requests
    except APIError as exc:
        raise kserve_error(exc) from None
    trace = routed.trace(1.0)
    try:
        response = await backend.infer(request)
    except BaseException as exc:  # an upstream error, a timeout, or the caller gone (cancelled)
        trace.finish(outcome(exc))
        raise
    trace.finish("ok", _output_tokens(response))
    return response


def _output_tokens(response: InferResponse) -> int | None:
    for t in response.outputs:
        if t.name == NUM_OUTPUT_TOKENS:
            try:
                return int(t.data.sum())
            except (TypeError, ValueError):
                return None
    return None
