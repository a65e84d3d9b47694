"""Matrix-vector product for single-token decode: y = W x (+ b), W [N, K] row-major, x [K].

At batch 1 a decode step is a chain of GEMVs whose time is the weight bytes over memory bandwidth; the kernel is
a plain stream over W: each program owns BLOCK_N rows, walks K in BLOCK_K tiles (each row segment a contiguous,
coalesced read), multiplies by the matching slice of x and accumulates in float32 in a [BLOCK_N, BLOCK_K] tile
that is reduced once at the end (no cross-thread reduction inside the loop). Triton's software pipelining keeps
several tiles in flight. (The standard memory-bound GEMV; see e.g. Williams, Waterman, Patterson, "Roofline",
CACM 2009, for why bytes, not FLOPs, set its time.)

Split-K: with few rows (e.g. a 4096 x 4096 projection) N / BLOCK_N programs are too few to keep every SM's
memory pipeline full for the whole kernel; ``split_k`` programs per row block each stream one K range and write
float32 partial sums that a second, tiny kernel adds in a fixed order. Which configuration (or cuBLAS) is fastest
depends on the shape and the GPU, so the runner measures the candidates once at start-up
(``runner/gemv_tuning.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strataserve.kernels._common import check, check_float, check_same_device


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, w_sn, k_per_split, HAS_BIAS: tl.constexpr,
                 SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [pid0 * BLOCK_N, +BLOCK_N) over the K range of split pid1. SPLIT == 1: write y (+ bias) directly;
    else write float32 partial sums to y_ptr [SPLIT, N] for ``_gemv_reduce_kernel``."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rmask = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    wrow = w_ptr + rows.to(tl.int64)[:, None] * w_sn
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < k_end
        x = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        w = tl.load(wrow + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if SPLIT == 1:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)
    else:
        tl.store(y_ptr + split * N + rows, y, mask=rmask)


@triton.jit
def _gemv_reduce_kernel(p_ptr, b_ptr, y_ptr, N, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                        BLOCK: tl.constexpr):
    """y[n] = sum_s partial[s, n] (+ bias[n]), in a fixed order (deterministic, unlike atomics)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < N
    y = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        y += tl.load(p_ptr + s * N + rows, mask=rmask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


@dataclass(frozen=True)
class GemvConfig:
    """A launch configuration; ``split_k`` > 1 cuts K into that many ranges (more programs for small N) and adds
    a reduce launch."""

    block_n: int = 16
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig = GemvConfig()) -> torch.Tensor:
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
    c = config
    check(c.split_k >= 1 and c.block_n >= 1 and c.block_k >= 16, f"config: invalid {c}")
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    b = bias if bias is not None else weight
    split = max(1, min(c.split_k, triton.cdiv(K, c.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), c.block_k) * c.block_k
    out = y if split == 1 else torch.empty(split, N, dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(N, c.block_n), split)](
        x, weight, b, out, N, K, weight.stride(0), k_per_split, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
    if split > 1:
        _gemv_reduce_kernel[(triton.cdiv(N, 1024),)](out, b, y, N, HAS_BIAS=bias is not None, SPLIT=split,
                                                     BLOCK=1024, num_warps=4)
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
