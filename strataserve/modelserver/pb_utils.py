"""`triton_python_backend_utils` for Python models.

A Triton Python-backend `model.py` does `import triton_python_backend_utils as pb_utils`; the python backend
registers this module under that name so such model folders move over unchanged. Tensors wrap numpy arrays
without copies. BLS (`InferenceRequest(...).exec()`, pb_bls.py) calls other models of the same server; custom
metrics are pb_metrics.py's, the model's context, event loop and logger pb_runtime.py's.
"""

from __future__ import annotations

import enum
import json
import logging
from typing import Any, Callable

import numpy as np

from strataserve.modelserver import pb_bls, pb_runtime
from strataserve.modelserver.pb_bls import is_model_ready, load_model, unload_model  # noqa: F401 - pb_utils API
from strataserve.modelserver.pb_errors import TritonError, TritonModelException
from strataserve.modelserver.pb_metrics import Metric, MetricFamily  # noqa: F401 - pb_utils API
from strataserve.types.tensors import CONFIG_TO_KSERVE, KSERVE_DTYPES, KSERVE_TO_CONFIG

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2


def triton_string_to_numpy(triton_type_string: str) -> type:
    """"TYPE_FP32" -> np.float32; "TYPE_STRING" -> np.object_."""
    return KSERVE_DTYPES[CONFIG_TO_KSERVE[triton_type_string]].type


def triton_to_numpy_type(data_type: str) -> type:
    """KServe name ("FP32") or config name ("TYPE_FP32") -> numpy type."""
    return KSERVE_DTYPES[CONFIG_TO_KSERVE.get(data_type, data_type)].type


def numpy_to_triton_type(data_type) -> str:
    dt = np.dtype(data_type)
    if dt.kind in "OSU":
        return "TYPE_STRING"
    for name, d in KSERVE_DTYPES.items():
        if d == dt:
            return KSERVE_TO_CONFIG[name]
    raise TritonModelException(f"numpy dtype {dt} has no Triton type")


class Tensor:
    def __init__(self, name: str, data: np.ndarray):
        if not isinstance(data, np.ndarray):
            raise TritonModelException(f"Tensor '{name}' needs a numpy array, got {type(data).__name__}")
        self._name, self._data = name, data

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._data

    def is_cpu(self) -> bool:
        return True

    def shape(self) -> list[int]:
        return list(self._data.shape)

    def triton_dtype(self) -> str:
        return numpy_to_triton_type(self._data.dtype)

    def to_dlpack(self):
        return self._data.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, capsule) -> "Tensor":
        return Tensor(name, np.from_dlpack(capsule))


def _parameters_json(parameters: Any, what: str) -> str:
    """Triton's request / response parameters: a dict of str keys and str, int, float or bool values, kept as
    JSON."""
    if parameters is None:
        return "{}"
    if isinstance(parameters, str):  # already JSON (an incoming request's parameters())
        return parameters
    if not isinstance(parameters, dict):
        raise TritonModelException(f"{what} parameters must be a dict, got {type(parameters).__name__}")
    for key, value in parameters.items():
        if not isinstance(key, str) or not isinstance(value, (str, int, float, bool)):
            raise TritonModelException(f"{what} parameter {key!r}: keys must be str and values str, int, float or "
                                       f"bool, got {type(value).__name__}")
    return json.dumps(parameters)


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None,
                 parameters: dict | str | None = None):
        self._outputs = list(output_tensors or [])
        self._error = error
        self._parameters = _parameters_json(parameters, "InferenceResponse")

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


def _never() -> bool:
    return False


class InferenceResponseSender:
    def __init__(self, send: Callable[[InferenceResponse | None, bool], None],
                 is_cancelled: Callable[[], bool] = _never):
        self._send, self._closed, self._is_cancelled = send, False, is_cancelled

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._closed:
            raise TritonModelException("a response was sent after the final flag")
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException("send() needs a response unless flags is TRITONSERVER_RESPONSE_COMPLETE_FINAL")
        self._closed = final
        self._send(response, final)

    def is_cancelled(self) -> bool:
        """True once the client cancelled the request or went away (Triton >= 23.10)."""
        return self._is_cancelled()


