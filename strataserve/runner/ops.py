"""The swappable compute ops the decoder calls, so the runner mode (eager / triton / graph / hybrid) is chosen in
one place and the model code never knows which implementation runs.

``OpSet`` is the protocol; ``TorchOps`` is plain PyTorch (CPU, and the GPU fallback). The kernels helper adds
``TritonOps`` in ``runner/triton_ops.py`` implementing the same protocol. The model receives its ``OpSet`` at
construction; nothing is patched later.

Shapes: activations are 2-D ``[T, features]`` over the flattened tokens of a mixed batch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from strataserve.runner.attention import AttentionMetadata


class AttentionBackend(Protocol):
    """Paged attention over the KV pool (layout in ``runner/attention.py``).

    ``bind_kv_cache`` is called once at start-up with one ``(k_cache, v_cache)`` pair per layer (and, for an
    fp8/int8 cache, the scales [num_layers, 2, num_kv_heads]). ``forward`` first writes this step's k/v into
    ``meta.slot_mapping`` slots of layer ``layer_idx``, then attends. ``meta=None`` means "no KV cache: the T tokens
    are one causal sequence" (tests, memory profiling, scale calibration: ``kv_observer`` sees each layer's k/v).
    """

    kv_observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      kv_scales: torch.Tensor | None = None) -> None: ...

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        """q ``[T, Hq*D]``, k and v ``[T, Hkv*D]`` (may be strided views) -> ``[T, Hq*D]`` contiguous."""
        ...


class OpSet(Protocol):
    name: str
    attention: AttentionBackend

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear``: the model's weight matmuls (a backend may swap in e.g. a GEMV kernel for one row)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, statistics in float32."""
        ...

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``r = x + residual``; returns ``(rms_norm(r), r)``. Implementations may reuse x/residual storage."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, 2I]`` = [gate | up] -> ``silu(gate) * up`` ``[T, I]``."""
        ...

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``linear(rms_norm(x + residual) * norm_weight, weight, bias)`` (no add when ``residual`` is None);
        returns ``(output, x + residual)`` (or ``(output, x)``), the new residual stream. One call, so a backend can
        run the norm inside the matmul. Implementations may reuse x/residual storage."""
        ...

    def silu_mul_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``linear(silu_and_mul(x), weight)``, one call, so a backend can fuse the activation into the matmul."""
        ...

    def norm_mlp(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                 gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The SwiGLU MLP block from its input: ``silu_mul_linear(norm_linear(x, residual, norm_weight, eps,
        gate_up_weight)[0], down_weight)``; returns ``(output, new residual)``. One call, so a backend can choose
        where the activation goes (the gate_up epilogue or the down prologue)."""
        ...

    def apply_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                     cos_sin_cache: torch.Tensor) -> None:
        """Neox-style rotary, in place on q ``[T, Hq*D]`` and k ``[T, Hkv*D]`` (strided views of the qkv output).

        ``cos_sin_cache`` is float32 ``[max_pos, D]`` (cos half, sin half; see ``models/rope.py``).
        """
        ...

    def rotate_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                  cos_sin_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(Qwen3's per-head RMSNorm of q and k,) then rotary; no KV store, for attention without a paged cache.
        Returns the rotated ``(q, k)``: q/k themselves (in place) or normed copies."""
        ...

    def attend(self, layer_idx: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               head_dim: int, cos_sin_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
               eps: float, meta: AttentionMetadata | None) -> torch.Tensor:
        """One layer's step from the qkv projection to the attention output: (Qwen3's per-head RMSNorm of q and k
        with ``q_norm``/``k_norm``,) rotary, KV store, attention. q ``[T, Hq*D]``, k/v ``[T, Hkv*D]`` (strided
        views of the qkv output, which may be overwritten) -> ``[T, Hq*D]``. One call, so a backend can fuse."""
        ...


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' RMSNorm: statistics in float32, cast back, then scale.
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    t = x.shape[0]
    xv = x.view(t, -1, head_dim)
    half = head_dim // 2
    x1 = xv[..., :half].float()
    x2 = xv[..., half:].float()
    # Compute both halves before writing either: the update is in place.
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    xv[..., :half] = o1
    xv[..., half:] = o2


def unfused_norm_linear(ops: OpSet, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                        eps: float, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``OpSet.norm_linear`` as separate ops: (add +) RMSNorm, then the matmul."""
    h, residual = add_rms_norm(ops, x, residual, norm_weight, eps)
    return ops.linear(h, weight, bias), residual


def add_rms_norm(ops: OpSet, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, or ``(rms_norm(x), x)`` without a residual (the first layer)."""
    if residual is None:
        return ops.rms_norm(x, norm_weight, eps), x
    return ops.fused_add_rms_norm(x, residual, norm_weight, eps)


def unfused_silu_mul_linear(ops: OpSet, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``OpSet.silu_mul_linear`` as separate ops."""
    return ops.linear(ops.silu_and_mul(x), weight)


def unfused_norm_mlp(ops: OpSet, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                     eps: float, gate_up_weight: torch.Tensor,
                     down_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``OpSet.norm_mlp`` as the backend's ``norm_linear`` and ``silu_mul_linear``."""
    gate_up, residual = ops.norm_linear(x, residual, norm_weight, eps, gate_up_weight)
    return ops.silu_mul_linear(gate_up, down_weight), residual


def unfused_attend(ops: OpSet, layer_idx: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, head_dim: int, cos_sin_cache: torch.Tensor, q_norm: torch.Tensor | None,
                   k_norm: torch.Tensor | None, eps: float, meta: AttentionMetadata | None) -> torch.Tensor:
    """``OpSet.attend`` as separate ops: ``unfused_rotate_qk``, then attention (which stores k/v first)."""
    q, k = unfused_rotate_qk(ops, positions, q, k, head_dim, cos_sin_cache, q_norm, k_norm, eps)
    return ops.attention.forward(layer_idx, q, k, v, meta)


def unfused_rotate_qk(ops: OpSet, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                      cos_sin_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``OpSet.rotate_qk`` as separate ops: q/k norm (on copies of the strided views), then rotary in place."""
    if q_norm is not None and k_norm is not None:
        t = q.shape[0]
        q = ops.rms_norm(q.reshape(-1, head_dim), q_norm, eps).view(t, -1)
        k = ops.rms_norm(k.reshape(-1, head_dim), k_norm, eps).view(t, -1)
    ops.apply_rotary(positions, q, k, head_dim, cos_sin_cache)
    return q, k


class TorchOps:
    """Plain PyTorch ops (eager mode)."""

    name = "eager"

    def __init__(self, attention: AttentionBackend) -> None:
        self.attention = attention

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        r = x.add_(residual)
        return _rms_norm(r, weight, eps), r

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return F.silu(x[:, :half]).mul_(x[:, half:])

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return unfused_norm_linear(self, x, residual, norm_weight, eps, weight, bias)

    def silu_mul_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return unfused_silu_mul_linear(self, x, weight)

    def norm_mlp(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                 gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return unfused_norm_mlp(self, x, residual, norm_weight, eps, gate_up_weight, down_weight)

    def attend(self, layer_idx: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               head_dim: int, cos_sin_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
               eps: float, meta: AttentionMetadata | None) -> torch.Tensor:
        return unfused_attend(self, layer_idx, positions, q, k, v, head_dim, cos_sin_cache, q_norm, k_norm, eps, meta)

    def rotate_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                  cos_sin_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return unfused_rotate_qk(self, positions, q, k, head_dim, cos_sin_cache, q_norm, k_norm, eps)

    def apply_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                     cos_sin_cache: torch.Tensor) -> None:
        cs = cos_sin_cache.index_select(0, positions)
        half = head_dim // 2
        cos = cs[:, None, :half]
        sin = cs[:, None, half:]
        _rotate(q, cos, sin, head_dim)
        _rotate(k, cos, sin, head_dim)
