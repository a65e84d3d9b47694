"""KServe generate extension: JSON fields ↔ tensors (as Triton maps them: one field per input/output name).

`{"text_input": "hi", "parameters": {...}}` becomes a BYTES tensor `text_input` of shape [1] (with a leading
batch dim of 1 when the model batches); each output comes back under its name, a scalar when it holds one
element (bytes decoded as UTF-8), a flat list otherwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strataserve.modelserver.config import ModelSpec
from strataserve.types.tensors import KSERVE_DTYPES, InferRequest, InferResponse, InferTensor, ModelServerError


def _shape(dims: tuple[int, ...], size: int, name: str, model: str) -> list[int]:
    known = int(np.prod([d for d in dims if d != -1])) if dims else 1
    wild = sum(1 for d in dims if d == -1)
    if wild > 1 or (wild == 0 and known != size) or (wild == 1 and size % max(known, 1)):
        raise ModelServerError("invalid_argument", f"model '{model}': field '{name}' has {size} values, which do not "
                               f"fit its shape {list(dims)}")
    return [size // known if d == -1 else d for d in dims] if dims else []


def generate_request(spec: ModelSpec, version: int, inputs: dict[str, Any], parameters: dict) -> InferRequest:
    tensors = []
    for name, value in inputs.items():
        ts = spec.input(name)
        if ts is None:
            raise ModelServerError("invalid_argument", f"model '{spec.name}' has no input '{name}'; its inputs are "
                                   f"{[t.name for t in spec.inputs]}")
        flat = value if isinstance(value, list) else [value]
        if ts.datatype == "BYTES":
            arr = np.array([v.encode() if isinstance(v, str) else v for v in flat], dtype=object)
            if any(not isinstance(v, bytes) for v in arr):
                raise ModelServerError("invalid_argument", f"model '{spec.name}': field '{name}' must be text")
        else:
            try:
                arr = np.asarray(flat, dtype=KSERVE_DTYPES[ts.datatype]).reshape(-1)
            except (TypeError, ValueError) as e:
                raise ModelServerError("invalid_argument", f"model '{spec.name}': field '{name}' is not "
                                       f"{ts.datatype}: {e}") from None
        shape = _shape(ts.dims, arr.size, name, spec.name)
        if spec.max_batch_size > 0:
            shape = [1] + shape
        tensors.append(InferTensor(name, ts.datatype, shape, arr.reshape(shape)))
    return InferRequest(spec.name, str(version), inputs=tensors, parameters=dict(parameters or {}))


def generate_response(response: InferResponse) -> dict:
    out: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    for t in response.outputs:
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in t.data.reshape(-1).tolist()]
        out[t.name] = values[0] if len(values) == 1 else values
    return out
