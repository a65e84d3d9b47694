"""Frozen, validated configuration objects shared by every layer.

Each config validates itself at construction and raises ``ValueError`` naming the field and what to change.
Nothing mutates a config after start-up; derive a new one with ``dataclasses.replace``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DType = Literal["auto", "float32", "float16", "bfloat16"]
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp16": "float16", "fp32": "float32", "bf16": "bfloat16"}
RunnerMode = Literal["auto", "eager", "triton", "graph", "hybrid"]
LoadFormat = Literal["auto", "dummy"]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run and how.

    ``model`` is an HF checkpoint folder (config.json + safetensors + tokenizer files).
    ``max_model_len`` None means "take it from config.json" (max_position_embeddings).
    """

    model: str
    dtype: DType = "auto"
    device: str = "auto"  # "auto" -> cuda if available else cpu
    max_model_len: int | None = None
    seed: int = 0
    tokenizer: str | None = None  # defaults to ``model``
    served_model_name: str | None = None
    #: no tokenizer at all (vLLM's skip_tokenizer_init): token-id prompts in, token ids out, empty text
    skip_tokenizer_init: bool = False
    #: "auto": the folder's safetensors; "dummy": random weights in config.json's shapes (benchmarks)
    load_format: LoadFormat = "auto"

    def __post_init__(self) -> None:
        _check(bool(self.model), "model: give the path of an HF checkpoint folder")
        if self.dtype in _DTYPE_ALIASES:  # vLLM's and torch's other names
            object.__setattr__(self, "dtype", _DTYPE_ALIASES[self.dtype])
        _check(self.dtype in ("auto", "float32", "float16", "bfloat16"),
               f"dtype={self.dtype!r}: use one of auto, float32, float16, bfloat16")
        _check(self.max_model_len is None or self.max_model_len > 0,
               f"max_model_len={self.max_model_len}: must be a positive number of tokens")
        _check(self.load_format in ("auto", "dummy"), f"load_format={self.load_format!r}: use auto or dummy")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    On CPU the pool is sized from ``kv_cache_memory_gib``; on GPU from ``gpu_memory_utilization`` (fraction of
    total device memory the whole process may use, weights and activations included). ``num_blocks`` overrides
    both (tests use it to force preemption).
    """

    block_size: int = 16
    kv_cache_memory_gib: float = 1.0
    gpu_memory_utilization: float = 0.90
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    #: KV storage: auto = the model dtype; fp8 (e4m3) / int8 with per-layer, per-KV-head scales (half the bytes of
    #: bf16, so twice the blocks for the same memory); see ``runner/kv_quant.py``
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check(self.block_size > 0 and (self.block_size & (self.block_size - 1)) == 0,
               f"block_size={self.block_size}: must be a power of two (16 is the default)")
        _check(self.kv_cache_memory_gib > 0, f"kv_cache_memory_gib={self.kv_cache_memory_gib}: must be > 0")
        _check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        _check(self.num_blocks is None or self.num_blocks >= 2, f"num_blocks={self.num_blocks}: need at least 2")
        _check(self.kv_cache_dtype in ("auto", "fp8", "int8"),
               f"kv_cache_dtype={self.kv_cache_dtype!r}: use one of auto, fp8, int8")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits for one engine step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    enable_chunked_prefill: bool = True
    max_waiting_requests: int = 4096  # beyond this the API answers 503 (overload)
    #: while decodes run, cap each step's prefill tokens so the step takes about this many ms (the decodes'
    #: inter-token latency; ``engine/step_budget.py``); 0: off; None: auto, i.e. ``AUTO_TARGET_STEP_MS`` where the
    #: runner's step time is its device work (mixed-step CUDA graphs), off elsewhere (`strata serve`'s default)
    target_step_ms: float | None = 0.0
    #: streamed outputs carry at least this many new tokens per chunk (the first token and the last chunk go at
    #: once): fewer, larger chunks cost the API process and the clients fewer socket writes per token (vLLM's
    #: ``stream_interval``); 1 = every token as it comes
    stream_interval: int = 1

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, f"max_num_seqs={self.max_num_seqs}: must be >= 1")
        _check(self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1")
        _check(self.max_waiting_requests >= 1, f"max_waiting_requests={self.max_waiting_requests}: must be >= 1")
        _check(self.target_step_ms is None or self.target_step_ms >= 0,
               f"target_step_ms={self.target_step_ms}: must be >= 0 (0 turns step pacing off) or None (auto)")
        _check(isinstance(self.stream_interval, int) and self.stream_interval >= 1,
               f"stream_interval={self.stream_interval!r}: must be an integer >= 1 (1 streams every token)")


@dataclass(frozen=True)
class RunnerConfig:
    """How the model executes. ``auto`` = ``hybrid`` on CUDA (Triton kernels inside CUDA graphs), ``eager`` on CPU."""

    mode: RunnerMode = "auto"
    cuda_graph_max_bs: int = 256
    #: capture only ``cuda_graph.STARTUP_SIZES`` of the decode graphs before the engine is ready and the rest while it
    #: idles (``strata serve``: ready sooner); off: every bucket at start-up (the offline ``LLM``, which never idles)
    defer_cuda_graphs: bool = False

    def __post_init__(self) -> None:
        _check(self.mode in ("auto", "eager", "triton", "graph", "hybrid"),
               f"mode={self.mode!r}: use one of auto, eager, triton, graph, hybrid")
        _check(self.cuda_graph_max_bs >= 1, f"cuda_graph_max_bs={self.cuda_graph_max_bs}: must be >= 1")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the model split over ``tensor_parallel_size`` ranks, one process each (one GPU each
    on CUDA, NCCL; gloo on CPU). Whether the model's head counts allow the size is checked against config.json
    when the runner starts (``models/parallel.check_tensor_parallel``)."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
               f"tensor_parallel_size={self.tensor_parallel_size!r}: must be an integer >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
