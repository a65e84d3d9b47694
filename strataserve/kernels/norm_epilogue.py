"""The residual add + RMSNorm split across two matmuls of a decode step (``skinny_gemm``'s NORM modes), so the norm
needs no launch of its own.

A norm needs its row's sum of squares over every column, which no single tile of the matmul before it (o, down)
holds. So the producer matmul's epilogue adds the residual to its tile, stores the new residual, stores
``s * w`` (the norm weight applied, the row scale not yet known) and writes its rows' partial sums of squares,
one per column tile. The consumer matmul (qkv, gate_up) reads those partials after its PDL wait, adds them in a fixed
order (deterministic), and scales its accumulator by each row's ``1 / sqrt(mean + eps)`` at the end:
``(s * w * r) W^T = r * ((s * w) W^T)``. No kernel waits on another's programs (run 22's in-launch barrier did,
and cost more than the launch it saved).

Roundings: the residual sum in the tensor dtype, statistics in float32 from it (as ``fused_add_rms_norm``); then
``s * w`` is rounded once and the row scale applies to the float32 accumulator, where the unfused ops round
``s * r`` and then its product with w. Same precision, another order: the 16-bit path only.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def produce(acc, rm, rn, mmask, nmask, r_ptr, r_sm, nw_ptr, y_ptr, y_sm, ss_ptr, M):
    """s = round(round(acc) + residual) into the residual; y = round(s * w); the tile's rows' partial sums of
    squares of s into ``ss_ptr`` [column tiles, M] (row ``program_id(0)``)."""
    dt = r_ptr.dtype.element_ty
    omask = mmask[:, None] & nmask[None, :]
    rp = r_ptr + rm.to(tl.int64)[:, None] * r_sm + rn[None, :]
    r = tl.load(rp, mask=omask, other=0.0).to(tl.float32)
    s = (acc.to(dt).to(tl.float32) + r).to(dt)
    tl.store(rp, s, mask=omask)
    s = s.to(tl.float32)  # masked columns are 0 (their weight rows and residual loaded as 0)
    tl.store(ss_ptr + tl.program_id(0) * M + rm, tl.sum(s * s, axis=1), mask=mmask)
    w = tl.load(nw_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * y_sm + rn[None, :], (s * w[None, :]).to(dt), mask=omask)


@triton.jit
def load_partials(rm, mmask, ss_ptr, M, parts, NT: tl.constexpr):
    """The rows' ``parts`` partial sums of squares [NT, rows], one load issued before the K loop (their latency
    then overlaps the loop; run 22's first form, a chunked loop there, waited on each chunk in turn)."""
    t = tl.arange(0, NT)
    return tl.load(ss_ptr + t[:, None] * M + rm[None, :], mask=(t[:, None] < parts) & mmask[None, :], other=0.0)


@triton.jit
def row_scale(partials, width, eps):
    """Each row's ``1 / sqrt(sum of its partials / width + eps)``, the partials added in a fixed order."""
    return 1.0 / tl.sqrt(tl.sum(partials, axis=0) / width + eps)
