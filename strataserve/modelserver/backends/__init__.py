"""Backend registry: backend name → class, imported lazily so a missing optional library only fails its models.

Ensembles (ensemble.py) and LLMs (llm.py, the async LLM engine) are served by their own version classes.
"""

from __future__ import annotations

import importlib

from strataserve.modelserver.backends.base import Backend, InstanceContext
from strataserve.types.tensors import ModelServerError

_REGISTRY: dict[str, str] = {
    "onnxruntime": "strataserve.modelserver.backends.onnx_rt:OnnxBackend",
    "pytorch": "strataserve.modelserver.backends.pytorch:TorchBackend",
    "python": "strataserve.modelserver.backends.python:PythonBackend",
}


def backend_class(name: str) -> type[Backend]:
    if name not in _REGISTRY:
        raise ModelServerError("invalid_argument", f"unknown backend '{name}'; known: {sorted(_REGISTRY)}")
    module, cls = _REGISTRY[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ModelServerError("unavailable", f"backend '{name}' needs a library that is not installed: {e}") from None


def create_backend(ctx: InstanceContext) -> Backend:
    return backend_class(ctx.spec.backend)(ctx)


__all__ = ["Backend", "InstanceContext", "backend_class", "create_backend"]
