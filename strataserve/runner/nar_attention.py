"""Bidirectional attention over a padded canvas batch, for non-autoregressive models (OmniVoice).

The canvas is N sequences padded to one length L, flattened to ``[N * L]`` tokens for the decoder. Sequence n's
tokens attend to its first ``lengths[n]`` tokens in both directions (no causal mask, no KV cache: every step
recomputes the whole canvas). Padding queries attend to the same keys as their row's real tokens; their outputs
are never read. ``CanvasOps`` wraps any ``OpSet`` (torch or Triton): matmuls, norms, SwiGLU and rotary come from
it, attention from ``CanvasAttention`` (SDPA with a key mask; on CUDA its memory-efficient kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strataserve.runner.ops import OpSet, unfused_attend


@dataclass(slots=True)
class CanvasMeta:
    """Built from tensors alone (no host sync), so a CUDA graph can capture it."""

    num_seqs: int
    seq_len: int
    key_mask: torch.Tensor  # bool [N, 1, 1, L]: True = attend

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor, seq_len: int) -> CanvasMeta:
        """``lengths`` long ``[N]``; a length of 0 (a padding sequence) attends to its first token, never NaN."""
        cols = torch.arange(seq_len, device=lengths.device)
        mask = cols[None, :] < lengths.clamp(min=1)[:, None]
        return cls(int(lengths.shape[0]), seq_len, mask.view(-1, 1, 1, seq_len))


class CanvasAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        raise RuntimeError("a canvas has no KV cache")

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: CanvasMeta) -> torch.Tensor:  # type: ignore[override]
        n, length, d = meta.num_seqs, meta.seq_len, self.head_dim
        q4 = q.reshape(n, length, self.num_heads, d).transpose(1, 2)
        k4 = k.reshape(n, length, self.num_kv_heads, d).transpose(1, 2)
        v4 = v.reshape(n, length, self.num_kv_heads, d).transpose(1, 2)
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k4, v4 = k4.repeat_interleave(rep, dim=1), v4.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=meta.key_mask)
        return o.transpose(1, 2).reshape(n * length, self.num_heads * d)


class CanvasOps:
    """``base``'s ops with bidirectional canvas attention (q/k norm and rotary through ``base``'s kernels)."""

    def __init__(self, base: OpSet, attention: CanvasAttention) -> None:
        self.base = base
        self.attention = attention
        self.name = f"{base.name}+canvas"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.base.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.base.rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.silu_and_mul(x)

    def apply_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                     cos_sin_cache: torch.Tensor) -> None:
        self.base.apply_rotary(positions, q, k, head_dim, cos_sin_cache)

    def attend(self, layer_idx: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               head_dim: int, cos_sin_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
               eps: float, meta: CanvasMeta) -> torch.Tensor:  # type: ignore[override]
        return unfused_attend(self, layer_idx, positions, q, k, v, head_dim, cos_sin_cache, q_norm, k_norm, eps,
                              meta)  # type: ignore[arg-type]
