"""KServe v2 tensor codec: JSON tensors, the binary-data extension, and raw bytes <-> `InferTensor`.

Shared by the HTTP front (JSON + binary extension) and the gRPC front (raw_input_contents /
raw_output_contents). Every malformed input raises `ModelServerError("invalid_argument", ...)` naming the
tensor and what is wrong, so the fronts can answer 400 / INVALID_ARGUMENT and keep serving.

Conventions (Triton's): JSON `data` is the row-major flattened tensor (nested lists are accepted and
flattened); BYTES elements are UTF-8 strings, or base64 strings when the input has
`parameters.content_type == "base64"`; binary BYTES tensors are a run of elements each prefixed by its length
as a 4-byte little-endian unsigned int. BYTES outputs that are not valid UTF-8 lose no byte: the infer
response sends them binary, the all-JSON forms (SSE, decoupled) as base64 with `content_type: "base64"`.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from strataserve.types.tensors import (
    KSERVE_DTYPES,
    InferRequest,
    InferResponse,
    InferTensor,
    ModelServerError,
)

HEADER_LENGTH = "Inference-Header-Content-Length"
_INT_KINDS = "iu"


def _bad(message: str) -> ModelServerError:
    return ModelServerError("invalid_argument", message)


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
        raise _bad(f"{where}'parameters' must be a JSON object, got {type(params).__name__}")
    return params


def check_shape(name: str, shape: Any) -> list[int]:
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _bad(f"input '{name}': 'shape' must be a list of non-negative integers, got {shape!r}")
    return [int(d) for d in shape]


def _check_datatype(name: str, datatype: Any) -> np.dtype:
    if not isinstance(datatype, str) or datatype not in KSERVE_DTYPES:  # a list or object is not hashable
        raise _bad(f"input '{name}': unsupported datatype {datatype!r}; use one of {sorted(KSERVE_DTYPES)}")
    return KSERVE_DTYPES[datatype]


# ---------------------------------------------------------------------------------------------- raw bytes
def serialize_bytes_tensor(array: np.ndarray) -> bytes:
    """BYTES tensor -> elements each prefixed by a 4-byte little-endian length (row-major)."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        b = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def deserialize_bytes_tensor(name: str, raw: bytes | memoryview, count: int) -> np.ndarray:
    """Length-prefixed BYTES elements -> flat object array of `count` bytes; errors say where it broke."""
    view = memoryview(raw)
    if count > len(view) // 4:  # before allocating: a huge shape over a few bytes must not reserve memory for it
        raise _bad(f"input '{name}': BYTES data of {len(view)} bytes cannot hold the {count} elements its shape "
                   "declares (each element needs a 4-byte length prefix)")
    out = np.empty(count, dtype=object)
    pos, i = 0, 0
    while pos < len(view):
        if pos + 4 > len(view):
            raise _bad(f"input '{name}': BYTES data ends inside a 4-byte length prefix at offset {pos}")
        (n,) = struct.unpack_from("<I", view, pos)
        pos += 4
        if pos + n > len(view):
            raise _bad(f"input '{name}': BYTES element {i} declares {n} bytes but only {len(view) - pos} remain")
        if i >= count:
            raise _bad(f"input '{name}': BYTES data holds more than the {count} elements its shape declares")
        out[i] = bytes(view[pos : pos + n])
        pos += n
        i += 1
    if i != count:
        raise _bad(f"input '{name}': BYTES data holds {i} elements but its shape declares {count}")
    return out


def tensor_from_raw(name: str, datatype: str, shape: Any, raw: bytes | memoryview, parameters: dict | None = None) -> InferTensor:
    """Raw little-endian bytes (or length-prefixed BYTES) -> InferTensor, checking size against shape."""
    dtype = _check_datatype(name, datatype)
    dims = check_shape(name, shape)
    count = math.prod(dims)
    if datatype == "BYTES":
        flat = deserialize_bytes_tensor(name, raw, count)
    else:
        expected = count * dtype.itemsize
        if len(raw) != expected:
            raise _bad(
                f"input '{name}': got {len(raw)} bytes but shape {dims} of {datatype} needs {expected} bytes"
            )
        # a copy: the wire buffer is read-only, and model code (Python backend) may write to its inputs
        flat = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype, copy=True)
    return InferTensor(name, datatype, dims, flat.reshape(dims), dict(parameters or {}))


def tensor_to_raw(tensor: InferTensor) -> bytes:
    """InferTensor -> raw bytes in the wire layout (little-endian, row-major; BYTES length-prefixed)."""
    if tensor.datatype == "BYTES":
        return serialize_bytes_tensor(np.asarray(tensor.data, dtype=object))
    dtype = KSERVE_DTYPES[tensor.datatype]
    return np.ascontiguousarray(tensor.data, dtype=dtype.newbyteorder("<")).tobytes()


# ---------------------------------------------------------------------------------------------- JSON data
def _flatten(data: Any) -> list:
    if not isinstance(data, list):
        return [data]
    if not data or not isinstance(data[0], list):
        return data
    flat: list = []
    stack = [iter(data)]
    while stack:  # iterative so deep nesting cannot exhaust the recursion limit
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def _bytes_elements(name: str, flat: list, b64: bool) -> np.ndarray:
    out = np.empty(len(flat), dtype=object)
    for i, item in enumerate(flat):
        if not isinstance(item, str):
            raise _bad(f"input '{name}': BYTES element {i} must be a string, got {type(item).__name__}")
        if b64:
            try:
                out[i] = base64.b64decode(item, validate=True)
            except (binascii.Error, ValueError):
                raise _bad(f"input '{name}': BYTES element {i} is not valid base64") from None
        else:
            out[i] = item.encode("utf-8")
    return out


