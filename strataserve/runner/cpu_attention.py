"""``CpuPagedAttention``: the eager runner's attention backend on CPU, reading K/V blocks in place.

Decode rows and prefill chunks run the C kernel of ``cpu_paged_attention.c`` straight over the block tables: no
per-step gather of every context into a contiguous copy, which cost about as much as the attention itself
(docs/performance.md). Fresh prompts too: their K/V are in the cache by then, and the kernel took 0.23-0.97 of
SDPA's time on every shape measured (``benchmarks/cpu_prefill_attention.py``: 32-2,048 tokens, head dims 32-128).
SDPA remains for a sequence without a cache.

It reads only the generic fields of ``AttentionMetadata`` (block tables, context lengths, query offsets), so the
runner skips building the torch backend's padded groups and masks.
"""
from __future__ import annotations

import numpy as np
import torch

from strataserve import envs
from strataserve.models.hf_config import DecoderConfig
from strataserve.runner import cpu_kernel
from strataserve.runner.attention import AttentionMetadata, TorchAttention


class _StepPlan:
    """Kernel arguments derived from one step's metadata, shared by every layer of the step."""

    __slots__ = ("meta", "decode", "prefill")

    def __init__(self, meta: AttentionMetadata, ones: torch.Tensor, arange: torch.Tensor) -> None:
        self.meta = meta
        b = meta.num_decode_tokens
        #: (block_tables, q_start, q_len, kv_lens) of the decode rows: one query each at its last position
        self.decode = (meta.decode_block_tables, arange[:b], ones[:b], meta.decode_context_lens) if b else None
        #: the same for every prefill chunk, fresh or after cached tokens: its queries are its last positions
        self.prefill = None
        n = len(meta.prefills)
        if n:
            start = meta.prefill_query_start_loc.numpy()
            q_start, q_len = start[:n], start[1:n + 1] - start[:n]
            kv = meta.prefill_context_lens.numpy()[:n] + q_len
            self.prefill = (meta.prefill_block_tables[:n].contiguous(), torch.from_numpy(q_start.astype(np.int32)),
                            torch.from_numpy(q_len.astype(np.int32)), torch.from_numpy(kv.astype(np.int32)))


class CpuPagedAttention:
    """Paged attention on CPU through the C kernel (``cpu_kernel.paged_attention``); KV layout as in
    ``runner/attention.py``. ``sliding_window``: each query sees only the last ``sliding_window`` positions."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None,
                 max_rows: int = 256) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.window = sliding_window
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._sdpa = TorchAttention(num_heads, num_kv_heads, head_dim)  # fresh chunks, and meta=None
        self._ones = torch.ones(max_rows, dtype=torch.int32)
        self._arange = torch.arange(max_rows, dtype=torch.int32)
        self._plan: _StepPlan | None = None

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kv_scales=None) -> None:
        if kv_scales is not None:
            raise ValueError("the CPU paged-attention kernel reads model-dtype caches only; fp8/int8 KV caches run "
                             "through TorchAttention (select_ops(..., cpu_kernel=False))")
        self.kv_caches = kv_caches
        self._plan = None

    def _step_plan(self, meta: AttentionMetadata) -> _StepPlan:
        if self._plan is None or self._plan.meta is not meta:
            if meta.num_decode_tokens > self._ones.shape[0]:
                n = 2 * meta.num_decode_tokens
                self._ones, self._arange = torch.ones(n, dtype=torch.int32), torch.arange(n, dtype=torch.int32)
            self._plan = _StepPlan(meta, self._ones, self._arange)
        return self._plan

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        t = q.shape[0]
        hkv, d = self.num_kv_heads, self.head_dim
        if meta is None:
            return self._sdpa.forward(layer_idx, q, k, v, None)
        k_cache, v_cache = self.kv_caches[layer_idx]
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k.view(t, hkv, d))
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v.view(t, hkv, d))
        return self.forward_stored(layer_idx, q, meta)

    def forward_stored(self, layer_idx: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``forward`` once k and v are already in the cache rows of ``meta.slot_mapping`` (``CpuOps.attend``
        stores them together with the rotary)."""
        t = q.shape[0]
        hq, d = self.num_heads, self.head_dim
        q3 = q.view(t, hq, d)
        k_cache, v_cache = self.kv_caches[layer_idx]
        plan = self._step_plan(meta)
        out = q.new_empty(t, hq, d)
        for args in (plan.decode, plan.prefill):
            if args is not None:
                cpu_kernel.paged_attention(q3, out, k_cache, v_cache, *args, scale=self.scale, window=self.window)
        return out.view(t, hq * d)


def eager_attention(cfg: DecoderConfig, device: torch.device, max_num_seqs: int = 256):
    """The eager runner's attention: ``CpuPagedAttention`` on CPU when its kernel builds here (and
    ``STRATA_CPU_ATTENTION`` is not "0"), else ``TorchAttention`` (gather + SDPA)."""
    if device.type == "cpu" and envs.STRATA_CPU_ATTENTION and cpu_kernel.load() is not None:
        window = cfg.sliding_window if cfg.window_every_layer else None
        return CpuPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, window, max_num_seqs)
    return TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
