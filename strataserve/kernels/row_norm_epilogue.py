"""The residual add + RMSNorm as a matmul's epilogue (``skinny_gemm.skinny_gemm_add_rms_norm``), and the barrier
that lets one launch do it.

At decode batch sizes (2-64 rows at the Llama-3.1-8B shape) each layer ran the o projection, then the add +
RMSNorm as its own launch, and the same after down. A norm needs its row's sum of squares over every column, but
a matmul tile holds only BLOCK_N of them. So each program adds the residual to its tile, stores the new residual
and writes its rows' partial sums of squares; then the programs of a row block wait for each other
(``grid_barrier``) and each normalises its own tile, still in registers, from the sum of all partials (added in a
fixed order: deterministic). The barrier needs every program of the launch resident at once, so the wrapper uses
it only for grids of at most one program per SM. Without it (larger grids, Triton's interpreter, which runs the
programs one after another) ``_finish_kernel`` does the normalisation as a second launch.

Roundings are the unfused ops' (``rms_norm.fused_add_rms_norm``): the matmul output and the sum in the tensor
dtype, statistics in float32, the normalised value rounded before the weight.
"""
from __future__ import annotations

import triton
import triton.language as tl

from strataserve.kernels._common import pdl_wait


@triton.jit
def grid_barrier(bar_ptr, arrivals):
    """Wait until ``arrivals`` programs sharing ``bar_ptr`` (int32 [count, generation], count zero between
    launches) have arrived. A sense-reversing barrier: the last to arrive resets the count and bumps the
    generation the others spin on; stores before it are visible after it (release / acquire at GPU scope)."""
    gen_ptr = bar_ptr + 1
    g0 = tl.atomic_add(gen_ptr, 0, sem="acquire")  # read before arriving: it cannot move until everyone has
    tl.debug_barrier()  # every thread's stores before the arrival
    if tl.atomic_add(bar_ptr, 1, sem="acq_rel") == arrivals - 1:
        tl.atomic_xchg(bar_ptr, 0)
        tl.atomic_add(gen_ptr, 1, sem="release")
    else:
        while tl.atomic_add(gen_ptr, 0, sem="acquire") == g0:
            pass
    tl.debug_barrier()


@triton.jit
def add_residual(acc, rm, rn, mmask, nmask, r_ptr, r_sm, ss_ptr, M):
    """s = round(round(acc) + residual) stored as the new residual; the tile's rows' partial sums of squares into
    ``ss_ptr`` [column tiles, M] (row ``program_id(0)``). Returns s in float32."""
    dt = r_ptr.dtype.element_ty
    omask = mmask[:, None] & nmask[None, :]
    rp = r_ptr + rm.to(tl.int64)[:, None] * r_sm + rn[None, :]
    r = tl.load(rp, mask=omask, other=0.0).to(tl.float32)
    s = (acc.to(dt).to(tl.float32) + r).to(dt)
    tl.store(rp, s, mask=omask)
    s = s.to(tl.float32)  # masked columns are 0 (their weight rows and residual loaded as 0)
    tl.store(ss_ptr + tl.program_id(0) * M + rm, tl.sum(s * s, axis=1), mask=mmask)
    return s


@triton.jit
def norm_tile(s, rm, rn, mmask, nmask, nw_ptr, y_ptr, y_sm, ss_ptr, M, N, eps, n_tiles, NT: tl.constexpr):
    """y = round(round(s * rstd) * w) for the tile, rstd from the sum of the row's ``n_tiles`` partials."""
    t = tl.arange(0, NT)
    parts = tl.load(ss_ptr + t[:, None] * M + rm[None, :], mask=(t[:, None] < n_tiles) & mmask[None, :], other=0.0,
                    cache_modifier=".cg")  # other programs wrote them: from L2, not a stale L1 line
    inv = 1.0 / tl.sqrt(tl.sum(parts, axis=0) / N + eps)
    dt = y_ptr.dtype.element_ty
    w = tl.load(nw_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    sn = (s * inv[:, None]).to(dt).to(tl.float32)
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * y_sm + rn[None, :], (sn * w[None, :]).to(dt),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _finish_kernel(r_ptr, nw_ptr, y_ptr, ss_ptr, M, N, r_sm, y_sm, eps, n_tiles, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, NT: tl.constexpr, PDL: tl.constexpr):
    """The two-launch form's second launch: normalise each tile of the stored residual sum."""
    pdl_wait(PDL)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    s = tl.load(r_ptr + rm.to(tl.int64)[:, None] * r_sm + rn[None, :], mask=mmask[:, None] & nmask[None, :],
                other=0.0).to(tl.float32)
    norm_tile(s, rm, rn, mmask, nmask, nw_ptr, y_ptr, y_sm, ss_ptr, M, N, eps, n_tiles, NT)


def finish(residual, norm_weight, y, partials, eps: float, block_m: int, block_n: int, pdl: dict) -> None:
    M, N = y.shape
    n_tiles = triton.cdiv(N, block_n)
    _finish_kernel[(n_tiles, triton.cdiv(M, block_m))](residual, norm_weight, y, partials, M, N, residual.stride(0),
                                                      y.stride(0), eps, n_tiles, BLOCK_M=block_m, BLOCK_N=block_n,
                                                      NT=triton.next_power_of_2(n_tiles), num_warps=4, **pdl)