_ALLOWED_TYPES = {"b": {bool}, "i": {int}, "u": {int}, "f": {int, float}}


def _numeric_elements(name: str, datatype: str, dtype: np.dtype, flat: list) -> np.ndarray:
    # set(map(type, ...)) runs in C: this path is hot, and a per-element isinstance walk cost more than the
    # JSON parse itself; only a rejected tensor pays for the walk that names the offending element
    allowed = _ALLOWED_TYPES[dtype.kind]
    if not set(map(type, flat)) <= allowed:
        want = {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers"}[dtype.kind]
        i, item = next((i, x) for i, x in enumerate(flat) if type(x) not in allowed)
        raise _bad(f"input '{name}': {datatype} data must be {want}; element {i} is {item!r}")
    if dtype.kind in _INT_KINDS and flat:
        info = np.iinfo(dtype)
        lo, hi = min(flat), max(flat)
        if lo < info.min or hi > info.max:
            raise _bad(f"input '{name}': value {lo if lo < info.min else hi} does not fit {datatype} "
                       f"([{info.min}, {info.max}])")
    return np.asarray(flat, dtype=dtype)


def tensor_from_json(name: str, datatype: str, shape: Any, data: Any, parameters: dict | None = None) -> InferTensor:
    dtype = _check_datatype(name, datatype)
    dims = check_shape(name, shape)
    flat = _flatten(data)
    count = math.prod(dims)
    if len(flat) != count:
        raise _bad(f"input '{name}': 'data' holds {len(flat)} elements but shape {dims} needs {count}")
    params = dict(parameters or {})
    if datatype == "BYTES":
        arr = _bytes_elements(name, flat, params.get("content_type") == "base64")
    else:
        arr = _numeric_elements(name, datatype, dtype, flat)
    return InferTensor(name, datatype, dims, arr.reshape(dims), params)


def tensor_to_json_data(tensor: InferTensor) -> list | None:
    """Flattened JSON data, or None when a BYTES element is not UTF-8 (the caller then sends it binary)."""
    flat = np.asarray(tensor.data).reshape(-1)
    if tensor.datatype != "BYTES":
        return flat.tolist()
    out = []
    for item in flat:
        if isinstance(item, bytes):
            try:
                out.append(item.decode("utf-8"))
            except UnicodeDecodeError:
                return None
        else:
            out.append(str(item))
    return out


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
        raise _bad(f"unsupported Content-Encoding {content_encoding!r}; use gzip, deflate or none")
    d = zlib.decompressobj(16 + zlib.MAX_WBITS if enc == "gzip" else zlib.MAX_WBITS)
    try:
        out = d.decompress(body, MAX_DECOMPRESSED_BYTES)
    except zlib.error as exc:
        raise _bad(f"request body is not valid {enc} data: {exc}") from None
    if d.unconsumed_tail:
        raise _bad(f"request body inflates to more than {MAX_DECOMPRESSED_BYTES} bytes")
    return out


def _int_param(params: dict, key: str) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _bad(f"request parameter '{key}' must be a non-negative integer, got {value!r}")
    return value


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
            raise _bad(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 <= hlen <= len(body):
            raise _bad(f"{HEADER_LENGTH} is {hlen} but the body has only {len(body)} bytes")
        header, blob = body[:hlen], memoryview(body)[hlen:]
    else:
        header, blob = body, memoryview(b"")
    try:
        doc = msgspec.json.decode(header)
    except msgspec.DecodeError as exc:
        raise _bad(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec recurses per nesting level
        raise _bad("request body is nested too deeply") from None
    if not isinstance(doc, dict):
        raise _bad("request body must be a JSON object")
    params = parameters_of(doc, "")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list):
        raise _bad("request needs an 'inputs' list")

    inputs: list[InferTensor] = []
    pos = 0
    for k, item in enumerate(raw_inputs):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise _bad(f"inputs[{k}] must be an object with a string 'name'")
        name = item["name"]
        for key in ("datatype", "shape"):
            if key not in item:
                raise _bad(f"input '{name}': missing '{key}'")
        iparams = parameters_of(item, f"input '{name}': ")
        size = iparams.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise _bad(f"input '{name}': binary_data_size must be a non-negative integer, got {size!r}")
            if pos + size > len(blob):
                raise _bad(
                    f"input '{name}': binary_data_size {size} runs past the binary data "
                    f"({len(blob) - pos} bytes left after the JSON header)"
                )
            rest = {k2: v for k2, v in iparams.items() if k2 != "binary_data_size"}
            inputs.append(tensor_from_raw(name, item["datatype"], item["shape"], blob[pos : pos + size], rest))
            pos += size
        else:
            if "data" not in item:
                raise _bad(f"input '{name}': needs 'data' or parameters.binary_data_size")
            inputs.append(tensor_from_json(name, item["datatype"], item["shape"], item["data"], iparams))
    if pos != len(blob):
        raise _bad(f"{len(blob) - pos} bytes of binary data are not claimed by any input's binary_data_size")

    binary_default = bool(params.get("binary_data_output", False))
    requested: list[str] | None = None
    binary_outputs: dict[str, bool] = {}
    if doc.get("outputs") is not None:
        if not isinstance(doc["outputs"], list):
            raise _bad("'outputs' must be a list")
        requested = []
        for k, out in enumerate(doc["outputs"]):
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise _bad(f"outputs[{k}] must be an object with a string 'name'")
            oparams = parameters_of(out, f"output '{out['name']}': ")
            requested.append(out["name"])
            binary_outputs[out["name"]] = bool(oparams.get("binary_data", binary_default))
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
