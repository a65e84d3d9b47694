"""Runner modes → the ops a model runs with: the one place eager / triton / graph / hybrid are decided.

Every runner (LLM, Qwen3-TTS talker, OmniVoice backbone) asks ``select_ops`` so the model code never knows the mode.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from strataserve import envs
from strataserve.models.hf_config import DecoderConfig
from strataserve.runner import cpu_kernel as cpu_kernels
from strataserve.runner import cpu_pool
from strataserve.runner.attention import TorchAttention
from strataserve.runner.cpu_attention import eager_attention
from strataserve.runner.cpu_ops import CpuOps
from strataserve.runner.ops import OpSet, TorchOps


@dataclass(frozen=True)
class ExecutionPlan:
    """What the runner mode resolved to: which ops run, and whether decode steps replay CUDA graphs."""

    mode: str
    ops: OpSet
    cuda_graphs: bool


def select_ops(mode: str, cfg: DecoderConfig, device: torch.device, max_num_seqs: int = 256, *,
               cpu_kernel: bool = False, dtype: torch.dtype = torch.float32) -> ExecutionPlan:
    """eager = PyTorch ops (with ``cpu_kernel``: on CPU the in-place paged-attention kernel and the C layer ops
    when they build, with the matmuls on the engine's thread pool, see ``runner/cpu_attention.py``,
    ``runner/cpu_ops.py`` and ``runner/cpu_pool.py``); triton = Triton kernels; graph = PyTorch ops in CUDA graphs; hybrid = kernels in
    graphs. ``auto`` = hybrid on CUDA, eager on CPU. ``dtype``: the model's; the thread pool runs float32 matmuls
    only, so a model in another dtype keeps torch's threads."""
    if mode == "auto":
        mode = "hybrid" if device.type == "cuda" else "eager"
    if mode == "eager":
        attention = (eager_attention(cfg, device, max_num_seqs) if cpu_kernel
                     else TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
        layer_ops = (cpu_kernels.load_layer_ops() if cpu_kernel and device.type == "cpu"
                     and envs.STRATA_CPU_LAYER_OPS else None)
        if layer_ops is None:
            return ExecutionPlan(mode, TorchOps(attention), False)
        pool = cpu_pool.get() if dtype == torch.float32 else None
        return ExecutionPlan(mode, CpuOps(attention, layer_ops, pool), False)
    if device.type != "cuda":
        raise ValueError(f"runner mode {mode!r} needs a CUDA device with triton; on {device.type} use mode='eager' "
                         "(or 'auto')")
    if mode == "graph":
        return ExecutionPlan(mode, TorchOps(TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)), True)
    try:
        from strataserve.runner.triton_ops import TritonAttention, TritonOps
    except ImportError as exc:
        raise ValueError(f"runner mode {mode!r} needs triton ({exc}); install triton or use mode='eager'") from None
    ops = TritonOps(TritonAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    long_first=envs.STRATA_DECODE_LONG_FIRST,
                                    split_target=envs.STRATA_DECODE_SPLIT_TARGET),
                    fused_rope_kv=envs.STRATA_FUSED_ROPE_KV)
    return ExecutionPlan(mode, ops, mode == "hybrid")
