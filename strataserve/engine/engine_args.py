"""vLLM's engine arguments: ``EngineArgs`` / ``AsyncEngineArgs`` and their ``create_engine_config()``, so
``AsyncLLM.from_engine_args(AsyncEngineArgs(model=DIR))`` ports from vLLM by changing the import. ``LLM(...)``
takes the same keywords (and ``num_blocks`` for ``num_gpu_blocks_override``)."""
from __future__ import annotations

from dataclasses import dataclass

from strataserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, RunnerConfig, SchedulerConfig


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    enable_chunked_prefill: bool = True
    kv_cache_memory_gib: float = 1.0  # CPU: the KV pool's size
    gpu_memory_utilization: float = 0.90
    num_gpu_blocks_override: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    seed: int = 0
    enforce_eager: bool = False
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False
    tensor_parallel_size: int = 1
    load_format: str = "auto"
    kv_cache_dtype: str = "auto"
    mode: str = "auto"  # strataserve's runner mode: auto / eager / triton / graph / hybrid
    cuda_graph_max_bs: int = 256
    target_step_ms: float | None = 0.0

    def create_engine_config(self) -> EngineConfig:
        mode = "eager" if self.enforce_eager and self.mode == "auto" else self.mode
        return EngineConfig(
            model=ModelConfig(model=str(self.model), dtype=self.dtype, device=self.device,  # type: ignore[arg-type]
                              max_model_len=self.max_model_len, seed=self.seed, tokenizer=self.tokenizer,
                              served_model_name=self.served_model_name, skip_tokenizer_init=self.skip_tokenizer_init,
                              load_format=self.load_format),  # type: ignore[arg-type]
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory_gib=self.kv_cache_memory_gib,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              num_blocks=self.num_gpu_blocks_override, enable_prefix_caching=self.enable_prefix_caching,
                              kv_cache_dtype=self.kv_cache_dtype),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      target_step_ms=self.target_step_ms),
            runner=RunnerConfig(mode=mode, cuda_graph_max_bs=self.cuda_graph_max_bs),  # type: ignore[arg-type]
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
        )


class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the async engine's arguments (the same fields)."""
