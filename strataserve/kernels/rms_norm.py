"""RMSNorm and fused residual-add + RMSNorm.

Math (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019), per row x of width H:

    y = x / sqrt(mean(x ** 2) + eps) * w

The fused variant first adds the residual stream, s = x + r, stores s (rounded to the tensor dtype, as the
unfused model does) as the new residual, then normalises s. One pass over memory instead of three (add, read
back, normalise): the fusion popularised by vLLM's ``fused_add_rms_norm``; the kernel here is our own.

Statistics are computed in float32 whatever the storage dtype. One program per row; rows may be strided
(the last dimension must be contiguous).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strataserve.kernels._common import (check, check_float, check_last_dim_contiguous, check_same_device, next_pow2,
                                        pdl_args, pdl_wait)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, out_stride, H, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    # round the normalised value to the storage dtype before the weight, like the PyTorch/HF reference
    xn = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (xn * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, x_stride, r_stride, H, eps, BLOCK: tl.constexpr,
                               PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(r_ptr.dtype.element_ty)
    tl.store(r_ptr + row * r_stride + cols, s, mask=mask)
    s = s.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
    sn = (s * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(x_ptr + row * x_stride + cols, (sn * w).to(x_ptr.dtype.element_ty), mask=mask)


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """View [..., H] as [N, H] without copying (in-place kernels must write into the caller's memory)."""
    check(t.dim() >= 1, f"{name}: expected at least 1 dim, got a scalar")
    check_last_dim_contiguous(name, t)
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as exc:
        raise ValueError(f"{name}: shape {tuple(t.shape)} with strides {t.stride()} cannot be viewed as "
                         f"[rows, {t.shape[-1]}]; pass a 2-D tensor or call .contiguous()") from exc


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    check(weight.dim() == 1 and weight.shape[0] == x.shape[-1],
          f"weight: expected shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    check(weight.is_contiguous(), "weight: must be contiguous")
    check_float("weight", weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` [..., H] with ``weight`` [H]; returns a new tensor (or writes ``out``)."""
    check_float("x", x)
    _check_weight(x, weight)
    check_same_device(x=x, weight=weight)
    x2 = _rows("x", x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    check(out.shape == x.shape and out.dtype == x.dtype, f"out: expected {tuple(x.shape)} {x.dtype}")
    o2 = _rows("out", out)
    H = x.shape[-1]
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, o2, x2.stride(0), o2.stride(0), H, eps,
                                         BLOCK=next_pow2(H), num_warps=_warps(H), **pdl_args(x, x2.shape[0]))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x``; ``x = rms_norm(residual) * weight``. Returns ``(x, residual)``.
    ``num_warps`` overrides the launch's default for the row width (launch-config sweeps)."""
    check_float("x", x)
    check(residual.shape == x.shape and residual.dtype == x.dtype,
          f"residual: expected shape {tuple(x.shape)} and dtype {x.dtype}, got {tuple(residual.shape)} "
          f"{residual.dtype}")
    _check_weight(x, weight)
    check_same_device(x=x, residual=residual, weight=weight)
    x2, r2 = _rows("x", x), _rows("residual", residual)
    H = x.shape[-1]
    if x2.shape[0]:
        _fused_add_rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, x2.stride(0), r2.stride(0), H, eps,
                                                   BLOCK=next_pow2(H),
                                                   num_warps=num_warps or _warps(H, x2.shape[0]),
                                                   **pdl_args(x, x2.shape[0]))
    return x, residual


def _warps(H: int, rows: int = 1 << 30) -> int:
    # a few rows (decode) are latency-bound: 4 warps beat 8 at H=4096, batch 1 (1.41 vs 1.58 us, run-6 sweep)
    return 1 if H <= 256 else 4 if H <= 2048 or (H <= 4096 and rows <= 64) else 8


# ----------------------------------------------------------------------------- PyTorch references
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (xn.float() * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = (x.float() + residual.float()).to(residual.dtype)
    return rms_norm_ref(s, weight, eps), s
