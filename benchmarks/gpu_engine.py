"""Drive the real engine (scheduler + runner + sampler) offline for the GPU scripts: greedy token ids per prompt.

Uses ``LLMEngine`` with an ``EngineConfig`` directly, so the GPU scripts depend only on the engine's core API.
"""
from __future__ import annotations

import time

import torch

from strataserve.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig
from strataserve.engine.llm_engine import LLMEngine
from strataserve.types.sampling import SamplingParams
from strataserve.runner.model_runner import ModelRunner


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_engine(path: str, mode: str, dtype: str, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                max_model_len: int | None = None, num_blocks: int | None = None,
                gpu_memory_utilization: float = 0.85, device: str = "cuda",
                async_scheduling: bool | None = None, kv_cache_dtype: str = "auto") -> tuple[LLMEngine, float]:
    """The engine and its start-up seconds (weights, KV pool, graph capture: to ready).

    ``async_scheduling``: None = the runner's default (on for CUDA); False = the synchronous loop."""
    cfg = EngineConfig(
        model=ModelConfig(model=path, dtype=dtype, device=device, max_model_len=max_model_len),
        cache=CacheConfig(num_blocks=num_blocks, gpu_memory_utilization=gpu_memory_utilization,
                          kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        runner=RunnerConfig(mode=mode, cuda_graph_max_bs=max_num_seqs))
    _sync(device)
    t0 = time.perf_counter()
    runner = None if async_scheduling is None else ModelRunner(cfg, async_scheduling=async_scheduling)
    eng = LLMEngine(cfg, runner=runner)
    _sync(device)
    return eng, time.perf_counter() - t0


def generate(eng: LLMEngine, prompts: list[list[int]], max_tokens: list[int],
             logit_bias: list[dict[int, float] | None] | None = None) -> list[list[int]]:
    """Greedy, ignore_eos; all requests submitted at once; returns output token ids in prompt order.
    ``logit_bias``: per prompt, OpenAI's logit_bias (None: none)."""
    biases = logit_bias or [None] * len(prompts)
    for i, (p, n, b) in enumerate(zip(prompts, max_tokens, biases)):
        eng.add_request(str(i), list(p), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                        logit_bias=b))
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[str(i)] for i in range(len(prompts))]
