"""`triton_python_backend_utils` for in-process Python models.

A Triton Python-backend `model.py` does `import triton_python_backend_utils as pb_utils`; the python backend
registers this module under that name so such model folders move over unchanged. Tensors wrap numpy arrays
without copies. BLS (`InferenceRequest(...).exec()`) calls other models of the same server.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
from typing import Any, Callable

import numpy as np

from strataserve.types.tensors import CONFIG_TO_KSERVE, KSERVE_DTYPES, KSERVE_TO_CONFIG

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1

_log = logging.getLogger("strataserve.modelserver.python_model")
_bls = threading.local()  # .server and .loop while a model's execute() runs on this thread


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


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r})"


ERROR_CODE_NAMES = {  # TritonError code -> ModelServerError code
    TritonError.UNKNOWN: "internal", TritonError.INTERNAL: "internal", TritonError.NOT_FOUND: "not_found",
    TritonError.INVALID_ARG: "invalid_argument", TritonError.UNAVAILABLE: "unavailable",
    TritonError.UNSUPPORTED: "failed_precondition", TritonError.ALREADY_EXISTS: "failed_precondition",
    TritonError.CANCELLED: "unavailable",
}


class TritonModelException(Exception):
    pass


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


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None, parameters=None):
        self._outputs = list(output_tensors or [])
        self._error = error
        self._parameters = parameters or {}

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class InferenceResponseSender:
    def __init__(self, send: Callable[[InferenceResponse | None, bool], None]):
        self._send, self._closed = send, False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._closed:
            raise TritonModelException("a response was sent after the final flag")
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException("send() needs a response unless flags is TRITONSERVER_RESPONSE_COMPLETE_FINAL")
        self._closed = final
        self._send(response, final)

    def is_cancelled(self) -> bool:
        return False


class InferenceRequest:
    """An incoming request (inside execute) or, built by a model, a BLS request to another model."""

    def __init__(self, model_name: str = "", inputs: list[Tensor] | None = None,
                 requested_output_names: list[str] | None = None, model_version: int = -1,
                 request_id: str = "", parameters: dict | str | None = None, flags: int = 0, **_ignored: Any):
        self._model_name, self._model_version = model_name, model_version
        self._inputs = {t.name(): t for t in (inputs or [])}
        self._requested = list(requested_output_names or [])
        self._id, self._flags = request_id or "", flags
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(parameters or {})
        self._sender: InferenceResponseSender | None = None

    def inputs(self) -> list[Tensor]:
        return list(self._inputs.values())

    def get_input_tensor_by_name(self, name: str) -> Tensor | None:
        return self._inputs.get(name)

    def request_id(self) -> str:
        return self._id

    def requested_output_names(self) -> list[str]:
        return self._requested

    def parameters(self) -> str:
        return self._parameters

    def flags(self) -> int:
        return self._flags

    def model_name(self) -> str:
        return self._model_name

    def is_cancelled(self) -> bool:
        return False

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException("get_response_sender() is only for decoupled models")
        return self._sender

    def exec(self, decoupled: bool = False) -> InferenceResponse:
        """BLS: run this request on another model of the server; errors come back in the response."""
        return self._answer(lambda server, loop, req: asyncio.run_coroutine_threadsafe(server.infer(req), loop)
                            .result(), decoupled)

    async def async_exec(self, decoupled: bool = False) -> InferenceResponse:
        """BLS from an ``async def execute``: awaits the other model on the server's loop, so calls gathered
        together run together."""
        future = self._answer(lambda server, loop, req: asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(server.infer(req), loop)), decoupled)
        if isinstance(future, InferenceResponse):
            return future
        try:
            resp = await future
        except Exception as e:  # noqa: BLE001 - a ModelServerError: an error response, as the blocking call gives
            return _error_response(e)
        return InferenceResponse([Tensor(o.name, o.data) for o in resp.outputs])

    def _answer(self, run: Any, decoupled: bool) -> Any:
        from strataserve.types.tensors import InferRequest, InferTensor, kserve_dtype_of

        server, loop = getattr(_bls, "server", None), getattr(_bls, "loop", None)
        if server is None:
            raise TritonModelException("InferenceRequest.exec() (BLS) works only inside execute() of an in-process "
                                       "Python model (not with EXECUTION_ISOLATION 'process')")
        if decoupled:
            raise TritonModelException("decoupled BLS calls are not supported")
        req = InferRequest(
            model_name=self._model_name, model_version="" if self._model_version < 0 else str(self._model_version),
            inputs=[InferTensor(t.name(), kserve_dtype_of(t.as_numpy()), list(t.as_numpy().shape), t.as_numpy())
                    for t in self._inputs.values()],
            requested_outputs=self._requested or None,
        )
        try:
            resp = run(server, loop, req)
        except Exception as e:  # noqa: BLE001 - a ModelServerError: the caller reads it from the response
            return _error_response(e)
        if isinstance(resp, asyncio.Future):
            return resp
        return InferenceResponse([Tensor(o.name, o.data) for o in resp.outputs])


def run_execute(model: Any, requests: list) -> Any:
    """``model.execute(requests)``; an ``async def execute`` (Triton's form for BLS ``async_exec``) runs to its end
    on an event loop of the calling worker thread."""
    result = model.execute(requests)
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def _error_response(exc: Exception) -> InferenceResponse:
    from strataserve.types.tensors import ModelServerError

    if isinstance(exc, ModelServerError):
        return InferenceResponse(error=TritonError(exc.message))
    raise exc


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


class Logger:
    @staticmethod
    def log_info(msg: str) -> None:
        _log.info(msg)

    @staticmethod
    def log_warn(msg: str) -> None:
        _log.warning(msg)

    @staticmethod
    def log_error(msg: str) -> None:
        _log.error(msg)

    @staticmethod
    def log_verbose(msg: str) -> None:
        _log.debug(msg)

    @staticmethod
    def log(msg: str, level: int = logging.INFO) -> None:
        _log.log(level, msg)
