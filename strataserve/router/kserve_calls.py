"""What a KServe call through the router shares with the ``/v1`` routes: the caller's SLA class and API key
(``KSERVE_CALLER``, set per call by the HTTP and gRPC fronts), an OpenAI-side refusal in KServe's terms (its
Retry-After kept), the outcome a failed call counts under, and the router's admission, tokens-per-minute charge
and per-class trace around an upstream KServe model's infer (``/v1`` forwards an upstream OpenAI model the same
way: one unit of work, traced until it ends).

Tokens per minute of an upstream tensor call. A call with a BYTES ``text_input`` (Triton's LLM tensors) is charged
as an upstream ``/v1`` request is (``api/serving.py``): its prompt at 4 characters a token (the router holds no
tokenizer of the upstream's) plus ``n`` x the ``max_tokens`` it asks for (a request parameter, a field of its
``sampling_parameters`` JSON, which wins as the model reads it, or a ``max_tokens`` input tensor as TensorRT-LLM's
ensemble takes). A ``text_input`` call that names no output budget is charged its prompt alone: Python text
models take ``text_input`` too and write no tokens, and an LLM left at its own default writes what the upstream
decides (vLLM's default is 16 tokens), which the router cannot know. Any other tensor call holds no tokens and is
not charged: its requests per minute are charged at the door. Nothing is refunded afterwards, as on ``/v1``.

``--limit-max-tokens`` holds a ``text_input`` call's budget, read from the same places, as ``/v1`` holds a forwarded
request's (``hold_to_limit``): above the limit is a 400 (gRPC INVALID_ARGUMENT) before anything is charged.
"""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np

from strataserve.api.errors import APIError
from strataserve.api.limits import RequestLimits
from strataserve.api.serving import Routed
from strataserve.modelserver.autocomplete import TEXT_INPUT
from strataserve.modelserver.llm_io import SAMPLING_PARAMETERS
from strataserve.router.router import outcome_of
from strataserve.router.sla import bearer_key
from strataserve.types.tensors import KSERVE_CALLER, InferRequest, InferResponse, InferTensor, ModelServerError

if TYPE_CHECKING:
    from strataserve.router.backends.kserve_upstream import KServeUpstreamBackend
    from strataserve.router.router import Router
    from strataserve.router.types import Backend

#: output tensor with the tokens an LLM wrote (Triton's vLLM backend, ours), when the caller asked for it
NUM_OUTPUT_TOKENS = "num_output_tokens"
MAX_TOKENS = "max_tokens"
#: what vLLM (Triton's vLLM backend) writes for a text_input call that names no max_tokens
UPSTREAM_DEFAULT_MAX_TOKENS = 16
_CODES = {400: "invalid_argument", 403: "permission_denied", 404: "not_found", 413: "invalid_argument",
          429: "resource_exhausted", 499: "unavailable", 504: "deadline_exceeded", 502: "bad_gateway"}


class KServeRefusal(ModelServerError):
    """A refusal with the headers it is sent with (a 429's Retry-After): the HTTP front sends them, the gRPC
    front sends Retry-After as ``retry-after`` trailing metadata (as the door does)."""

    def __init__(self, code: str, message: str, headers: dict[str, str]) -> None:
        super().__init__(code, message)
        self.headers = headers


def kserve_error(exc: APIError) -> ModelServerError:
    """An OpenAI-side refusal as the KServe fronts answer it (same status, the message naming the field)."""
    code = _CODES.get(exc.status, "unavailable" if exc.status >= 500 else "invalid_argument")
    if exc.headers:
        return KServeRefusal(code, exc.message, dict(exc.headers))
    return ModelServerError(code, exc.message)


def outcome(exc: BaseException) -> str:
    """The metrics outcome of a call that ended with ``exc``; a ModelServerError counts by its HTTP status, as
    the same APIError would on ``/v1``."""
    if isinstance(exc, ModelServerError):
        return outcome_of(APIError(exc.http_status, exc.message))
    return outcome_of(exc)


def count_refusal(router: Router, routed: Routed | None, exc: BaseException) -> None:
    """Count a call that failed before its trace (a bad parameter, the key's tokens per minute, a dead engine)
    under the outcome a traced one would get, as ``/v1``'s ``counts_outcome`` does; a call refused before its
    class was known (``routed`` None) has no series to count in."""
    if routed is not None and not routed.counted:
        routed.counted = True
        router.metrics.reject(routed.backend.name, routed.sla.name, outcome(exc))


def caller_routed(router: Router, backend: Backend, limits: RequestLimits) -> Routed:
    """The call's route: its SLA class from the caller's ``x-sla-class`` and key (APIError 400 for an unknown
    class, 403 for one above the key's)."""
    header, auth = KSERVE_CALLER.get()
    key = bearer_key(auth)
    return Routed(router, backend, router.policy.resolve(header, key), key, limits)


