"""Bidirectional attention over a padded canvas batch, for non-autoregressive models (OmniVoice).

The canvas is one or more groups of sequences, each group padded to its own length L_g and flattened to
``[N_g * L_g]`` tokens, the groups back to back (OmniVoice: the conditional rows, then the shorter unconditional
rows, so those are not padded to the conditional length). Sequence n's tokens attend to its first ``lengths[n]``
tokens of its own row in both directions (no causal mask, no KV cache: every step recomputes the whole canvas).
Padding queries attend to the same keys as their row's real tokens; their outputs are never read. ``CanvasOps`` wraps any ``OpSet`` (torch or Triton): matmuls, norms, SwiGLU and rotary come from
it (with Triton, Qwen3's q/k norm and the rotary in one launch), attention from ``CanvasAttention`` (SDPA with a
key mask and shared kv heads; on the H200 cuDNN's flash kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strataserve.runner.ops import OpSet


@dataclass(slots=True)
class CanvasGroup:
    """Built from tensors alone (no host sync), so a CUDA graph can capture it."""

    num_seqs: int
    seq_len: int
    key_mask: torch.Tensor  # bool [N, 1, 1, L]: True = attend

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor, seq_len: int) -> CanvasGroup:
        """``lengths`` long ``[N]``; a length of 0 (a padding sequence) attends to its first token, never NaN."""
        cols = torch.arange(seq_len, device=lengths.device)
        mask = cols[None, :] < lengths.clamp(min=1)[:, None]
        return cls(int(lengths.shape[0]), seq_len, mask.view(-1, 1, 1, seq_len))


@dataclass(slots=True)
class CanvasMeta:
    groups: tuple[CanvasGroup, ...]

    @classmethod
    def from_lengths(cls, *groups: tuple[torch.Tensor, int]) -> CanvasMeta:
        """One ``(lengths [N_g], L_g)`` per group, in the canvas's order."""
        return cls(tuple(CanvasGroup.from_lengths(lengths, seq_len) for lengths, seq_len in groups))


class CanvasAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        raise RuntimeError("a canvas has no KV cache")

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: CanvasMeta) -> torch.Tensor:  # type: ignore[override]
        # each group's output is written straight into its rows (no concatenation afterwards)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        start = 0
        for g in meta.groups:
            end = start + g.num_seqs * g.seq_len
            self._group(q[start:end], k[start:end], v[start:end], g, out[start:end])
            start = end
        return out

    def _group(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: CanvasGroup, out: torch.Tensor) -> None:
        n, length, d = g.num_seqs, g.seq_len, self.head_dim
        q4 = q.reshape(n, length, self.num_heads, d).transpose(1, 2)
        k4 = k.reshape(n, length, self.num_kv_heads, d).transpose(1, 2)
        v4 = v.reshape(n, length, self.num_kv_heads, d).transpose(1, 2)
        # enable_gqa: the kv heads are shared in the kernel instead of repeat_interleave'd copies (H200, run 15:
        # 111 vs 180 us for 32 rows of 224, bit-identical; benchmarks/canvas_attention_ab.py)
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=g.key_mask,
                                           enable_gqa=self.num_kv_heads != self.num_heads)
        out.view(n, length, self.num_heads, d).copy_(o.transpose(1, 2))


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

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.norm_linear(x, residual, norm_weight, eps, weight, bias)

    def silu_mul_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.base.silu_mul_linear(x, weight)

    def norm_mlp(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                 gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.norm_mlp(x, residual, norm_weight, eps, gate_up_weight, down_weight)

    def apply_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                     cos_sin_cache: torch.Tensor) -> None:
        self.base.apply_rotary(positions, q, k, head_dim, cos_sin_cache)

    def attend(self, layer_idx: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               head_dim: int, cos_sin_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
               eps: float, meta: CanvasMeta) -> torch.Tensor:  # type: ignore[override]
        # no cache to store into: the base's rotate_qk (Triton: q/k norm + rotary in one launch, in place)
        q, k = self.base.rotate_qk(positions, q, k, head_dim, cos_sin_cache, q_norm, k_norm, eps)
        return self.attention.forward(layer_idx, q, k, v, meta)

    def rotate_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                  cos_sin_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.rotate_qk(positions, q, k, head_dim, cos_sin_cache, q_norm, k_norm, eps)
