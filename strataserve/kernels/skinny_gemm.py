"""Matmul for the few rows of a decode step: y = x W^T (+ b), x [M, K] with M up to a few hundred, W [N, K].

At decode batch sizes the weight is read once per step and M is small, so the work is a stream over W with a
little arithmetic per byte. This kernel tiles (M, N) and optionally cuts K into ``split_k`` ranges so that every
SM streams a share of W; a split launch writes float32 partial sums that are added in a fixed order (deterministic,
unlike atomics), by a second launch or, given ``tickets``, by the last program of each tile.

Used by the runner for decode matmuls of 2-64 rows, per weight shape, where it measured faster than cuBLAS at
start-up (``runner/gemm_tuning.py``). Run 13 timed it alone per projection (``benchmarks/skinny_gemm_sweep.py``),
and it won only the down projection. Run 19 timed a whole step's matmuls in their order
(``benchmarks/skinny_chain_ab.py``). With the pipelined cp.async / wgmma loop, evict-first weight loads and the
first tiles prefetched to L2 before the PDL wait, it took gate_up, down and lm_head at the Llama-3.1-8B shape and
64 rows: 0.837 of the weights' floor against cuBLAS's 0.803; qkv and o stay cuBLAS (docs/gpu_notes.md, run 19).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strataserve import envs
from strataserve.kernels._common import (check, check_float, check_same_device, pdl_args, pdl_wait, prefetch_l2,
                                        sm_count)
from strataserve.kernels.activation import silu_and_mul_ref
from strataserve.kernels.gemv import gemv_ref


@triton.jit(do_not_specialize=["M"])  # one compile for every decode batch size (graph capture would compile each)
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, p_ptr, sem_ptr, M, N, K, x_sm, w_sn, y_sm, k_per_split,
                        splits, first_wave, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, COMBINE: tl.constexpr,
                        EVEN_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr, PDL: tl.constexpr,
                        PREFETCH: tl.constexpr, LINE: tl.constexpr, SILU: tl.constexpr = False):
    """Tile (pid1 rows, pid0 columns) over split pid2's K range. Not SPLIT: y (+ bias) in y's dtype. SPLIT:
    float32 partials into p_ptr [splits, M, N]; with COMBINE the tile's last program to finish adds them (an
    atomic ticket per tile in sem_ptr, left at zero), else ``_split_reduce_kernel`` does. PREFETCH (a PDL
    launch): the programs of the first wave send their first PREFETCH lines of each weight row to L2 before the
    wait, as the GEMV does (``gemv.py``). SILU (not SPLIT): W is [gate; up] with 2N rows, and the tile keeps two
    accumulators, gate rows n and up rows N + n over one x tile, for y = silu(gate) * up."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    split = tl.program_id(2)
    mmask = rm < M
    nmask = rn < N
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if PREFETCH:  # (weights: no kernel writes them, so before the wait is safe)
        pid = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * split)
        if pid < first_wave:
            lines = k_start + tl.arange(0, PREFETCH) * LINE
            pmask = nmask[:, None] & (lines[None, :] < k_end)
            prefetch_l2(w_ptr + rn.to(tl.int64)[:, None] * w_sn + lines[None, :], pmask)
            if SILU:
                prefetch_l2(w_ptr + (rn + N).to(tl.int64)[:, None] * w_sn + lines[None, :], pmask)
    pdl_wait(PDL)
    xp = x_ptr + rm.to(tl.int64)[:, None] * x_sm + (k_start + rk)[None, :]
    wp = w_ptr + rn.to(tl.int64)[None, :] * w_sn + (k_start + rk)[:, None]  # the [BLOCK_K, BLOCK_N] tile of W^T
    up_off = 0
    if SILU:
        up_off = N * w_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # SILU only (dead code otherwise)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            wmask = nmask[None, :]
            x = tl.load(xp, mask=mmask[:, None], other=0.0)
        else:
            kmask = (k0 + rk) < k_end
            wmask = nmask[None, :] & kmask[:, None]
            x = tl.load(xp, mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(wp, mask=wmask, other=0.0, eviction_policy=EVICT)
        acc = _dot(x, w, acc, IEEE)
        if SILU:
            acc_up = _dot(x, tl.load(wp + up_off, mask=wmask, other=0.0, eviction_policy=EVICT), acc_up, IEEE)
        xp += BLOCK_K
        wp += BLOCK_K
    omask = mmask[:, None] & nmask[None, :]
    if SILU:  # the unfused model's roundings: gate and up in y's dtype, silu(gate) rounded before the product
        dt = y_ptr.dtype.element_ty
        g = acc.to(dt).to(tl.float32)
        acc = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * acc_up.to(dt).to(tl.float32)
    if SPLIT:
        part = p_ptr + rm[:, None] * N + rn[None, :]
        tl.store(part + split * M * N, acc, mask=omask)
        if COMBINE:
            # every thread's stores before the ticket; acq_rel: the last program then sees all of them
            tl.debug_barrier()
            sem = sem_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
            if tl.atomic_add(sem, 1, sem="acq_rel") == splits - 1:
                tl.atomic_xchg(sem, 0)  # ready for the next launch (a graph replay reuses the tickets)
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in range(splits):  # a fixed order whichever program is last: deterministic
                    acc += tl.load(part + s * M * N, mask=omask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptr + rm.to(tl.int64)[:, None] * y_sm + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                         mask=omask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * y_sm + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr):
    if IEEE:  # float32 stays float32 (tl.dot's float32 default is tf32 on GPUs; see _common.dot)
        return tl.dot(x, w, acc, input_precision="ieee")
    return tl.dot(x, w, acc)


@triton.jit
def _split_reduce_kernel(p_ptr, b_ptr, y_ptr, M, N, y_sm, splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    """y[m, n] = sum over s of partial[s, m, n] (+ bias[n]), in a fixed order."""
    pdl_wait(PDL)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(splits):
        acc += tl.load(p_ptr + s * M * N + idx, mask=mask, other=0.0)
    col = idx % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + (idx // N) * y_sm + col, acc.to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GemmConfig:
    """A launch configuration; ``split_k`` > 1 cuts K into that many ranges (partials added after, see above)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    evict_first: bool = False  # stream W past L2 (read once per step), so x and the partials stay cached

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}/s{self.split_k}/w{self.num_warps}"
                f"/st{self.num_stages}" + ("/ef" if self.evict_first else ""))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemmConfig = GemmConfig(), tickets: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] times ``weight`` [N, K]^T (+ ``bias`` [N]) -> [M, N]; like ``F.linear`` on 2-D input.

    ``tickets``: int32 zeros with one per output tile, for a split launch to combine its partials itself (no
    reduce launch); every launch leaves them at zero, so a caller keeps one buffer for all its calls."""
    return _launch(x, weight, bias, config, tickets, silu=False)


def skinny_gemm_silu_mul(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig = GemmConfig()) -> torch.Tensor:
    """``silu_and_mul(x W^T)`` in one launch: ``weight`` is the fused [gate; up] projection [2I, K] -> [M, I].
    The SiLU-and-mul runs on the accumulators (with the unfused ops' roundings), so the [M, 2I] gate_up output is
    never written; ``config.split_k`` must be 1."""
    check(weight.dim() == 2 and weight.shape[0] % 2 == 0,
          f"weight: expected the [gate; up] rows [2I, K], got {tuple(weight.shape)}")
    check(config.split_k == 1, f"config: the SiLU epilogue runs unsplit, got split_k={config.split_k}")
    return _launch(x, weight, None, config, None, silu=True)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemmConfig,
            tickets: torch.Tensor | None, silu: bool) -> torch.Tensor:
    check_float("x", x)
    check(x.dim() == 2, f"x: expected [M, K], got {tuple(x.shape)}")
    check(weight.dim() == 2 and weight.shape[1] == x.shape[1],
          f"weight: expected [N, {x.shape[1]}], got {tuple(weight.shape)}")
    check(weight.stride(1) == 1 and x.stride(1) == 1, "x and weight: rows must be contiguous")
    check(weight.dtype == x.dtype, f"weight dtype {weight.dtype} differs from x's {x.dtype}")
    M, K = x.shape
    N = weight.shape[0] // 2 if silu else weight.shape[0]
    if bias is not None:
        check(bias.shape == (N,) and bias.is_contiguous(), f"bias: expected contiguous shape ({N},)")
    check_same_device(x=x, weight=weight)
    c = config
    check(c.split_k >= 1 and c.block_m >= 16 and c.block_n >= 16 and c.block_k >= 16, f"config: invalid {c}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    # each split gets a whole number of K tiles; the last may be shorter (or, rounding, absent: fewer splits)
    k_per_split = triton.cdiv(triton.cdiv(K, c.split_k), c.block_k) * c.block_k
    splits = triton.cdiv(K, k_per_split)
    b = bias if bias is not None else weight
    part = y if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, c.block_n), triton.cdiv(M, c.block_m), splits)
    combine = splits > 1 and tickets is not None
    if combine:
        check(tickets.dtype == torch.int32 and tickets.numel() >= grid[0] * grid[1] and tickets.device == x.device,
              f"tickets: expected int32 zeros on {x.device} with >= {grid[0] * grid[1]} elements")
    pdl = pdl_args(x, M)
    line = 128 // weight.element_size()  # elements per 128-byte line
    # lines of the first tiles in flight (num_stages - 1 ahead, plus the one consumed) to prefetch under PDL
    prefetch = triton.next_power_of_2(triton.cdiv(min(c.num_stages * c.block_k, k_per_split), line)) \
        if pdl["PDL"] and envs.STRATA_PDL_PREFETCH else 0
    _skinny_gemm_kernel[grid](x, weight, b, y, part, tickets if combine else part, M, N, K, x.stride(0),
                              weight.stride(0), y.stride(0), k_per_split, splits,
                              sm_count(x.device.index or 0) if prefetch else 0, HAS_BIAS=bias is not None,
                              SPLIT=splits > 1, COMBINE=combine, EVEN_K=K % c.block_k == 0,
                              IEEE=x.dtype == torch.float32, BLOCK_M=c.block_m,
                              BLOCK_N=c.block_n, BLOCK_K=c.block_k, EVICT="evict_first" if c.evict_first else "",
                              PREFETCH=prefetch, LINE=line, SILU=silu, num_warps=c.num_warps,
                              num_stages=c.num_stages, **pdl)
    if splits > 1 and not combine:
        block = 1024
        _split_reduce_kernel[(triton.cdiv(M * N, block),)](part, b, y, M, N, y.stride(0), splits,
                                                           HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
                                                           **pdl)
    return y


#: the reference: a float32 matmul (+ bias) cast to x's dtype, the one-row GEMV's, which takes any number of rows
skinny_gemm_ref = gemv_ref


def skinny_gemm_silu_mul_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The unfused ops: the matmul in x's dtype, then SiLU-and-mul."""
    return silu_and_mul_ref(skinny_gemm_ref(x, weight))
