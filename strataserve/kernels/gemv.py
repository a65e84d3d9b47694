"""Matrix-vector product for single-token decode: y = W x (+ b), W [N, K] row-major, x [K].

At batch 1 a decode step is a chain of GEMVs whose time is the weight bytes over memory bandwidth; the kernel is
a plain stream over W: each program owns BLOCK_N rows, walks K in BLOCK_K tiles (each row segment a contiguous,
coalesced read), multiplies by the matching slice of x and accumulates in float32 in a [BLOCK_N, BLOCK_K] tile
that is reduced once at the end (no cross-thread reduction inside the loop). Triton's software pipelining keeps
several tiles in flight. (The standard memory-bound GEMV; see e.g. Williams, Waterman, Patterson, "Roofline",
CACM 2009, for why bytes, not FLOPs, set its time.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strataserve.kernels._common import check, check_float, check_same_device


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, w_sn, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    wrow = w_ptr + rows.to(tl.int64)[:, None] * w_sn
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < K
        x = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        w = tl.load(wrow + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = 16,
         block_k: int = 512, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """``x`` [1, K] (or [K]) times ``weight`` [N, K]^T -> [1, N] (or [N]); like ``F.linear`` for one row."""
    check_float("x", x)
    check(x.dim() in (1, 2) and (x.dim() == 1 or x.shape[0] == 1),
          f"x: expected [K] or [1, K], got {tuple(x.shape)}; use F.linear for more rows")
    check(weight.dim() == 2 and weight.shape[1] == x.shape[-1],
          f"weight: expected [N, {x.shape[-1]}], got {tuple(weight.shape)}")
    check(weight.stride(1) == 1, "weight: rows must be contiguous")
    check(x.stride(-1) == 1, "x: must be contiguous")
    check(weight.dtype == x.dtype, f"weight dtype {weight.dtype} differs from x's {x.dtype}")
    N, K = weight.shape
    if bias is not None:
        check(bias.shape == (N,) and bias.is_contiguous(), f"bias: expected contiguous shape ({N},)")
    check_same_device(x=x, weight=weight)
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, weight, bias if bias is not None else weight, y, N, K,
                                             weight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n,
                                             BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
