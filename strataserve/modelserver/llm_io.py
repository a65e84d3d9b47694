"""Triton's LLM text I/O over KServe (the tensors of Triton's vLLM backend), shared by the repository's LLM models
(``modelserver/llm.py``) and the text models served from the command line or a router config
(``router/text_tensors.py``), so both read a request and shape its responses the same way.

Inputs: ``text_input`` (BYTES [1], the prompt) and, optional, ``stream`` (BOOL), ``sampling_parameters`` (BYTES:
a JSON object), ``exclude_input_in_output`` (BOOL) and ``return_finish_reason`` / ``return_num_input_tokens`` /
``return_num_output_tokens`` (BOOL). The sampling fields use vLLM's names (max_tokens, temperature, top_p, top_k,
seed, stop, ignore_eos, ...); they come from the request parameters (what the generate extension's
``parameters`` and tritonclient's ``parameters=`` send), and ``sampling_parameters`` overrides them. As in
Triton's vLLM backend, values given as strings (``{"temperature": "0.1"}``) are read as the field's type. The
control flags (stream, exclude_input_in_output, return_*) may also be given as parameters.

Decided where Triton's vLLM backend differs: ``text_output`` excludes the prompt unless
``exclude_input_in_output`` is false (it then leads the first response), so a greedy ``text_output`` equals the
``/v1/completions`` text; a streaming route streams pieces unless ``stream`` is false (then one response).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from strataserve.modelserver.autocomplete import TEXT_INPUT, TEXT_OUTPUT, add_llm_io
from strataserve.modelserver.config import ModelSpec, build_spec
from strataserve.types import model_config_pb2 as pb
from strataserve.types.tensors import InferRequest, InferResponse, InferTensor, ModelServerError

STREAM, SAMPLING_PARAMETERS, EXCLUDE_INPUT = "stream", "sampling_parameters", "exclude_input_in_output"
#: flag input -> the output it adds (Triton's vLLM backend names)
RETURNS = {"return_finish_reason": "finish_reason", "return_num_input_tokens": "num_input_tokens",
           "return_num_output_tokens": "num_output_tokens"}
CONTROL = frozenset({STREAM, EXCLUDE_INPUT, *RETURNS})
_INTERNAL = frozenset({"output_kind", "bad_words_token_ids"})  # the server's own SamplingParams fields
_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no"}


def text_model_config(name: str) -> pb.ModelConfig:
    """The config of a text model served outside the repository: every input and output above, one response
    per request (unary infer works; the streaming routes stream pieces)."""
    cfg = pb.ModelConfig(name=name, backend="llm", max_batch_size=0)
    add_llm_io(cfg)  # the repository's LLM models get the same tensors
    return cfg


def text_model_spec(name: str) -> ModelSpec:
    return build_spec(text_model_config(name), name, f"text model '{name}'")


@dataclass(frozen=True)
class TextRequest:
    prompt: str
    parameters: dict[str, Any]  # sampling fields, vLLM names, as given
    stream: bool | None  # None: the route decides (streaming routes stream)
    exclude_input: bool
    returns: frozenset[str]  # outputs asked for besides text_output


def _bad(model: str, message: str) -> ModelServerError:
    return ModelServerError("invalid_argument", f"model '{model}': {message}")


def _flag(value: Any, name: str, model: str) -> bool:
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise _bad(model, f"'{name}' must hold one value, got {value.size}")
        value = value.reshape(-1)[0]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise _bad(model, f"'{name}' must be true or false, got {value!r}")


def _text(arr: np.ndarray, name: str, model: str) -> str:
    values = arr.reshape(-1)
    if values.size != 1:
        raise _bad(model, f"'{name}' must hold one text, got {values.size}")
    v = values[0]
    try:
        return v.decode("utf-8") if isinstance(v, bytes) else str(v)
    except UnicodeDecodeError:
        raise _bad(model, f"'{name}' is not UTF-8") from None


def parse_text_request(inputs: dict[str, np.ndarray], parameters: dict, model: str) -> TextRequest:
    """``inputs``: the request's tensors by name (already checked against the model's config)."""
    params = dict(parameters or {})
    if SAMPLING_PARAMETERS in inputs:
        try:
            extra = json.loads(_text(inputs[SAMPLING_PARAMETERS], SAMPLING_PARAMETERS, model))
        except json.JSONDecodeError as e:
            raise _bad(model, f"'{SAMPLING_PARAMETERS}' is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise _bad(model, f"'{SAMPLING_PARAMETERS}' must be a JSON object, got {type(extra).__name__}")
        params.update(extra)
    control = {k: params.pop(k) for k in list(params) if k in CONTROL}
    control.update((k, v) for k, v in inputs.items() if k in CONTROL)  # a tensor wins over a parameter
    flags = {k: _flag(v, k, model) for k, v in control.items()}
    return TextRequest(
        prompt=_text(inputs[TEXT_INPUT], TEXT_INPUT, model),
        parameters=params,
        stream=flags.get(STREAM),
        exclude_input=flags.get(EXCLUDE_INPUT, True),
        returns=frozenset(out for flag, out in RETURNS.items() if flags.get(flag)),
    )


def _coerce(name: str, value: Any, annotation: str, model: str) -> Any:
    """A string value read as the field's type (Triton's vLLM clients send ``{"temperature": "0.1"}``)."""
    if not isinstance(value, str):
        return value
    kind = annotation.replace(" | None", "").strip()
    try:
        if kind == "float":
            return float(value)
        if kind == "int":
            return int(value)
    except ValueError:
        raise _bad(model, f"parameter '{name}'={value!r} is not {'an integer' if kind == 'int' else 'a number'}"
                   ) from None
    if kind == "bool":
        return _flag(value, name, model)
    return value


def _fits_int64(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return -(2**63) <= value < 2**63
    if isinstance(value, dict):
        return all(_fits_int64(k) and _fits_int64(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_fits_int64(v) for v in value)
    return True


def sampling_params(parameters: dict, model: str, defaults: dict | None = None):
    """SamplingParams of a request's sampling fields (vLLM names); what it leaves unset takes ``defaults`` (the
    checkpoint's generation config), else vLLM's defaults. Each refusal is a 400 naming the parameter."""
    from strataserve.types.sampling import GuidedDecodingParams, RequestOutputKind, SamplingParams

    types = {f.name: str(f.type) for f in fields(SamplingParams) if f.name not in _INTERNAL}
    unknown = sorted(k for k in parameters if k not in types and k not in CONTROL)
    if unknown:
        raise _bad(model, f"unknown parameters {unknown}; sampling parameters use vLLM names such as max_tokens, "
                   "temperature, top_p")
    given = {k: _coerce(k, v, types[k], model) for k, v in parameters.items() if k in types}
    for name in ("guided_decoding", "structured_outputs"):  # else a 500 AttributeError deep in SamplingParams
        value = given.get(name)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise _bad(model, f"parameter '{name}' must be a JSON object (e.g. {{\"regex\": \"...\"}}), got "
                       f"{type(value).__name__}")
        try:
            given[name] = GuidedDecodingParams(**value)
        except (TypeError, ValueError) as e:
            raise _bad(model, f"parameter '{name}': {e}") from None
    for name, value in given.items():  # integers cross to the engine as int64, as /v1 bounds them
        if not _fits_int64(value):
            raise _bad(model, f"parameter '{name}' holds an integer outside int64 [-2**63, 2**63-1]")
    if given.get("n", 1) != 1:
        raise _bad(model, f"parameter 'n'={given['n']!r}: one text per request (send n requests)")
    try:  # each response carries what is new
        return SamplingParams(**{**(defaults or {}), **given, "output_kind": RequestOutputKind.DELTA})
    except (TypeError, ValueError) as e:
        raise _bad(model, f"parameter {e}") from None


class TextResponder:
    """Engine outputs (DELTA kind) of one request -> its KServe responses: one per new piece when ``pieces``,
    else one with the whole text when the request finishes."""

    def __init__(self, spec: ModelSpec, version: str, req: InferRequest, text: TextRequest, pieces: bool):
        self.spec, self.version, self.req, self.pieces = spec, version, req, pieces
        self.prefix = "" if text.exclude_input else text.prompt  # leads the first response
        wanted = {TEXT_OUTPUT, *text.returns}
        if req.requested_outputs is not None:
            wanted = set(req.requested_outputs)
        missing = sorted(n for n in wanted if spec.output(n) is None)
        if missing:
            raise _bad(spec.name, f"has no outputs {missing}; its outputs are {[o.name for o in spec.outputs]}")
        self.names = [o.name for o in spec.outputs if o.name in wanted]
        self.parts: list[str] = []
        self.new_tokens = 0
        self.prompt_tokens = 0

    def feed(self, out: Any) -> InferResponse | None:
        """The response to send for this engine output, if any."""
        c = out.outputs[0]
        if c.finish_reason == "abort":  # the engine refused or dropped it
            if isinstance(c.stop_reason, str) and c.stop_reason:
                raise _bad(self.spec.name, c.stop_reason)
            raise ModelServerError("unavailable", f"model '{self.spec.name}': the engine aborted the request")
        self.prompt_tokens = self.prompt_tokens or len(out.prompt_token_ids or ())
        self.parts.append(c.text)
        self.new_tokens += len(c.token_ids)
        if not (out.finished or (self.pieces and c.text)):
            return None  # not finished, or an incomplete UTF-8 character: nothing to send yet
        text, self.parts = self.prefix + "".join(self.parts), []
        self.prefix = ""
        count, self.new_tokens = self.new_tokens, 0
        return self._response(text, count, c.finish_reason)

    def _response(self, text: str, new_tokens: int, finish_reason: str | None) -> InferResponse:
        values = {TEXT_OUTPUT: ("BYTES", text.encode()), "finish_reason": ("BYTES", str(finish_reason).encode()),
                  "num_input_tokens": ("UINT32", self.prompt_tokens), "num_output_tokens": ("UINT32", new_tokens)}
        tensors = []
        for name in self.names:
            dtype, v = values[name]
            arr = np.array([v], dtype=object if dtype == "BYTES" else np.uint32)
            tensors.append(InferTensor(name, dtype, [1], arr))
        extra = {"finish_reason": finish_reason} if finish_reason else {}
        return InferResponse(self.spec.name, self.version, self.req.id, tensors, parameters=extra)
