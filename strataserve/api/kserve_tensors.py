"""KServe v2 tensors: raw bytes and JSON ``data`` <-> ``InferTensor``, each checked against its shape and datatype.

Used by the HTTP codec (``api/kserve_codec.py``: JSON + binary extension), the gRPC front (raw_input_contents /
raw_output_contents) and the router's KServe client. Every malformed tensor raises
``ModelServerError("invalid_argument", ...)`` naming it and what is wrong, so the fronts answer 400 /
INVALID_ARGUMENT and keep serving.

Conventions (Triton's): JSON ``data`` is the row-major flattened tensor (nested lists are accepted and flattened);
BYTES elements are UTF-8 strings, or base64 strings when the input has ``parameters.content_type == "base64"``;
binary BYTES tensors are a run of elements each prefixed by its length as a 4-byte little-endian unsigned int.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from typing import Any

import msgspec
import numpy as np

from strataserve.types.tensors import KSERVE_DTYPES, InferTensor, ModelServerError

_INT_KINDS = "iu"
_FLOAT_TYPES = frozenset({"FP16", "FP32", "FP64", "BF16"})


def invalid(message: str) -> ModelServerError:
    """The error of a malformed request (400 / INVALID_ARGUMENT)."""
    return ModelServerError("invalid_argument", message)


def check_shape(name: str, shape: Any) -> list[int]:
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise invalid(f"input '{name}': 'shape' must be a list of non-negative integers, got {shape!r}")
    return [int(d) for d in shape]


def _check_datatype(name: str, datatype: Any) -> np.dtype:
    if not isinstance(datatype, str) or datatype not in KSERVE_DTYPES:  # a list or object is not hashable
        raise invalid(f"input '{name}': unsupported datatype {datatype!r}; use one of {sorted(KSERVE_DTYPES)}")
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
        raise invalid(f"input '{name}': BYTES data of {len(view)} bytes cannot hold the {count} elements its shape "
                   "declares (each element needs a 4-byte length prefix)")
    out = np.empty(count, dtype=object)
    pos, i = 0, 0
    while pos < len(view):
        if pos + 4 > len(view):
            raise invalid(f"input '{name}': BYTES data ends inside a 4-byte length prefix at offset {pos}")
        (n,) = struct.unpack_from("<I", view, pos)
        pos += 4
        if pos + n > len(view):
            raise invalid(f"input '{name}': BYTES element {i} declares {n} bytes but only {len(view) - pos} remain")
        if i >= count:
            raise invalid(f"input '{name}': BYTES data holds more than the {count} elements its shape declares")
        out[i] = bytes(view[pos : pos + n])
        pos += n
        i += 1
    if i != count:
        raise invalid(f"input '{name}': BYTES data holds {i} elements but its shape declares {count}")
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
            raise invalid(
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
            raise invalid(f"input '{name}': BYTES element {i} must be a string, got {type(item).__name__}")
        if b64:
            try:
                out[i] = base64.b64decode(item, validate=True)
            except (binascii.Error, ValueError):
                raise invalid(f"input '{name}': BYTES element {i} is not valid base64") from None
        else:
            out[i] = item.encode("utf-8")
    return out


_ALLOWED_TYPES = {"b": {bool}, "i": {int}, "u": {int}, "f": {int, float}}


def _numeric_elements(name: str, datatype: str, dtype: np.dtype, flat: list) -> np.ndarray:
    # set(map(type, ...)) runs in C: this path is hot, and a per-element isinstance walk cost more than the
    # JSON parse itself; only a rejected tensor pays for the walk that names the offending element
    kind = "f" if datatype == "BF16" else dtype.kind  # ml_dtypes' bfloat16 is a numpy "V" kind
    allowed = _ALLOWED_TYPES[kind]
    if not set(map(type, flat)) <= allowed:
        want = {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers"}[kind]
        i, item = next((i, x) for i, x in enumerate(flat) if type(x) not in allowed)
        raise invalid(f"input '{name}': {datatype} data must be {want}; element {i} is {item!r}")
    if dtype.kind in _INT_KINDS and flat:
        info = np.iinfo(dtype)
        lo, hi = min(flat), max(flat)
        if lo < info.min or hi > info.max:
            raise invalid(f"input '{name}': value {lo if lo < info.min else hi} does not fit {datatype} "
                       f"([{info.min}, {info.max}])")
    return np.asarray(flat, dtype=dtype)


def tensor_from_json(name: str, datatype: str, shape: Any, data: Any, parameters: dict | None = None) -> InferTensor:
    dtype = _check_datatype(name, datatype)
    dims = check_shape(name, shape)
    flat = _flatten(data)
    count = math.prod(dims)
    if len(flat) != count:
        raise invalid(f"input '{name}': 'data' holds {len(flat)} elements but shape {dims} needs {count}")
    params = dict(parameters or {})
    if datatype == "BYTES":
        arr = _bytes_elements(name, flat, params.get("content_type") == "base64")
    else:
        arr = _numeric_elements(name, datatype, dtype, flat)
    return InferTensor(name, datatype, dims, arr.reshape(dims), params)


def tensor_to_json_data(tensor: InferTensor) -> list | msgspec.Raw | None:
    """Flattened JSON data, or None when a BYTES element is not UTF-8 (the caller then sends it binary).

    A float tensor holding NaN or +-inf comes back as pre-encoded JSON with the tokens ``NaN``, ``Infinity`` and
    ``-Infinity`` (what Triton writes, and what tritonclient's JSON reader takes): msgspec would write ``null``,
    which a client reads as NaN, so an infinity would silently turn into NaN."""
    flat = np.asarray(tensor.data).reshape(-1)
    if tensor.datatype != "BYTES":
        values = flat.tolist()
        if tensor.datatype in _FLOAT_TYPES and not np.isfinite(flat).all():
            return msgspec.Raw(json.dumps(values, allow_nan=True).encode())
        return values
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