def tensor_call_tokens(request: InferRequest) -> float | None:
    """The tokens per minute an upstream infer is charged (module doc); None: no text, no tokens."""
    prompt = _prompt(request)
    if prompt is None:
        return None
    chars = sum(len(_text(v)) for v in prompt.data.reshape(-1).tolist())
    fields = _budget_fields(request)
    most, n = _count(fields.get(MAX_TOKENS)), _count(fields.get("n"))
    return chars / 4 + (n or 1) * (most or 0)


def hold_to_limit(request: InferRequest, limits: RequestLimits) -> None:
    """``--limit-max-tokens`` on an upstream ``text_input`` call, as ``/v1`` applies it to a forwarded request
    (``api/serving.py``): a budget above the limit is refused (APIError 400 naming max_tokens); a null one (the
    model's "rest of the context") is set to the limit; an unset one keeps the upstream's default (vLLM's 16,
    as /v1/completions keeps the protocol's 16) unless the limit is lower, when the limit is written where the
    model reads it. A value that is not a count is left for the upstream's own 400."""
    most = limits.max_tokens
    if most is None or _prompt(request) is None:
        return
    fields = _budget_fields(request)
    value = fields.get(MAX_TOKENS)
    if value is not None:
        asked = _count(value)
        if asked is not None:  # the /v1 check and message; stop strings and logit_bias are not read here
            limits.check(SimpleNamespace(n=1, max_tokens=asked, stop=None, logit_bias=None))
        return
    if MAX_TOKENS in fields or most < UPSTREAM_DEFAULT_MAX_TOKENS:
        _set_budget(request, most)


def _prompt(request: InferRequest) -> InferTensor | None:
    """The call's BYTES ``text_input`` (an LLM's or a text model's prompt), if it has one."""
    prompt = _input(request, TEXT_INPUT)
    return prompt if prompt is not None and prompt.datatype == "BYTES" else None


def _sampling(request: InferRequest) -> tuple[InferTensor, dict] | None:
    """The ``sampling_parameters`` tensor and its JSON object (None: absent, empty or not an object; a bad one is
    the upstream's to answer with its own 400)."""
    sampling = _input(request, SAMPLING_PARAMETERS)
    if sampling is None or not sampling.data.size:
        return None
    try:
        doc = json.loads(_text(sampling.data.reshape(-1)[0]))
    except ValueError:
        return None
    return (sampling, doc) if isinstance(doc, dict) else None


def _set_budget(request: InferRequest, most: int) -> None:
    """Write max_tokens where the model reads it: the sampling_parameters JSON (which wins), else a parameter."""
    found = _sampling(request)
    if found is None or found[0].data.size != 1:
        request.parameters = {**(request.parameters or {}), MAX_TOKENS: most}
        return
    sampling, doc = found
    sampling.data = np.array([json.dumps({**doc, MAX_TOKENS: most}).encode()], dtype=object).reshape(
        sampling.data.shape)


def _budget_fields(request: InferRequest) -> dict:
    """The request's sampling fields as the model reads them: its parameters, a one-value ``max_tokens`` tensor
    over them, the sampling_parameters JSON over both."""
    fields = dict(request.parameters or {})
    budget = _input(request, MAX_TOKENS)
    if budget is not None and budget.data.size == 1:
        fields[MAX_TOKENS] = budget.data.reshape(-1)[0]
    found = _sampling(request)
    if found is not None:
        fields.update(found[1])
    return fields


def _input(request: InferRequest, name: str) -> InferTensor | None:
    return next((t for t in request.inputs if t.name == name), None)


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _count(value: object) -> int | None:
    """A positive count as a client may send it (Triton's vLLM clients send strings, TensorRT-LLM an INT32
    tensor); anything else None (the upstream answers a bad value with its own 400)."""
    if isinstance(value, bytes):
        value = _text(value)
    try:
        n = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return None
    return n if n >= 1 and not isinstance(value, bool) else None


async def infer_upstream(router: Router, backend: KServeUpstreamBackend, request: InferRequest,
                         limits: RequestLimits) -> InferResponse:
    """Forward one infer to an upstream KServe model with the class checks, admission, tokens-per-minute charge
    and metrics of ``/v1``. Output tokens (hence cost per 1k output tokens) are known only when the answer
    carries ``num_output_tokens`` (an LLM asked for it): a tensor answer has no token count to divide the cost
    by."""
    routed: Routed | None = None
    try:
        routed = caller_routed(router, backend, limits)
        hold_to_limit(request, limits)  # --limit-max-tokens (400), before the charge reads the budget
        # the class's TTFT admission (429; an upstream's work is its outstanding requests), then the key's tokens
        routed.check(1.0, tensor_call_tokens(request))
    except APIError as exc:
        count_refusal(router, routed, exc)
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
