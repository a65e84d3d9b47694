"""Parsed config (`ModelConfig` protobuf) → validated `ModelSpec`.

Text parsing lives in `pbtxt.py` (protobuf's text_format against our own schema, model_config.proto, so a field
strataserve does not know is an error that names it, never silently ignored). Validation errors name the file, the field and the
fault; they are `ConfigError` (a ModelServerError with code invalid_argument).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from strataserve.types import model_config_pb2 as pb
from strataserve.types.tensors import CONFIG_TO_KSERVE, ModelServerError

log = logging.getLogger(__name__)
DEFAULT_MAX_BATCH_SIZE = 4  # what auto-complete sets for a batchable model without max_batch_size (as Triton)
PLATFORM_TO_BACKEND = {
    "onnxruntime_onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "pytorch_torch_export": "pytorch",
    "ensemble": "ensemble",
}
KNOWN_BACKENDS = ("onnxruntime", "pytorch", "python", "llm", "ensemble")


class ConfigError(ModelServerError):
    def __init__(self, source: str | Path, field_name: str, what: str):
        super().__init__("invalid_argument", f"{source}: field '{field_name}': {what}")
        self.source, self.field_name, self.what = str(source), field_name, what


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # KServe name, e.g. "FP32", "BYTES"
    dims: tuple[int, ...]  # without the batch dim; -1 = any size
    reshape: tuple[int, ...] | None = None  # the shape the model itself sees (without batch dim)
    optional: bool = False


@dataclass(frozen=True)
class QueuePolicy:
    timeout_action: str = "REJECT"  # or "DELAY"
    default_timeout_us: int = 0  # 0: no timeout
    allow_timeout_override: bool = False
    max_queue_size: int = 0  # 0: unbounded
    configured: bool = False  # False: no policy in the config (request timeouts are then honoured)


@dataclass(frozen=True)
class BatchingSpec:
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    priority_levels: int = 0  # 0: a single level
    default_priority_level: int = 0
    default_queue_policy: QueuePolicy = QueuePolicy()
    priority_queue_policy: dict[int, QueuePolicy] = field(default_factory=dict)

    def policy(self, level: int) -> QueuePolicy:
        return self.priority_queue_policy.get(level, self.default_queue_policy)


@dataclass(frozen=True)
class EnsembleStep:
    model_name: str
    model_version: int  # -1: latest ready
    input_map: dict[str, str]  # step model's input name -> ensemble tensor name
    output_map: dict[str, str]  # step model's output name -> ensemble tensor name


@dataclass(frozen=True)
class ModelSpec:
    name: str
    backend: str
    platform: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    instance_count: int
    instance_kind: str  # "KIND_CPU" / "KIND_GPU" / "KIND_MODEL" / "KIND_AUTO"
    dynamic_batching: BatchingSpec | None
    ensemble_steps: tuple[EnsembleStep, ...]
    decoupled: bool
    parameters: dict[str, str]
    default_model_filename: str
    source: str  # the config file (or folder, when auto-completed) errors should name
    proto: pb.ModelConfig = field(repr=False, compare=False, default=None)

    @cached_property
    def _inputs_by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.inputs}

    @cached_property
    def _outputs_by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.outputs}

    def input(self, name: str) -> TensorSpec | None:
        return self._inputs_by_name.get(name)

    def output(self, name: str) -> TensorSpec | None:
        return self._outputs_by_name.get(name)


def _dims(values, source, field_name, allow_empty: bool) -> tuple[int, ...]:
    dims = tuple(int(d) for d in values)
    for d in dims:
        if d == 0 or d < -1:
            raise ConfigError(source, field_name, f"dimension {d} is invalid; use a positive size or -1")
    if not dims and not allow_empty:
        raise ConfigError(source, field_name, "dims must list at least one dimension")
    return dims


def _tensors(items, kind: str, source, batching: bool) -> tuple[TensorSpec, ...]:
    specs, seen = [], set()
    for i, t in enumerate(items):
        where = f"{kind}[{i}]"
        if not t.name:
            raise ConfigError(source, f"{where}.name", "is empty")
        if t.name in seen:
            raise ConfigError(source, f"{where}.name", f"'{t.name}' is declared twice")
        seen.add(t.name)
        dtype_name = pb.DataType.Name(t.data_type)
        if dtype_name not in CONFIG_TO_KSERVE:
            raise ConfigError(source, f"{where}.data_type", f"'{t.name}' has no data_type (e.g. TYPE_FP32)")
        dims = _dims(t.dims, source, f"{where}.dims", allow_empty=batching or t.HasField("reshape"))
        reshape = None
        if t.HasField("reshape"):
            reshape = _dims(t.reshape.shape, source, f"{where}.reshape.shape", allow_empty=True)
            if -1 not in dims and -1 not in reshape and _prod(dims) != _prod(reshape):
                raise ConfigError(source, f"{where}.reshape", f"{list(reshape)} does not hold the {_prod(dims)} "
                                  f"elements of dims {list(dims)}")
        specs.append(TensorSpec(t.name, CONFIG_TO_KSERVE[dtype_name], dims, reshape,
                                bool(getattr(t, "optional", False))))
    return tuple(specs)


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def _queue_policy(q: pb.ModelQueuePolicy, configured: bool) -> QueuePolicy:
    return QueuePolicy(pb.ModelQueuePolicy.TimeoutAction.Name(q.timeout_action), int(q.default_timeout_microseconds),
                       bool(q.allow_timeout_override), int(q.max_queue_size), configured)


def build_spec(cfg: pb.ModelConfig, model_name: str, source: str | Path, backend_hint: str | None = None) -> ModelSpec:
    """Validate a parsed (and auto-completed) config. `backend_hint` comes from the files in the model folder."""
    if cfg.name and cfg.name != model_name:
        raise ConfigError(source, "name", f"'{cfg.name}' differs from the model folder name '{model_name}'")
    cfg.name = model_name
    backend = cfg.backend or PLATFORM_TO_BACKEND.get(cfg.platform, "") or (backend_hint or "")
    if cfg.platform and cfg.platform not in PLATFORM_TO_BACKEND:
        raise ConfigError(source, "platform", f"unknown platform '{cfg.platform}'; known: {sorted(PLATFORM_TO_BACKEND)}")
    if not backend:
        raise ConfigError(source, "backend", "no backend or platform given and none can be told from the model files")
    if backend not in KNOWN_BACKENDS:
        raise ConfigError(source, "backend", f"unknown backend '{backend}'; known: {list(KNOWN_BACKENDS)}")
    if backend != "ensemble":  # the completed config says what serves it, as Triton's auto-complete does
        cfg.backend = backend
        if not cfg.platform and backend in ("onnxruntime", "pytorch"):
            cfg.platform = {"onnxruntime": "onnxruntime_onnx", "pytorch": "pytorch_libtorch"}[backend]
    mbs = cfg.max_batch_size if cfg.HasField("max_batch_size") else 0
    cfg.max_batch_size = mbs  # present in the JSON form even when the file left it out, as in Triton's
    if mbs < 0:
        raise ConfigError(source, "max_batch_size", f"{mbs} is negative; use 0 (no batching) or a positive size")
    inputs = _tensors(cfg.input, "input", source, mbs > 0)
    outputs = _tensors(cfg.output, "output", source, mbs > 0)
    if not inputs and backend != "llm":
        raise ConfigError(source, "input", "the model declares no inputs")
    if not outputs and backend != "llm":
        raise ConfigError(source, "output", "the model declares no outputs")

    count, kind = 1, "KIND_CPU"
    if len(cfg.instance_group) > 1:
        raise ConfigError(source, "instance_group", "only one instance_group entry is supported; use its count")
    for i, g in enumerate(cfg.instance_group):
        count = g.count or 1
        if count < 0:
            raise ConfigError(source, f"instance_group[{i}].count", f"{count} is negative")
        kind = pb.ModelInstanceGroup.Kind.Name(g.kind)
        if kind == "KIND_AUTO":
            kind = "KIND_CPU"

    batching = None
    if cfg.HasField("dynamic_batching"):
        db = cfg.dynamic_batching
        if mbs == 0:
            raise ConfigError(source, "dynamic_batching", "needs max_batch_size > 0")
        for s in db.preferred_batch_size:
            if s <= 0 or s > mbs:
                raise ConfigError(source, "dynamic_batching.preferred_batch_size",
                                  f"{s} must be between 1 and max_batch_size ({mbs})")
        levels = int(db.priority_levels)
        default_level = int(db.default_priority_level)
        if levels and not 1 <= default_level <= levels:
            raise ConfigError(source, "dynamic_batching.default_priority_level",
                              f"{default_level} must be between 1 and priority_levels ({levels})")
        for level in db.priority_queue_policy:
            if not 1 <= level <= max(levels, 1):
                raise ConfigError(source, "dynamic_batching.priority_queue_policy",
                                  f"level {level} is outside 1..priority_levels ({levels})")
        batching = BatchingSpec(
            tuple(sorted(int(s) for s in db.preferred_batch_size)), int(db.max_queue_delay_microseconds),
            levels, default_level if levels else 0,
            _queue_policy(db.default_queue_policy, db.HasField("default_queue_policy")),
            {int(k): _queue_policy(v, True) for k, v in db.priority_queue_policy.items()},
        )

    steps = []
    if backend == "ensemble":
        if not cfg.ensemble_scheduling.step:
            raise ConfigError(source, "ensemble_scheduling", "an ensemble needs at least one step")
        for i, s in enumerate(cfg.ensemble_scheduling.step):
            if not s.model_name:
                raise ConfigError(source, f"ensemble_scheduling.step[{i}].model_name", "is empty")
            steps.append(EnsembleStep(s.model_name, int(s.model_version) or -1, dict(s.input_map), dict(s.output_map)))
    elif cfg.HasField("ensemble_scheduling"):
        raise ConfigError(source, "ensemble_scheduling", f"is only allowed with platform 'ensemble', not '{backend}'")

    decoupled = cfg.model_transaction_policy.decoupled
    # The completed config states the defaults it runs with, as Triton's does.
    cfg.model_transaction_policy.SetInParent()
    if not cfg.version_policy.WhichOneof("policy_choice"):
        cfg.version_policy.latest.num_versions = 1
    if backend != "ensemble":
        if not cfg.instance_group:
            cfg.instance_group.add(count=count, kind=pb.ModelInstanceGroup.Kind.Value(kind))
        group = cfg.instance_group[0]
        group.name, group.count = group.name or model_name, count
        group.kind = pb.ModelInstanceGroup.Kind.Value(kind)
    if decoupled and backend not in ("python", "llm"):
        raise ConfigError(source, "model_transaction_policy.decoupled", f"backend '{backend}' cannot be decoupled")
    return ModelSpec(
        name=model_name, backend=backend, platform=cfg.platform, max_batch_size=mbs, inputs=inputs,
        outputs=outputs, instance_count=count, instance_kind=kind, dynamic_batching=batching,
        ensemble_steps=tuple(steps), decoupled=decoupled,
        parameters={k: v.string_value for k, v in cfg.parameters.items()},
        default_model_filename=cfg.default_model_filename, source=str(source), proto=cfg,
    )
