"""Ensembles: a DAG of model steps wired by tensor names, each step started as soon as its inputs exist.

`validate_ensemble` checks the graph at load (unknown models or tensors, a tensor produced twice, a consumed
tensor nobody produces, cycles) and, as Triton's ensemble validation does, the step models' configs: every
ensemble tensor has one datatype and compatible shapes wherever it appears (the ensemble's inputs and outputs,
each step's mapped inputs and outputs; -1 matches any size, and a batching side's implicit batch dim is
accounted for), and no step model allows a smaller max_batch_size than the ensemble. Errors name the config
file, the step, the tensor and both types and shapes. The server re-runs it whenever a step model changes.
At run time a failing step's error names the ensemble, the step index and the model. A step runs as a task of
the ensemble's request, in its context: behind the router an LLM step is checked and charged as the caller's
own call (``ModelServer.infer``, ``router/repo_llm.py``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from strataserve.modelserver.config import ConfigError, ModelSpec
from strataserve.modelserver.model import ModelVersion, ServedVersion
from strataserve.modelserver.stats import CANCELED, OTHER, REJECTED, ModelStats
from strataserve.types.tensors import InferRequest, InferResponse, InferTensor, ModelServerError

InferFn = Callable[[InferRequest], Awaitable[InferResponse]]


@dataclass(frozen=True)
class _TensorUse:
    """Where an ensemble tensor appears, with the type and shape it has there (Triton's TensorNode)."""

    datatype: str
    dims: tuple[int, ...]  # without the batch dim
    full: tuple[int, ...]  # with it (-1) where that side batches
    where: str  # e.g. "the ensemble input 'X'", "input 'INPUT0' of model 'm' (step 0)"

    @classmethod
    def of(cls, datatype: str, dims, batching: bool, where: str) -> "_TensorUse":
        dims = tuple(int(d) for d in dims)
        return cls(datatype, dims, ((-1,) if batching else ()) + dims, where)

    def describe(self) -> str:
        return f"{self.where} is {self.datatype} [{','.join(str(d) for d in self.full)}]"


def _dims_match(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def _inconsistency(tensor: str, have: _TensorUse, new: _TensorUse) -> str | None:
    """Triton's ValidateTensorConsistency: one datatype; shapes equal where neither is -1, compared without the
    batch dims and then with them (a tensor shared by a batching and a non-batching model: [d..] vs [-1, d..])."""
    if have.datatype != new.datatype:
        what = "data types"
    elif not _dims_match(have.dims, new.dims) and not _dims_match(have.full, new.full):
        what = "shapes (-1: any size)"
    else:
        return None
    return f"tensor '{tensor}' has inconsistent {what}: {have.describe()}, {new.describe()}"


def validate_ensemble(spec: ModelSpec, lookup: Callable[[str, int], ModelSpec | None]) -> None:
    """`lookup(name, version)` gives the spec of a ready step model (version -1: latest) or None."""
    src = spec.source
    batching = spec.max_batch_size > 0
    producer: dict[str, str] = {t.name: "the ensemble input" for t in spec.inputs}
    uses: dict[str, _TensorUse] = {}

    def use(tensor: str, new: _TensorUse, field_name: str, prefix: str) -> None:
        have = uses.setdefault(tensor, new)
        problem = _inconsistency(tensor, have, new) if have is not new else None
        if problem:
            raise ConfigError(src, field_name, f"{prefix}{problem}")

    for t in spec.inputs:  # the tensor the steps get is the reshaped one
        use(t.name, _TensorUse.of(t.datatype, t.reshape if t.reshape is not None else t.dims, batching,
                                  f"the ensemble input '{t.name}'"), "input", f"ensemble '{spec.name}': ")
    for t in spec.outputs:
        use(t.name, _TensorUse.of(t.datatype, t.reshape if t.reshape is not None else t.dims, batching,
                                  f"the ensemble output '{t.name}'"), "output", f"ensemble '{spec.name}': ")
    for i, step in enumerate(spec.ensemble_steps):
        where = f"ensemble_scheduling.step[{i}]"
        ms = lookup(step.model_name, step.model_version)
        if ms is None:
            version = "" if step.model_version < 0 else f" version {step.model_version}"
            raise ConfigError(src, f"{where}.model_name", f"model '{step.model_name}'{version} is not ready (not "
                              "loaded, failed to load, or not in the repository)")
        if ms.decoupled and ms.backend != "llm":  # an LLM step answers with its whole text
            raise ConfigError(src, f"{where}.model_name", f"model '{step.model_name}' is decoupled; ensembles take "
                              "one response per step")
        prefix = f"ensemble '{spec.name}' step {i} (model '{step.model_name}'): "
        if ms.max_batch_size != 0 and ms.max_batch_size < spec.max_batch_size:
            # a non-batching step is fine as long as the shapes agree with the batch dim spelled out
            raise ConfigError(src, "max_batch_size", f"{prefix}the ensemble allows max_batch_size "
                              f"{spec.max_batch_size}, but model '{step.model_name}' allows only {ms.max_batch_size}")
        for key in step.input_map:
            if ms.input(key) is None:
                raise ConfigError(src, f"{where}.input_map", f"'{key}' is not an input of model '{step.model_name}' "
                                  f"(inputs: {[t.name for t in ms.inputs]})")
        unmapped = [t.name for t in ms.inputs if not t.optional and t.name not in step.input_map]
        if unmapped:
            raise ConfigError(src, f"{where}.input_map", f"inputs {unmapped} of model '{step.model_name}' are not mapped")
        step_batching = ms.max_batch_size > 0
        for key, tensor in step.input_map.items():
            ts = ms.input(key)
            use(tensor, _TensorUse.of(ts.datatype, ts.dims, step_batching,
                                      f"input '{key}' of model '{step.model_name}' (step {i})"),
                f"{where}.input_map", prefix)
        for key, tensor in step.output_map.items():
            ts = ms.output(key)
            if ts is None:
                raise ConfigError(src, f"{where}.output_map", f"'{key}' is not an output of model "
                                  f"'{step.model_name}' (outputs: {[t.name for t in ms.outputs]})")
            if tensor in producer:
                raise ConfigError(src, f"{where}.output_map", f"tensor '{tensor}' is already produced by "
                                  f"{producer[tensor]}")
            producer[tensor] = f"step {i} (model '{step.model_name}')"
            use(tensor, _TensorUse.of(ts.datatype, ts.dims, step_batching,
                                      f"output '{key}' of model '{step.model_name}' (step {i})"),
                f"{where}.output_map", prefix)
    for i, step in enumerate(spec.ensemble_steps):
        for tensor in step.input_map.values():
            if tensor not in producer:
                raise ConfigError(src, f"ensemble_scheduling.step[{i}].input_map", f"tensor '{tensor}' is produced "
                                  "by no step and is not an ensemble input")
    for t in spec.outputs:
        if t.name not in producer:
            raise ConfigError(src, "output", f"ensemble output '{t.name}' is produced by no step")
    order = _topological(spec)
    if len(order) != len(spec.ensemble_steps):
        stuck = sorted(set(range(len(spec.ensemble_steps))) - set(order))
        raise ConfigError(src, "ensemble_scheduling.step", f"steps {stuck} form a cycle")


def _topological(spec: ModelSpec) -> list[int]:
    available = {t.name for t in spec.inputs}
    order, left = [], list(range(len(spec.ensemble_steps)))
    progress = True
    while left and progress:
        progress = False
        for i in list(left):
            if set(spec.ensemble_steps[i].input_map.values()) <= available:
                order.append(i)
                left.remove(i)
                available |= set(spec.ensemble_steps[i].output_map.values())
                progress = True
    return order


class EnsembleVersion(ServedVersion):
    def __init__(self, spec: ModelSpec, version: int, stats: ModelStats, infer_fn: InferFn):
        self.spec, self.version, self.stats = spec, version, stats
        self._infer = infer_fn
        self._io = ModelVersion(spec, version, stats)  # reuses its request validation and response shaping

    @property
    def dependencies(self) -> set[str]:
        return {s.model_name for s in self.spec.ensemble_steps}

    async def stream(self, req: InferRequest) -> AsyncIterator[InferResponse]:
        yield await self.infer(req)

    async def infer(self, req: InferRequest) -> InferResponse:
        start = time.monotonic_ns()
        failure: str | None = REJECTED  # until its inputs pass
        self.stats.add_pending(1)
        try:
            breq = self._io._validate(req)
            # a step failed (its model's own counter says why) or gave the wrong datatype: Triton's OTHER
            failure = OTHER
            dtypes = {t.name: t.datatype for t in req.inputs}
            tensors = {name: (dtypes[name], arr) for name, arr in breq.inputs.items()}
            t0 = time.perf_counter_ns()
            await self._run(tensors, req)
            infer_ns = time.perf_counter_ns() - t0
            self._check_datatypes(req, tensors)
            resp = self._io._response(req, {k: v[1] for k, v in tensors.items()}, partial=False)
            self.stats.execution_done(1, breq.rows, 0, infer_ns, 0)
            failure = None
            return resp
        except asyncio.CancelledError:  # the client went away
            failure = CANCELED
            raise
        finally:
            self.stats.add_pending(-1)
            self.stats.request_done(failure is None, time.monotonic_ns() - start, reason=failure or OTHER)

    def _check_datatypes(self, req: InferRequest, tensors: dict) -> None:
        """An output a step produced in another datatype than the ensemble declares is an error, never cast
        (load-time validation refuses such configs; this guards a step model that changed since)."""
        names = req.requested_outputs if req.requested_outputs is not None else [o.name for o in self.spec.outputs]
        for name in names:
            ts = self.spec.output(name)
            if ts is not None and name in tensors and tensors[name][0] != ts.datatype:
                raise ModelServerError("internal", f"ensemble '{self.spec.name}': output '{name}' was produced as "
                                       f"{tensors[name][0]}, but the ensemble declares {ts.datatype}")

    async def close(self) -> None:
        """Once unloaded, let the requests in flight finish (their steps are other models)."""
        while self.stats.pending:
            await asyncio.sleep(0.005)

    async def _run(self, tensors: dict, req: InferRequest) -> None:
        steps = self.spec.ensemble_steps
        todo = set(range(len(steps)))
        running: dict[asyncio.Task, int] = {}
        try:
            while todo or running:
                for i in sorted(todo):
                    if all(t in tensors for t in steps[i].input_map.values()):
                        todo.discard(i)
                        running[asyncio.create_task(self._step(i, tensors, req))] = i
                if not running:
                    raise ModelServerError("internal", f"ensemble '{self.spec.name}': steps {sorted(todo)} can "
                                           "never run (their inputs are never produced)")
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = running.pop(task)
                    resp = task.result()  # raises the step's (already wrapped) error
                    by_name = {o.name: o for o in resp.outputs}
                    for key, tensor in steps[i].output_map.items():
                        tensors[tensor] = (by_name[key].datatype, by_name[key].data)
        finally:
            for task in running:
                task.cancel()

    async def _step(self, i: int, tensors: dict, req: InferRequest) -> InferResponse:
        step = self.spec.ensemble_steps[i]
        inputs = [InferTensor(key, tensors[name][0], list(tensors[name][1].shape), tensors[name][1])
                  for key, name in step.input_map.items()]
        sub = InferRequest(step.model_name, "" if step.model_version < 0 else str(step.model_version),
                           id=req.id, inputs=inputs, requested_outputs=list(step.output_map),
                           parameters=dict(req.parameters), priority=req.priority, timeout_us=req.timeout_us)
        try:
            return await self._infer(sub)
        except ModelServerError as e:  # its headers kept: an LLM step's 429 from the router keeps its Retry-After
            raise ModelServerError(e.code, f"ensemble '{self.spec.name}' step {i} (model '{step.model_name}'): "
                                   f"{e.message}", e.headers) from e
        except Exception as e:  # noqa: BLE001
            raise ModelServerError("internal", f"ensemble '{self.spec.name}' step {i} (model '{step.model_name}'): "
                                   f"{type(e).__name__}: {e}") from e
