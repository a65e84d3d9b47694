"""SiLU-and-mul, the gate of a SwiGLU MLP (Shazeer, "GLU Variants Improve Transformer", 2020).

For an input row [g | u] of width 2·d (the fused gate_up projection):

    out = silu(g) * u,   silu(g) = g * sigmoid(g) = g / (1 + exp(-g))

sigmoid is written with ``exp`` (no libdevice call), so the kernel also runs under TRITON_INTERPRET=1.
Computed in float32; silu(g) is rounded to the storage dtype before the product, as the unfused model does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from strataserve.kernels._common import check, check_float, check_last_dim_contiguous, pdl_args, pdl_wait

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, D, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_stride + D + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., 2d] -> [..., d]."""
    check_float("x", x)
    check(x.dim() >= 1 and x.shape[-1] % 2 == 0, f"x: last dim must be even (gate|up), got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    d = x.shape[-1] // 2
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if out is None:
        out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    check(out.shape == (*x.shape[:-1], d) and out.dtype == x.dtype,
          f"out: expected shape {(*x.shape[:-1], d)} dtype {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    check_last_dim_contiguous("out", out)
    o2 = out if out.dim() == 2 else out.view(-1, d)
    if x2.shape[0]:
        grid = (x2.shape[0], triton.cdiv(d, _BLOCK))
        _silu_and_mul_kernel[grid](x2, o2, x2.stride(0), o2.stride(0), d, BLOCK=_BLOCK, num_warps=4,
                                   **pdl_args(x, x2.shape[0]))
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
