"""Matrix-vector product for single-token decode: y = W x (+ b), W [N, K] row-major, x [K].

At batch 1 a decode step is a chain of GEMVs whose time is the weight bytes over memory bandwidth; the kernel is
a plain stream over W: each program owns BLOCK_N rows, walks K in BLOCK_K tiles (each row segment a contiguous,
coalesced read), multiplies by the matching slice of x and accumulates in float32 in a [BLOCK_N, BLOCK_K] tile
that is reduced once at the end (no cross-thread reduction inside the loop). ``num_stages`` tiles are in flight
(cp.async; the loop is a ``tl.range`` that asks for it: run 17 found that a plain ``range`` left every load
waiting). (The standard memory-bound GEMV; see e.g. Williams, Waterman, Patterson, "Roofline", CACM 2009, for why
bytes, not FLOPs, set its time.)

Split-K: with few rows (e.g. a 4096 x 4096 projection) N / BLOCK_N programs are too few to keep every SM's
memory pipeline full for the whole kernel; ``split_k`` programs per row block each stream one K range and write
float32 partial sums that a second, tiny kernel adds in a fixed order. Which configuration (or cuBLAS) is fastest
depends on the shape and the GPU, so the runner measures the candidates once at start-up
(``runner/gemv_tuning.py``).

Prologues: the op before a projection can run inside its GEMV instead of as its own launch (at batch 1 each of
those ~2 us launches is latency, not bandwidth): ``gemv_rms_norm`` normalises x (after adding the residual, whose
sum it also writes out) on the fly, ``gemv_silu_mul`` takes the gate_up output and applies SiLU-and-mul per K
tile. Without split-K a program sees the whole x row in its own loop, so it sums the squares there and scales its
row sums by the inverse RMS at the end (the normalised x is not rounded to the storage dtype before the multiply,
as the separate kernel's output is: float32 models differ only in summation order). With split-K every program
first reads the whole row for the statistics (K values from L2), and the rounding follows the separate kernels
(``rms_norm.py``, ``activation.py``) step by step; so does SiLU-mul's always. Run 17: the pre-pass cost the fused
8B gate_up ~4 us of its ~54 (its programs' loops waited on it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strataserve import envs
from strataserve.kernels._common import (check, check_float, check_same_device, pdl_args, pdl_wait, prefetch_l2,
                                        sm_count)


NO_PROLOGUE, NORM, ADD_NORM, SILU_MUL = 0, 1, 2, 3
# the kernel's copies (a jitted function reads only constexpr globals)
_NORM, _ADD_NORM, _SILU_MUL = tl.constexpr(NORM), tl.constexpr(ADD_NORM), tl.constexpr(SILU_MUL)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, ro_ptr, N, K, w_sn, k_per_split, eps, first_wave,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
                 NORM_IN_LOOP: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr):
    """Rows [pid0 * BLOCK_N, +BLOCK_N) over the K range of split pid1. SPLIT == 1: write y (+ bias) directly;
    else write float32 partial sums to y_ptr [SPLIT, N] for ``_gemv_reduce_kernel``. PROLOGUE: the input is x
    (NO_PROLOGUE), rms_norm(x) * nw (NORM), rms_norm(x + r) * nw with x + r written to ro (ADD_NORM, by the
    programs of row block 0), or silu(x[:K]) * x[K:] (SILU_MUL). PREFETCH (a PDL launch): in the programs of the
    first wave (linear id < ``first_wave``, those placed while the previous kernel still runs) the first tiles of
    the program's rows go to L2 before the wait (one prefetch per LINE-element line); later waves start after the
    previous kernel has finished, where a prefetch only doubles the requests (run 18b: +2% on the 8B step)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rmask = rows < N
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if PREFETCH:  # (weights: no kernel writes them, so before the wait is safe)
        if tl.program_id(0) + split * tl.num_programs(0) < first_wave:
            lines = k_start + tl.arange(0, PREFETCH) * LINE
            prefetch_l2(w_ptr + rows.to(tl.int64)[:, None] * w_sn + lines[None, :],
                        rmask[:, None] & (lines[None, :] < k_end))
    pdl_wait(PDL)
    dt = w_ptr.dtype.element_ty
    # NORM_IN_LOOP (SPLIT == 1: this program sees all of K): the statistics accumulate in the main loop and the row
    # sums are scaled once at the end, y = inv * sum_k w_k x_k nw_k. Otherwise a pre-pass over the whole row first.
    sq = tl.zeros([BLOCK_K], tl.float32)
    if (PROLOGUE == _NORM or PROLOGUE == _ADD_NORM) and not NORM_IN_LOOP:
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            s = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            if PROLOGUE == _ADD_NORM:  # the sum is rounded to the storage dtype, as the residual stream is
                s = (s + tl.load(r_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
            sq += s * s
        inv = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    wrow = w_ptr + rows.to(tl.int64)[:, None] * w_sn
    # STAGES > 1: the loads of the next STAGES - 1 tiles are issued (cp.async into shared memory) before this one
    # is consumed. Triton pipelines a loop's plain loads only when the loop asks for it; without this each tile's
    # loads wait for the previous tile's multiply-adds.
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < k_end
        x = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if PROLOGUE == _NORM or PROLOGUE == _ADD_NORM:
            if PROLOGUE == _ADD_NORM:
                x = (x + tl.load(r_ptr + cols, mask=cmask, other=0.0).to(tl.float32)).to(dt)
                if tl.program_id(0) == 0:
                    tl.store(ro_ptr + cols, x, mask=cmask)
                x = x.to(tl.float32)
            nw = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            if NORM_IN_LOOP:
                sq += x * x
                x = x * nw
            else:
                x = ((x * inv).to(dt).to(tl.float32) * nw).to(dt).to(tl.float32)
        elif PROLOGUE == _SILU_MUL:
            u = tl.load(x_ptr + K + cols, mask=cmask, other=0.0).to(tl.float32)
            x = ((x / (1.0 + tl.exp(-x))).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
        w = tl.load(wrow + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0,
                    eviction_policy=EVICT).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if NORM_IN_LOOP:
        y = y * (1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps))
    if SPLIT == 1:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)
    else:
        tl.store(y_ptr + split * N + rows, y, mask=rmask)


@triton.jit
def _gemv_reduce_kernel(p_ptr, b_ptr, y_ptr, N, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y[n] = sum_s partial[s, n] (+ bias[n]), in a fixed order (deterministic, unlike atomics)."""
    pdl_wait(PDL)
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
    num_stages: int = 1  # K tiles in flight per program (1: each tile's loads wait for the previous tile's math)
    evict_first: bool = False  # stream W past L2 (read once), so x and the partials stay cached


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """``x`` [1, K] (or [K]) times ``weight`` [N, K]^T -> [1, N] (or [N]); like ``F.linear`` for one row."""
    _check_row(x)
    check(weight.dim() == 2 and weight.shape[1] == x.shape[-1],
          f"weight: expected [N, {x.shape[-1]}], got {tuple(weight.shape)}")
    return _launch(x, weight, bias, config, NO_PROLOGUE)


def gemv_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: GemvConfig = GemvConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear(rms_norm(x + residual) * norm_weight, weight, bias)`` for one row, in one launch.

    Returns ``(y, s)`` with ``s = x + residual`` (a new tensor; x and residual are left as they are), or
    ``s = x`` when ``residual`` is None (no add: the first layer)."""
    _check_row(x)
    check(weight.dim() == 2 and weight.shape[1] == x.shape[-1],
          f"weight: expected [N, {x.shape[-1]}], got {tuple(weight.shape)}")
    check(norm_weight.shape == (x.shape[-1],) and norm_weight.is_contiguous(),
          f"norm_weight: expected contiguous shape ({x.shape[-1]},), got {tuple(norm_weight.shape)}")
    check(norm_weight.dtype == x.dtype, f"norm_weight dtype {norm_weight.dtype} differs from x's {x.dtype}")
    check_same_device(x=x, norm_weight=norm_weight)
    if residual is None:
        return _launch(x, weight, bias, config, NORM, nw=norm_weight, eps=eps), x
    check(residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous(),
          f"residual: expected contiguous {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
    check_same_device(x=x, residual=residual)
    s = torch.empty_like(x)
    return _launch(x, weight, bias, config, ADD_NORM, r=residual, nw=norm_weight, ro=s, eps=eps), s


def gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """``linear(silu(gate) * up, weight, bias)`` for one row ``x`` = [gate | up] of width 2K, in one launch."""
    _check_row(x)
    check(x.shape[-1] % 2 == 0 and weight.dim() == 2 and weight.shape[1] == x.shape[-1] // 2,
          f"weight: expected [N, {x.shape[-1] // 2}] (half of x's [gate | up] width {x.shape[-1]}), got "
          f"{tuple(weight.shape)}")
    return _launch(x, weight, bias, config, SILU_MUL)


def _check_row(x: torch.Tensor) -> None:
    check_float("x", x)
    check(x.dim() in (1, 2) and (x.dim() == 1 or x.shape[0] == 1),
          f"x: expected [K] or [1, K], got {tuple(x.shape)}; use F.linear for more rows")
    check(x.stride(-1) == 1, "x: must be contiguous")


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, c: GemvConfig, prologue: int,
            r: torch.Tensor | None = None, nw: torch.Tensor | None = None, ro: torch.Tensor | None = None,
            eps: float = 0.0) -> torch.Tensor:
    check(weight.stride(1) == 1, "weight: rows must be contiguous")
    check(weight.dtype == x.dtype, f"weight dtype {weight.dtype} differs from x's {x.dtype}")
    N, K = weight.shape
    if bias is not None:
        check(bias.shape == (N,) and bias.is_contiguous(), f"bias: expected contiguous shape ({N},)")
    check_same_device(x=x, weight=weight)
    check(c.split_k >= 1 and c.block_n >= 1 and c.block_k >= 16, f"config: invalid {c}")
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    b = bias if bias is not None else weight
    split = max(1, min(c.split_k, triton.cdiv(K, c.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), c.block_k) * c.block_k
    out = y if split == 1 else torch.empty(split, N, dtype=torch.float32, device=x.device)
    pdl = pdl_args(x, 1)
    line = 128 // weight.element_size()  # elements per 128-byte line
    # lines of the first tiles (those in flight when the loop starts) to prefetch under PDL; 0 = none
    prefetch = triton.next_power_of_2(triton.cdiv(min(c.num_stages * c.block_k, k_per_split), line)) \
        if pdl["PDL"] and envs.STRATA_PDL_PREFETCH else 0
    _gemv_kernel[(triton.cdiv(N, c.block_n), split)](
        x, weight, b, out, x if r is None else r, x if nw is None else nw, x if ro is None else ro, N, K,
        weight.stride(0), k_per_split, eps, sm_count(x.device.index or 0) if prefetch else 0,
        HAS_BIAS=bias is not None, SPLIT=split, PROLOGUE=prologue,
        BLOCK_N=c.block_n, BLOCK_K=c.block_k, EVICT="evict_first" if c.evict_first else "", STAGES=c.num_stages,
        NORM_IN_LOOP=prologue in (NORM, ADD_NORM) and split == 1, PREFETCH=prefetch, LINE=line,
        num_warps=c.num_warps, num_stages=c.num_stages, **pdl)
    if split > 1:
        _gemv_reduce_kernel[(triton.cdiv(N, 1024),)](out, b, y, N, HAS_BIAS=bias is not None, SPLIT=split,
                                                     BLOCK=1024, num_warps=4, **pdl)
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
