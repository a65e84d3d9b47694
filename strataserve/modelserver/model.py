"""One loaded model version: request validation, its scheduler and instances, response shaping, metadata."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np

from strataserve.modelserver.backends import create_backend
from strataserve.modelserver.backends.base import BackendRequest, InstanceContext
from strataserve.modelserver.batcher import Scheduler
from strataserve.modelserver.config import ModelSpec
from strataserve.modelserver.pbtxt import config_to_json
from strataserve.modelserver.repository import ModelSource
from strataserve.modelserver.stats import BACKEND, CANCELED, REJECTED, ModelStats
from strataserve.types.tensors import (KSERVE_CALLER, KSERVE_DTYPES, InferRequest, InferResponse, InferTensor,
                                       ModelServerError)


@dataclass
class ErrorResponse(InferResponse):
    """One response of a decoupled model's stream that is an error, with more responses to come (Triton
    delivers it as that response's error and the stream goes on); fronts send it as an error message."""

    error: ModelServerError | None = None


@dataclass
class StreamResponse(InferResponse):
    """A decoupled model's response; `final`: it came with the model's final flag (Triton's
    triton_final_response parameter of gRPC streams)."""

    final: bool = False


def _device(spec: ModelSpec, index: int) -> str:
    if spec.instance_kind != "KIND_GPU":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise ModelServerError("unavailable", f"{spec.source}: instance_group kind KIND_GPU but no GPU is available")
    return f"cuda:{index % torch.cuda.device_count()}"


def as_bytes_array(arr: np.ndarray) -> np.ndarray:
    """An object array of `bytes` (BYTES tensors); str elements are UTF-8 encoded, other values str()-ed."""
    if arr.dtype == object and all(isinstance(x, bytes) for x in arr.flat):
        return arr
    flat = [x if isinstance(x, bytes) else (x if isinstance(x, str) else str(x)).encode() for x in arr.flat]
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(arr.shape)


def tensor_metadata(spec: ModelSpec, tensors) -> list[dict]:
    prefix = [-1] if spec.max_batch_size > 0 else []
    return [{"name": t.name, "datatype": t.datatype, "shape": prefix + list(t.dims)} for t in tensors]


def _check_output_shape(spec: ModelSpec, name: str, shape: tuple, dims) -> None:
    """A model answering with a shape its config does not declare fails that request with a clear error."""
    expect = ([-1] if spec.max_batch_size > 0 else []) + list(dims)
    if len(shape) != len(expect) or any(e != -1 and e != d for e, d in zip(expect, shape)):
        raise ModelServerError("internal", f"model '{spec.name}' returned output '{name}' with shape "
                               f"{list(shape)}, but its config declares {expect} (-1: any size)")


class ServedVersion:
    """What the server needs of a ready model version (ModelVersion, EnsembleVersion, LLMVersion)."""

    spec: ModelSpec
    version: int
    stats: ModelStats

    def metadata(self) -> dict:
        return {"inputs": tensor_metadata(self.spec, self.spec.inputs),
                "outputs": tensor_metadata(self.spec, self.spec.outputs)}

    def config_json(self) -> dict:
        return config_to_json(self.spec.proto)

    def stop_admitting(self) -> None:
        """Refuse new requests from now on (unload); `close` then finishes the ones in flight."""

    def healthy(self) -> bool:
        """Whether it can serve now (strict readiness): False while one of its instances is restarting."""
        return True

    async def close(self) -> None:
        """Stop serving; called once."""


