"""``CpuOps``: the eager op set on CPU, with a decoder layer's elementwise groups as single C calls.

``TorchOps`` runs about 40 PyTorch ops per layer besides the matmuls and attention (add, the composite RMSNorm,
the rotary's slices and products, two index copies into the cache, SiLU, mul). At the row counts a CPU serves
(tens to a few hundred tokens per step) each costs more in dispatch and cold caches than in arithmetic, and runs
on one thread. ``cpu_layer_ops.c`` does each group in one pass, on the engine's threads:

- ``fused_add_rms_norm`` / ``rms_norm``: residual add and RMSNorm;
- ``attend``: (Qwen3's q/k norm,) rotary in place and the K/V store into the paged cache, then attention;
- ``silu_and_mul``;
- ``linear`` (float32) as tiles of MKL's sgemm on the engine's work-sharing pool when there is one
  (``runner/cpu_pool.py``), which then also runs the C ops' parallel loops (else torch's OpenMP threads do).

Only float32 tensors of the expected layouts take the C path (what the CPU engine runs: HF token-identity is
checked in float32); anything else falls through to ``TorchOps``. Rounding follows PyTorch's ops (see the C file),
except sums of squares, which may differ in the last bit.
"""
from __future__ import annotations

import ctypes

import torch

from strataserve.runner.attention import AttentionMetadata
from strataserve.runner.cpu_attention import CpuPagedAttention
from strataserve.runner.cpu_pool import CpuPool
from strataserve.runner.ops import AttentionBackend, TorchOps

_F32 = torch.float32


def _rows(x: torch.Tensor) -> bool:
    """A float32 matrix whose rows are contiguous (any row stride)."""
    return x.dtype == _F32 and x.dim() == 2 and x.stride(1) == 1


class CpuOps(TorchOps):
    """``TorchOps`` with the C layer ops of ``cpu_layer_ops.c`` (``lib``: ``cpu_kernel.load_layer_ops()``)."""

    name = "eager"

    def __init__(self, attention: AttentionBackend, lib: ctypes.CDLL, pool: CpuPool | None = None) -> None:
        super().__init__(attention)
        self._lib = lib
        self.pool = pool

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.pool.linear(x, weight, bias) if self.pool is not None else None
        return super().linear(x, weight, bias) if y is None else y

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> torch.Tensor:
        rows, h = x.shape
        out = torch.empty(rows, h, dtype=_F32)
        self._lib.strata_add_rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                                      weight.data_ptr(), out.data_ptr(), rows, h, eps)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if _rows(x) and weight.dtype == _F32 and weight.is_contiguous():
            return self._norm(x, None, weight, eps)
        return super().rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if (_rows(x) and x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape
                and residual.dtype == _F32 and weight.dtype == _F32 and weight.is_contiguous()):
            return self._norm(x, residual, weight, eps), x  # x += residual in place, as TorchOps does
        return super().fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not _rows(x) or x.shape[1] % 2:
            return super().silu_and_mul(x)
        rows, n = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, n, dtype=_F32)
        self._lib.strata_silu_mul(x.data_ptr(), x.stride(0), out.data_ptr(), rows, n)
        return out

    def attend(self, layer_idx: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               head_dim: int, cos_sin_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
               eps: float, meta: AttentionMetadata | None) -> torch.Tensor:
        t = q.shape[0]
        packed = (_rows(q) and k.stride() == q.stride() and v.stride() == q.stride() and k.dtype == v.dtype == _F32
                  and k.data_ptr() == q.data_ptr() + 4 * q.shape[1] and v.data_ptr() == k.data_ptr() + 4 * k.shape[1]
                  and positions.dtype == torch.int64 and positions.is_contiguous()
                  and cos_sin_cache.dtype == _F32 and cos_sin_cache.is_contiguous()
                  and cos_sin_cache.shape[1] == head_dim
                  and all(w is None or (w.dtype == _F32 and w.is_contiguous()) for w in (q_norm, k_norm))
                  and (q_norm is None) == (k_norm is None))
        if not packed:
            return super().attend(layer_idx, positions, q, k, v, head_dim, cos_sin_cache, q_norm, k_norm, eps, meta)
        att = self.attention
        caches = att.kv_caches[layer_idx] if isinstance(att, CpuPagedAttention) and meta is not None else None
        slots = meta.slot_mapping if caches is not None else None
        store = (caches is not None and caches[0].dtype == _F32 and slots.dtype == torch.int64
                 and slots.is_contiguous())
        self._lib.strata_rotary_store(
            q.data_ptr(), q.stride(0), t, q.shape[1] // head_dim, k.shape[1] // head_dim, head_dim,
            positions.data_ptr(), cos_sin_cache.data_ptr(), None if q_norm is None else q_norm.data_ptr(),
            None if k_norm is None else k_norm.data_ptr(), eps, caches[0].data_ptr() if store else None,
            caches[1].data_ptr() if store else None, slots.data_ptr() if store else None)
        if store:
            return att.forward_stored(layer_idx, q, meta)
        return att.forward(layer_idx, q, k, v, meta)