class InferenceRequest:
    """An incoming request (inside execute) or, built by a model, a BLS request to another model."""

    def __init__(self, model_name: str = "", inputs: list[Tensor] | None = None,
                 requested_output_names: list[str] | None = None, model_version: int = -1,
                 request_id: str = "", parameters: dict | str | None = None, flags: int = 0,
                 correlation_id: int | str = 0, timeout: int = 0, preferred_memory: Any = None, trace: Any = None):
        if not isinstance(correlation_id, (int, str)):
            raise TritonModelException("Correlation ID must be integer or string")
        self._model_name, self._model_version = model_name, model_version
        self._inputs = {t.name(): t for t in (inputs or [])}
        self._requested = list(requested_output_names or [])
        self._id, self._flags = request_id or "", flags
        self._correlation_id, self._timeout = correlation_id, int(timeout or 0)
        self._parameters = _parameters_json(parameters, "InferenceRequest")
        self._sender: InferenceResponseSender | None = None
        self._cancel_check: Callable[[], bool] = _never  # set by the backend for an incoming request

    def __getstate__(self) -> dict:  # to an isolated model's process: its own cancel check is attached there
        state = dict(self.__dict__)
        state["_cancel_check"] = _never
        return state

    def inputs(self) -> list[Tensor]:
        return list(self._inputs.values())

    def get_input_tensor_by_name(self, name: str) -> Tensor | None:
        return self._inputs.get(name)

    def request_id(self) -> str:
        return self._id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def timeout(self) -> int:
        """Microseconds (0: none)."""
        return self._timeout

    def requested_output_names(self) -> list[str]:
        return self._requested

    def parameters(self) -> str:
        return self._parameters

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = flags

    def model_name(self) -> str:
        return self._model_name

    def is_cancelled(self) -> bool:
        """True once the client cancelled the request or went away (Triton >= 23.10)."""
        return self._cancel_check()

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException("get_response_sender() is only for decoupled models")
        return self._sender

    def exec(self, decoupled: bool = False) -> Any:
        """BLS: run this request on another model of the server; errors come back in the response. With
        ``decoupled=True``, an iterator over every response of the called model."""
        return pb_bls.exec_request(self, decoupled)

    async def async_exec(self, decoupled: bool = False) -> Any:
        """BLS from an ``async def execute``: awaits the other model on the server's loop, so calls gathered
        together run together (``decoupled=True``: an async iterator over the responses)."""
        return await pb_bls.async_exec_request(self, decoupled)


class ModelConfig:
    """What a model's `auto_complete_config(auto_complete_model_config)` receives and returns (Triton's API)."""

    def __init__(self, config: dict):
        self._config = config

    def as_dict(self) -> dict:
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        self._config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, policy: dict) -> None:
        self._config["model_transaction_policy"] = dict(policy)

    def add_input(self, tensor: dict) -> None:
        self._add("input", tensor)

    def add_output(self, tensor: dict) -> None:
        self._add("output", tensor)

    def _add(self, kind: str, tensor: dict) -> None:
        if "name" not in tensor:
            raise TritonModelException(f"add_{kind}() needs a 'name'")
        items = self._config.setdefault(kind, [])
        for existing in items:
            if existing.get("name") == tensor["name"]:
                for key, value in tensor.items():  # fill what the config left out; a contradiction is an error
                    if existing.get(key) in (None, "", [], "TYPE_INVALID"):
                        existing[key] = value
                    elif existing[key] != value:
                        raise TritonModelException(f"{kind} '{tensor['name']}': auto-complete wants {key}={value!r} "
                                                   f"but the config has {existing[key]!r}")
                return
        items.append(dict(tensor))


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return request.get_input_tensor_by_name(name)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((t for t in model_config.get("input", []) if t["name"] == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((t for t in model_config.get("output", []) if t["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class LogLevel(enum.IntEnum):
    """Triton's Logger levels, as Python logging levels (VERBOSE is DEBUG: off unless asked for)."""

    INFO = logging.INFO
    WARNING = logging.WARNING
    ERROR = logging.ERROR
    VERBOSE = logging.DEBUG


class Logger:
    """Model logs, to the logger named after the model (pb_runtime.model_logger)."""

    INFO, WARNING, ERROR, VERBOSE = LogLevel.INFO, LogLevel.WARNING, LogLevel.ERROR, LogLevel.VERBOSE
    LogLevel = LogLevel

    @staticmethod
    def log(msg: str, level: int = LogLevel.INFO) -> None:
        pb_runtime.model_logger().log(int(level), msg)

    @staticmethod
    def log_info(msg: str) -> None:
        Logger.log(msg, LogLevel.INFO)

    @staticmethod
    def log_warn(msg: str) -> None:
        Logger.log(msg, LogLevel.WARNING)

    @staticmethod
    def log_error(msg: str) -> None:
        Logger.log(msg, LogLevel.ERROR)

    @staticmethod
    def log_verbose(msg: str) -> None:
        Logger.log(msg, LogLevel.VERBOSE)
