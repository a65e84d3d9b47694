"""Typed boundary between the KServe fronts (HTTP/gRPC codecs) and the model server engine.

The fronts decode wire tensors into `InferRequest`, call `ModelServer.infer`, and encode the `InferResponse`.
Every error the engine raises is a `ModelServerError` whose `code` maps to an HTTP status and a gRPC code.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

#: (x-sla-class header, authorization header) of the KServe call being served: the HTTP and gRPC fronts set it per
#: call, so a local text model's request (router/text_tensors.py) gets the caller's class and key (unset: the
#: default class, no key)
KSERVE_CALLER: ContextVar[tuple[str | None, str | None]] = ContextVar("kserve_caller", default=(None, None))

# KServe v2 datatype name -> numpy dtype. BYTES tensors are object arrays whose elements are `bytes`; BF16 ones are
# ml_dtypes' bfloat16 (numpy has none; tritonclient sends and reads the same type).
KSERVE_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "BYTES": np.dtype(object),
}

# Triton config.pbtxt data_type (TYPE_*) -> KServe datatype name.
CONFIG_TO_KSERVE: dict[str, str] = {
    "TYPE_BOOL": "BOOL",
    "TYPE_UINT8": "UINT8",
    "TYPE_UINT16": "UINT16",
    "TYPE_UINT32": "UINT32",
    "TYPE_UINT64": "UINT64",
    "TYPE_INT8": "INT8",
    "TYPE_INT16": "INT16",
    "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64",
    "TYPE_FP16": "FP16",
    "TYPE_FP32": "FP32",
    "TYPE_FP64": "FP64",
    "TYPE_STRING": "BYTES",
    "TYPE_BF16": "BF16",
}
KSERVE_TO_CONFIG: dict[str, str] = {v: k for k, v in CONFIG_TO_KSERVE.items()}


def kserve_dtype_of(array: np.ndarray) -> str:
    """KServe datatype name of a numpy array (object / str / bytes arrays are BYTES)."""
    if array.dtype.kind in "OSU":
        return "BYTES"
    for name, dt in KSERVE_DTYPES.items():
        if dt == array.dtype:
            return name
    raise ModelServerError("invalid_argument", f"numpy dtype {array.dtype} has no KServe datatype")


@dataclass
class InferTensor:
    name: str
    datatype: str
    shape: list[int]
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferRequest:
    model_name: str
    model_version: str = ""
    id: str | None = None
    inputs: list[InferTensor] = field(default_factory=list)
    requested_outputs: list[str] | None = None  # None: every output of the model
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: int = 0  # 0: the model's default priority level; 1 is the highest
    timeout_us: int | None = None  # None: the model's default queue timeout


@dataclass
class InferResponse:
    model_name: str
    model_version: str
    id: str | None
    outputs: list[InferTensor] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)


# code -> (HTTP status, gRPC status code name)
ERROR_CODES: dict[str, tuple[int, str]] = {
    "not_found": (404, "NOT_FOUND"),
    "invalid_argument": (400, "INVALID_ARGUMENT"),
    "unavailable": (503, "UNAVAILABLE"),
    "resource_exhausted": (429, "RESOURCE_EXHAUSTED"),
    "deadline_exceeded": (504, "DEADLINE_EXCEEDED"),
    "internal": (500, "INTERNAL"),
    "failed_precondition": (400, "FAILED_PRECONDITION"),
    "bad_gateway": (502, "INTERNAL"),  # an upstream server (behind the router) failed
    "permission_denied": (403, "PERMISSION_DENIED"),  # an API key asking above its SLA class
}


class ModelServerError(Exception):
    """An error for the client: `code` is one of ERROR_CODES, `message` names the model/input and the fault;
    `headers` go with it (a router refusal's Retry-After: HTTP headers, gRPC ``retry-after`` metadata)."""

    def __init__(self, code: str, message: str, headers: dict[str, str] | None = None):
        if code not in ERROR_CODES:
            raise ValueError(f"unknown ModelServerError code {code!r}; use one of {sorted(ERROR_CODES)}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.headers = dict(headers or {})

    @property
    def http_status(self) -> int:
        return ERROR_CODES[self.code][0]

    @property
    def grpc_code(self) -> str:
        """Name of the grpc.StatusCode member, e.g. "NOT_FOUND"."""
        return ERROR_CODES[self.code][1]

    def __repr__(self) -> str:
        return f"ModelServerError({self.code!r}, {self.message!r})"
