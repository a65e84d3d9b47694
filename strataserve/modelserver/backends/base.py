"""Backend interface: one object per model instance, driven by the scheduler from a worker thread.

An execution is three timed phases (Triton's compute_input / compute_infer / compute_output):
`prepare(requests)` → `infer(prepared)` → `finish(result, requests)`. The scheduler never calls one instance
from two threads at once, so a backend need not lock. Decoupled backends answer through `BackendRequest.send`
(thread-safe) and return None per request from `finish`. A request whose client cancelled or went away is
marked (`BackendRequest.cancel`), so a model can stop early (Triton's `request.is_cancelled()`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from strataserve.modelserver.config import ModelSpec
from strataserve.types.tensors import ModelServerError

# send(outputs or None, error or None, final) — may be called from any thread.
SendFn = Callable[[dict[str, np.ndarray] | None, BaseException | None, bool], None]


@dataclass
class BackendRequest:
    inputs: dict[str, np.ndarray]  # already validated and reshaped to what the model sees
    rows: int  # batch rows (1 for a model without batching)
    send: SendFn
    request_id: str | None = None
    requested_outputs: list[str] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    cancelled: bool = False  # the client cancelled the request or went away
    on_cancel: Callable[[], None] | None = None  # set by a backend that must pass the cancel on (a child process)
    # who sent it (``KSERVE_CALLER``): bound while it executes, so a Python model's BLS calls are the caller's
    caller: tuple[str | None, str | None] = (None, None)

    def cancel(self) -> None:
        """Event-loop thread: mark the request cancelled (models poll the flag) and tell the backend."""
        if self.cancelled:
            return
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel()


class ModelOutputs(dict):
    """A request's outputs (name -> array) with the response parameters the model set (Triton's
    `InferenceResponse(parameters=...)`), which reach the client's response."""

    def __init__(self, outputs: dict[str, np.ndarray], parameters: dict[str, Any] | None = None):
        super().__init__(outputs)
        self.parameters = parameters or {}


@dataclass(frozen=True)
class InstanceContext:
    spec: ModelSpec
    version: int
    model_dir: Path
    version_dir: Path
    instance_index: int
    device: str  # "cpu" or "cuda:N"
    server: Any = None  # the ModelServer (Python models call other models through it)
    stats: Any = None  # the version's ModelStats (restarts of an isolated instance count there)


class Backend(ABC):
    def __init__(self, ctx: InstanceContext):
        self.ctx = ctx
        self.spec = ctx.spec

    @abstractmethod
    def prepare(self, requests: list[BackendRequest]) -> Any: ...

    @abstractmethod
    def infer(self, prepared: Any) -> Any: ...

    @abstractmethod
    def finish(self, result: Any, requests: list[BackendRequest]) -> list[dict[str, np.ndarray] | BaseException | None]:
        """One entry per request: its outputs, its own error, or None (decoupled: answered through send)."""

    def close(self) -> None:
        """Release the instance's resources; called once, after its last execution."""

    def wait_ready(self) -> None:
        """Block until the instance can execute (an isolated model's process may be restarting); bounded."""

    def ready(self) -> bool:
        """Whether the instance can execute now (False while an isolated model's process restarts)."""
        return True

    def on_timeout(self) -> bool:
        """An execution passed the model's timeout and its thread is still inside ``infer``. Return True when
        the instance can end that execution (e.g. by killing its process) so the thread comes back; False
        when the thread stays stuck (the scheduler then gives the instance a fresh thread)."""
        return False


class ArrayBackend(Backend):
    """A backend that runs one function over named arrays: batches are concatenated along dim 0 and split back."""

    @abstractmethod
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def prepare(self, requests: list[BackendRequest]) -> dict[str, np.ndarray]:
        if len(requests) == 1:
            return requests[0].inputs
        return {name: np.concatenate([r.inputs[name] for r in requests], axis=0) for name in requests[0].inputs}

    def infer(self, prepared: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.run(prepared)

    def finish(self, result: dict[str, np.ndarray], requests: list[BackendRequest]) -> list[dict[str, np.ndarray]]:
        if len(requests) == 1:
            return [result]
        total = sum(r.rows for r in requests)
        offsets = np.cumsum([r.rows for r in requests])[:-1]
        for name, arr in result.items():
            if arr.ndim == 0 or arr.shape[0] != total:
                raise ModelServerError("internal", f"model '{self.spec.name}': output '{name}' has shape "
                                       f"{list(arr.shape)}, whose first dim is not the batch size {total}")
        split = {name: np.split(arr, offsets, axis=0) for name, arr in result.items()}
        return [{name: parts[i] for name, parts in split.items()} for i in range(len(requests))]
