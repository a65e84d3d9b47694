"""``TritonOps``: the ``OpSet`` of ``runner/ops.py`` implemented with the Triton kernels of ``strataserve.kernels``.

Used by the ``triton`` (no graphs) and ``hybrid`` (inside CUDA graphs) runner modes. Every kernel is graph-safe:
launch shapes depend only on tensor shapes, never on tensor values, so a captured decode step replays correctly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strataserve.kernels.activation import silu_and_mul
from strataserve.kernels.decode_attention import default_num_splits, paged_decode_attention
from strataserve.kernels.gemv import gemv
from strataserve.kernels.kv_cache import store_kv
from strataserve.kernels.prefill_attention import prefill_attention
from strataserve.kernels.rms_norm import fused_add_rms_norm, rms_norm
from strataserve.kernels.rotary import apply_rotary
from strataserve.runner.attention import AttentionMetadata, TorchAttention


class TritonAttention:
    """Paged attention with Triton kernels: KV store, split-KV decode, prefill over cached prefixes."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, num_sms: int | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.num_sms = num_sms or (torch.cuda.get_device_properties(0).multi_processor_count
                                   if torch.cuda.is_available() else 8)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._no_cache = TorchAttention(num_heads, num_kv_heads, head_dim)  # meta=None: tests / profiling only

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        if meta is None:
            return self._no_cache.forward(layer_idx, q, k, v, None)
        t = q.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q3, k3, v3 = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
        k_cache, v_cache = self.kv_caches[layer_idx]
        store_kv(k3, v3, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
        nd = meta.num_decode_tokens
        if nd:
            splits = default_num_splits(nd, hkv, self.num_sms)
            paged_decode_attention(q3[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                   self.scale, num_splits=splits, out=out[:nd])
        if meta.prefills:
            qsl = meta.prefill_query_start_loc
            seq_lens = meta.prefill_context_lens + (qsl[1:] - qsl[:-1])
            max_q = max(seg.query_len for seg in meta.prefills)
            prefill_attention(q3, k_cache, v_cache, meta.prefill_block_tables, qsl, seq_lens, max_q, self.scale,
                              out=out)
        return out.view(t, hq * d)


class TritonOps:
    """Triton kernels behind the ``OpSet`` protocol (same semantics as ``TorchOps``).

    ``use_gemv``: one-row matmuls (batch-1 decode) run the streaming GEMV kernel instead of cuBLAS. Off by
    default: on the H200 it lost to cuBLAS (8B batch-1 step 5.17 ms vs 4.71 ms; docs/gpu_notes.md, run 2).
    """

    name = "triton"

    def __init__(self, attention: TritonAttention, use_gemv: bool = False) -> None:
        self.attention = attention
        self.use_gemv = use_gemv

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.use_gemv and x.shape[0] == 1 and x.dim() == 2 and x.is_contiguous():
            return gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # in place: residual <- x + residual, x <- norm(residual) (the protocol allows reusing their storage)
        return fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def apply_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                     cos_sin_cache: torch.Tensor) -> None:
        apply_rotary(q, k, positions, cos_sin_cache, head_dim=head_dim)
