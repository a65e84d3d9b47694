"""KServe v2 over HTTP: infer request bodies (JSON, or a JSON header + the binary-data extension) in, responses
out, request parameters and Content-Encoding. The tensors themselves are ``api/kserve_tensors.py``'s.

Every malformed input raises ``ModelServerError("invalid_argument", ...)`` naming what is wrong, so the front
answers 400 and keeps serving. BYTES outputs that are not valid UTF-8 lose no byte: the infer response sends them
binary, the all-JSON forms (SSE, decoupled) as base64 with ``content_type: "base64"``.
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from strataserve.api.kserve_tensors import (
    invalid,
    tensor_from_json,
    tensor_from_raw,
    tensor_to_json_data,
    tensor_to_raw,
)
from strataserve.types.tensors import InferRequest, InferResponse, InferTensor

HEADER_LENGTH = "Inference-Header-Content-Length"


def _enc_hook(obj: Any) -> Any:
    """JSON for what models put in parameters / generate outputs: numpy scalars and arrays, bytes."""
    if isinstance(obj, (np.generic, np.ndarray)):
        return obj.tolist()
    if isinstance(obj, bytes):
        return obj.decode("utf-8", "replace")
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def json_dumps(obj: Any) -> bytes:
    return msgspec.json.encode(obj, enc_hook=_enc_hook)


def parameters_of(obj: dict, where: str) -> dict:
    """The optional `parameters` object of a request / tensor (absent or null: empty)."""
    params = obj.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise invalid(f"{where}'parameters' must be a JSON object, got {type(params).__name__}")
    return params


# ---------------------------------------------------------------------------------------------- requests
@dataclass
class HttpInferRequest:
    """A decoded HTTP infer request plus how the client wants each output encoded."""

    request: InferRequest
    binary_outputs: dict[str, bool] = field(default_factory=dict)  # per requested output
    binary_default: bool = False  # request parameter binary_data_output


MAX_DECOMPRESSED_BYTES = 1 << 30  # a small gzip body must not inflate into unbounded memory


def decompress(body: bytes, content_encoding: str | None) -> bytes:
    """Undo a request's Content-Encoding (tritonclient's request_compression_algorithm: gzip / deflate)."""
    enc = (content_encoding or "").strip().lower()
    if enc in ("", "identity"):
        return body
    if enc not in ("gzip", "deflate"):
        raise invalid(f"unsupported Content-Encoding {content_encoding!r}; use gzip, deflate or none")
    d = zlib.decompressobj(16 + zlib.MAX_WBITS if enc == "gzip" else zlib.MAX_WBITS)
    try:
        out = d.decompress(body, MAX_DECOMPRESSED_BYTES)
    except zlib.error as exc:
        raise invalid(f"request body is not valid {enc} data: {exc}") from None
    if d.unconsumed_tail:
        raise invalid(f"request body inflates to more than {MAX_DECOMPRESSED_BYTES} bytes")
    return out


def _decode_non_finite(body: bytes) -> Any | None:
    """A body msgspec refused, parsed again when it holds ``NaN`` / ``Infinity`` tokens: Triton's JSON parser
    takes them and tritonclient writes them for non-finite floats sent as JSON (binary_data=False). None: still
    not JSON (msgspec's error then says where). Only bodies that already failed pay for this second parse."""
    if b"NaN" not in body and b"Infinity" not in body:
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def decode_json_object(body: bytes) -> dict:
    """A request body that must be one JSON object (every KServe HTTP route's)."""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        doc = _decode_non_finite(body)
        if doc is None:
            raise invalid(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec recurses per nesting level
        raise invalid("request body is nested too deeply") from None
    if not isinstance(doc, dict):
        raise invalid("request body must be a JSON object")
    return doc


def _int_param(params: dict, key: str) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise invalid(f"request parameter '{key}' must be a non-negative integer, got {value!r}")
    return value


def _bool_param(params: dict, key: str, default: bool, where: str) -> bool:
    """A boolean parameter (binary_data, binary_data_output). Triton refuses other JSON types; truthiness would
    read the string "false" as true and answer binary to a client that asked for JSON."""
    value = params.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{where}parameter '{key}' must be true or false, got {value!r}")
    return value


_SHARED_MEMORY = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
_CLASSIFICATION = ("classification", "class_count")


def check_tensor_parameters(params: dict, where: str) -> None:
    """Refuse the tensor parameters of extensions this server does not have, rather than ignore them (a client
    would then read a region nobody wrote, or get scores where it asked for labels)."""
    for key in _SHARED_MEMORY:
        if key in params:
            raise invalid(f"{where}parameter '{key}': this server has no shared-memory extension (system or CUDA); "
                          "send the tensor in the request and read it from the response")
    for key in _CLASSIFICATION:
        if key in params:
            raise invalid(f"{where}parameter '{key}': this server has no classification extension; request the "
                          "output tensor itself")


def check_requested_outputs(names: list[str]) -> list[str] | None:
    """The requested output names: none (an empty list too) means every output; a name twice is an error."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise invalid(f"output '{name}' is requested twice")
        seen.add(name)
    return names or None


def split_request_parameters(params: dict) -> tuple[int, int | None]:
    """Triton's `priority` and `timeout` (microseconds) request parameters."""
    return _int_param(params, "priority") or 0, _int_param(params, "timeout")


def decode_http_request(
    body: bytes, header_length: str | None, model_name: str, model_version: str = ""
) -> HttpInferRequest:
    """HTTP infer body (JSON, or JSON header + binary tensors) -> InferRequest with binary preferences."""
    if header_length is not None:
        try:
            hlen = int(header_length)
        except ValueError:
            raise invalid(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 <= hlen <= len(body):
            raise invalid(f"{HEADER_LENGTH} is {hlen} but the body has only {len(body)} bytes")
        header, blob = body[:hlen], memoryview(body)[hlen:]
    else:
        header, blob = body, memoryview(b"")
    doc = decode_json_object(header)
    params = parameters_of(doc, "")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list):
        raise invalid("request needs an 'inputs' list")

    inputs: list[InferTensor] = []
    pos = 0
    for k, item in enumerate(raw_inputs):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise invalid(f"inputs[{k}] must be an object with a string 'name'")
        name = item["name"]
        for key in ("datatype", "shape"):
            if key not in item:
                raise invalid(f"input '{name}': missing '{key}'")
        iparams = parameters_of(item, f"input '{name}': ")
        check_tensor_parameters(iparams, f"input '{name}': ")
        size = iparams.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise invalid(f"input '{name}': binary_data_size must be a non-negative integer, got {size!r}")
            if pos + size > len(blob):
                raise invalid(
                    f"input '{name}': binary_data_size {size} runs past the binary data "
                    f"({len(blob) - pos} bytes left after the JSON header)"
                )
            rest = {k2: v for k2, v in iparams.items() if k2 != "binary_data_size"}
            inputs.append(tensor_from_raw(name, item["datatype"], item["shape"], blob[pos : pos + size], rest))
            pos += size
        else:
            if "data" not in item:
                raise invalid(f"input '{name}': needs 'data' or parameters.binary_data_size")
            inputs.append(tensor_from_json(name, item["datatype"], item["shape"], item["data"], iparams))
    if pos != len(blob):
        raise invalid(f"{len(blob) - pos} bytes of binary data are not claimed by any input's binary_data_size")

    binary_default = _bool_param(params, "binary_data_output", False, "request ")
    requested: list[str] | None = None
    binary_outputs: dict[str, bool] = {}
    if doc.get("outputs") is not None:
        if not isinstance(doc["outputs"], list):
            raise invalid("'outputs' must be a list")
        requested = []
        for k, out in enumerate(doc["outputs"]):
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise invalid(f"outputs[{k}] must be an object with a string 'name'")
            oparams = parameters_of(out, f"output '{out['name']}': ")
            check_tensor_parameters(oparams, f"output '{out['name']}': ")
            requested.append(out["name"])
            where = f"output '{out['name']}': "
            binary_outputs[out["name"]] = _bool_param(oparams, "binary_data", binary_default, where)
        requested = check_requested_outputs(requested)
    priority, timeout_us = split_request_parameters(params)
    rid = doc.get("id")
    req = InferRequest(
        model_name=model_name,
        model_version=model_version,
        id=None if rid is None else str(rid),
        inputs=inputs,
        requested_outputs=requested,
        parameters={k: v for k, v in params.items() if k not in ("binary_data_output", "priority", "timeout")},
        priority=priority,
        timeout_us=timeout_us,
    )
    return HttpInferRequest(req, binary_outputs, binary_default)


def _response_doc(resp: InferResponse, outputs: list[dict]) -> dict:
    doc: dict[str, Any] = {"model_name": resp.model_name, "model_version": resp.model_version}
    if resp.id is not None:
        doc["id"] = resp.id
    if resp.parameters:
        doc["parameters"] = resp.parameters
    doc["outputs"] = outputs
    return doc


def response_to_dict(resp: InferResponse) -> dict:
    """InferResponse -> KServe v2 JSON object (all tensors inline; non-UTF-8 BYTES as base64)."""
    outputs = []
    for t in resp.outputs:
        data = tensor_to_json_data(t)
        params = dict(t.parameters)
        if data is None:
            data = [base64.b64encode(x).decode("ascii") for x in np.asarray(t.data).reshape(-1)]
            params["content_type"] = "base64"
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape), "data": data}
        if params:
            entry["parameters"] = params
        outputs.append(entry)
    return _response_doc(resp, outputs)


def encode_http_response(resp: InferResponse, decoded: HttpInferRequest) -> tuple[bytes, int | None]:
    """InferResponse -> (body, JSON header length or None when the body is pure JSON)."""
    outputs = []
    blobs: list[bytes] = []
    for t in resp.outputs:
        binary = decoded.binary_outputs.get(t.name, decoded.binary_default)
        params = dict(t.parameters)
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        data = None if binary else tensor_to_json_data(t)
        if data is None:
            raw = tensor_to_raw(t)
            params["binary_data_size"] = len(raw)
            blobs.append(raw)
        else:
            entry["data"] = data
        if params:
            entry["parameters"] = params
        outputs.append(entry)
    header = json_dumps(_response_doc(resp, outputs))
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)