class ModelVersion(ServedVersion):
    """A ready version of a model run by a backend (onnxruntime / pytorch / python)."""

    def __init__(self, spec: ModelSpec, version: int, stats: ModelStats):
        self.spec, self.version, self.stats = spec, version, stats
        self.scheduler: Scheduler | None = None

    @classmethod
    async def load(cls, source: ModelSource, version: int, stats: ModelStats, server) -> "ModelVersion":
        self = cls(source.spec, version, stats)
        spec = source.spec
        loop = asyncio.get_running_loop()
        instances = []
        try:
            for i in range(spec.instance_count):
                ctx = InstanceContext(spec, version, source.model_dir, source.versions[version], i, _device(spec, i),
                                      server, stats)
                instances.append(await loop.run_in_executor(None, create_backend, ctx))
        except BaseException:
            for inst in instances:
                inst.close()
            raise
        self.scheduler = Scheduler(spec, version, instances, stats)
        return self

    def stop_admitting(self) -> None:
        if self.scheduler is not None:
            self.scheduler.closing = True

    def healthy(self) -> bool:
        return self.scheduler is not None and all(i.ready() for i in self.scheduler.instances)

    async def close(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.close()

    # -- requests ----------------------------------------------------------------------------------------------
    def _validate(self, req: InferRequest) -> BackendRequest:
        spec, where = self.spec, f"model '{self.spec.name}' version {self.version}"
        inputs: dict[str, np.ndarray] = {}
        rows = None
        for t in req.inputs:
            ts = spec.input(t.name)
            if ts is None:
                raise ModelServerError("invalid_argument", f"{where} has no input '{t.name}'; its inputs are "
                                       f"{[i.name for i in spec.inputs]}")
            if t.name in inputs:
                raise ModelServerError("invalid_argument", f"{where}: input '{t.name}' is given twice")
            if t.datatype != ts.datatype:
                raise ModelServerError("invalid_argument", f"{where}: input '{t.name}' has datatype {t.datatype} "
                                       f"but the model expects {ts.datatype}")
            shape = [int(d) for d in t.shape]
            expect = ([-1] if spec.max_batch_size > 0 else []) + list(ts.dims)
            if len(shape) != len(expect) or any(d < 0 for d in shape) or \
                    any(e != -1 and e != d for e, d in zip(expect, shape)):
                raise ModelServerError("invalid_argument", f"{where}: input '{t.name}' has shape {shape} but the "
                                       f"model expects {expect} (-1: any size)")
            if spec.max_batch_size > 0:
                if not 1 <= shape[0] <= spec.max_batch_size:
                    raise ModelServerError("invalid_argument", f"{where}: input '{t.name}' has batch size "
                                           f"{shape[0]}, outside 1..max_batch_size ({spec.max_batch_size})")
                if rows is not None and rows != shape[0]:
                    raise ModelServerError("invalid_argument", f"{where}: inputs disagree on the batch size "
                                           f"({rows} vs {shape[0]} for '{t.name}')")
                rows = shape[0]
            inputs[t.name] = self._array(t, shape, where)
            if ts.reshape is not None:
                inputs[t.name] = inputs[t.name].reshape(shape[:1] + list(ts.reshape) if spec.max_batch_size > 0
                                                        else list(ts.reshape))
        missing = [t.name for t in spec.inputs if t.name not in inputs and not t.optional]
        if missing:
            raise ModelServerError("invalid_argument", f"{where}: missing inputs {missing}")
        if req.requested_outputs is not None:
            unknown = [n for n in req.requested_outputs if spec.output(n) is None]
            if unknown:
                raise ModelServerError("invalid_argument", f"{where} has no outputs {unknown}; its outputs are "
                                       f"{[o.name for o in spec.outputs]}")
        return BackendRequest(inputs, rows or 1, send=None, request_id=req.id,  # type: ignore[arg-type]
                              requested_outputs=req.requested_outputs, parameters=dict(req.parameters),
                              caller=KSERVE_CALLER.get())

    @staticmethod
    def _array(t: InferTensor, shape: list[int], where: str) -> np.ndarray:
        data = t.data if isinstance(t.data, np.ndarray) else np.asarray(t.data)
        expect = KSERVE_DTYPES[t.datatype]
        if t.datatype == "BYTES":
            data = as_bytes_array(data)
        elif data.dtype != expect:
            raise ModelServerError("invalid_argument", f"{where}: input '{t.name}' holds {data.dtype} values, not "
                                   f"{t.datatype}")
        if data.size != math.prod(shape):
            raise ModelServerError("invalid_argument", f"{where}: input '{t.name}' has {data.size} elements but "
                                   f"shape {shape} needs {math.prod(shape)}")
        return data.reshape(shape)

    def _response(self, req: InferRequest, outputs: dict[str, np.ndarray], partial: bool,
                  final: bool | None = None) -> InferResponse:
        spec = self.spec
        names = req.requested_outputs if req.requested_outputs is not None else [o.name for o in spec.outputs]
        tensors = []
        for name in names:
            if name not in outputs:
                if partial:
                    continue
                raise ModelServerError("internal", f"model '{spec.name}' produced no output '{name}'")
            ts = spec.output(name)
            arr = np.asarray(outputs[name])
            if ts.datatype == "BYTES":
                arr = as_bytes_array(arr)
            elif arr.dtype != KSERVE_DTYPES[ts.datatype]:
                want = np.dtype(KSERVE_DTYPES[ts.datatype])
                # numpy's defaults (float64, int64) into FP32 / INT32 / UINT8 outputs are cast; floats into an
                # integer or BOOL output would be truncated: the model's mistake, an error rather than wrong data
                if arr.dtype.kind in "fc" and want.kind in "iub":
                    raise ModelServerError("internal", f"model '{spec.name}' output '{name}' is {arr.dtype}, but "
                                           f"its config declares {ts.datatype}: return {want} data")
                arr = arr.astype(want)
            _check_output_shape(spec, name, arr.shape, ts.reshape if ts.reshape is not None else ts.dims)
            if ts.reshape is not None:
                lead = arr.shape[:1] if spec.max_batch_size > 0 else ()
                arr = arr.reshape(tuple(lead) + tuple(ts.dims))
            tensors.append(InferTensor(name, ts.datatype, list(arr.shape), arr))
        params = dict(getattr(outputs, "parameters", None) or {})
        if final is None:
            return InferResponse(spec.name, str(self.version), req.id, tensors, params)
        return StreamResponse(spec.name, str(self.version), req.id, tensors, params, final)

    def _submit(self, req: InferRequest):
        start = time.monotonic_ns()
        try:
            breq = self._validate(req)
            pending = self.scheduler.submit(breq, req.priority, req.timeout_us)
        except ModelServerError:  # bad input, queue full, or the version is being unloaded: never queued
            self.stats.request_done(False, time.monotonic_ns() - start, reason=REJECTED)
            raise
        breq.send = pending.push
        self.stats.add_pending(1)
        return pending, start

    def _done(self, pending, start: int, failure: str | None, finished: bool) -> None:
        """`failure`: None when the request succeeded, else its reason (stats.py)."""
        if not finished:  # a consumer that left: its request leaves the queue now, or its running model is told
            self.scheduler.cancel(pending)
        self.stats.add_pending(-1)
        self.stats.request_done(failure is None, time.monotonic_ns() - start, pending.queue_ns,
                                reason=failure or CANCELED)

    async def _next(self, pending) -> tuple[dict | None, ModelServerError | None, bool]:
        outputs, error, final = await pending.events.get()
        if error is not None and not isinstance(error, ModelServerError):
            error = ModelServerError("internal", f"model '{self.spec.name}': {error}")
        return outputs, error, final

    async def stream(self, req: InferRequest) -> AsyncIterator[InferResponse]:
        """Every response of the request (one, unless the model is decoupled). A decoupled model's error
        response before its last one is yielded as an `ErrorResponse`; an error that ends the request raises."""
        pending, start = self._submit(req)
        failure, final = CANCELED, False  # a consumer that stops reading before the end cancelled the request
        try:
            while not final:
                outputs, error, final = await self._next(pending)
                if error is not None:
                    if final or not self.spec.decoupled:
                        failure = pending.failure
                        raise error
                    yield ErrorResponse(self.spec.name, str(self.version), req.id, error=error)
                elif outputs is not None:
                    failure = BACKEND  # outputs that do not fit the model's config
                    response = self._response(req, outputs, partial=self.spec.decoupled,
                                              final=final if self.spec.decoupled else None)
                    failure = CANCELED
                    yield response
            failure = None
        finally:
            self._done(pending, start, failure, final)

    async def infer(self, req: InferRequest) -> InferResponse:
        if not self.spec.decoupled:  # the hot path: one response, no async generator
            pending, start = self._submit(req)
            failure, final = CANCELED, False  # cancelled (the client left) unless it ends below
            try:
                outputs, error, final = await self._next(pending)
                if error is not None:
                    failure = pending.failure
                    raise error
                failure = BACKEND  # outputs that do not fit the model's config
                response = self._response(req, outputs, partial=False)
                failure = None
                return response
            finally:
                self._done(pending, start, failure, final)
        responses = [r async for r in self.stream(req)]
        failed = next((r for r in responses if isinstance(r, ErrorResponse)), None)
        if failed is not None:
            raise failed.error
        if len(responses) == 1:
            return responses[0]
        if not responses:
            return InferResponse(self.spec.name, str(self.version), req.id, [])
        raise ModelServerError("failed_precondition", f"model '{self.spec.name}' is decoupled and sent "
                               f"{len(responses)} responses; use the streaming API to receive them")
