"""The few-rows matmul as a stream-K launch: one program per SM share, each streaming an equal run of K tiles.

Why: at decode batch sizes a projection is a stream over its weight, and the tile grid of ``skinny_gemm`` fills
the GPU in whole waves only. At the Llama-3.1-8B shape and 64 rows, qkv has 96 64-column tiles for 132 SMs (a
quarter of them idle for the whole kernel) and down 64 (half idle, or a split launch of 1.5 waves); run 20's probe
found each such launch 4-6 us over its weight bytes. Here the (tile, K tile) iterations are laid end to end and
cut into equal runs, one per program (Osama et al., "Stream-K: Work-centric Parallel Decomposition for Dense
Matrix-Matrix Multiplication on the GPU", PPoPP 2023), so every SM streams the same number of weight bytes. A run
that covers a whole output tile writes it; a tile shared by several runs is combined by the last of them to finish
(an atomic ticket per tile, as the split launch's in-kernel combine), which adds the runs' float32 partials in
run order: deterministic, whichever program comes last.

Each program keeps two partial slots (its first tile and its last tile are the only ones it can share), so the
workspace is ``programs x 2`` float32 tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strataserve.kernels._common import dot_acc, pdl_wait, prefetch_l2

#: programs per SM on the CPU interpreter, where there are no SMs: a small count, so tests see runs that share tiles
INTERPRETER_SMS = 3


@triton.jit(do_not_specialize=["M"])
def _stream_k_kernel(x_ptr, w_ptr, b_ptr, y_ptr, p_ptr, sem_ptr, M, N, K, x_sm, w_sn, y_sm, tiles_n, ipt, per,
                     total, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
                     PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr):
    """Program pid runs iterations [pid * per, +per) of ``total`` = tiles x ``ipt`` (K tiles per output tile);
    tile t is (t // tiles_n, t % tiles_n) in (row block, column block). PREFETCH (a PDL launch): the first lines
    of the run's first weight tile go to L2 before the wait."""
    pid = tl.program_id(0)
    start = pid * per
    end = tl.minimum(start + per, total)
    first_tile = start // ipt
    last_tile = (end - 1) // ipt
    rk = tl.arange(0, BLOCK_K)
    if PREFETCH:  # (weights: no kernel writes them, so before the wait is safe)
        rn0 = (first_tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        lines = (start - first_tile * ipt) * BLOCK_K + tl.arange(0, PREFETCH) * LINE
        prefetch_l2(w_ptr + rn0.to(tl.int64)[:, None] * w_sn + lines[None, :],
                    (rn0 < N)[:, None] & (lines[None, :] < K))
    pdl_wait(PDL)
    tile_off = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    for tile in range(first_tile, last_tile + 1):
        kb = tl.maximum(start - tile * ipt, 0)
        ke = tl.minimum(end - tile * ipt, ipt)
        tm = tile // tiles_n
        rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile - tm * tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask = rm < M
        nmask = rn < N
        xp = x_ptr + rm.to(tl.int64)[:, None] * x_sm + (kb * BLOCK_K + rk)[None, :]
        wp = w_ptr + rn.to(tl.int64)[None, :] * w_sn + (kb * BLOCK_K + rk)[:, None]  # [BLOCK_K, BLOCK_N] of W^T
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kk in tl.range(kb, ke, num_stages=STAGES):
            if EVEN_K:
                x = tl.load(xp, mask=mmask[:, None], other=0.0)
                w = tl.load(wp, mask=nmask[None, :], other=0.0, eviction_policy=EVICT)
            else:
                kmask = (kk * BLOCK_K + rk) < K
                x = tl.load(xp, mask=mmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(wp, mask=nmask[None, :] & kmask[:, None], other=0.0, eviction_policy=EVICT)
            acc = dot_acc(x, w, acc, IEEE)
            xp += BLOCK_K
            wp += BLOCK_K
        omask = mmask[:, None] & nmask[None, :]
        out = y_ptr + rm.to(tl.int64)[:, None] * y_sm + rn[None, :]
        if (kb == 0) & (ke == ipt):  # the whole tile is this run's
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=omask)
        else:
            slot = (tile != first_tile).to(tl.int32)  # 0: the run's first tile, 1: its last
            tl.store(p_ptr + (pid * 2 + slot) * (BLOCK_M * BLOCK_N) + tile_off, acc)
            # every thread's stores before the ticket; acq_rel: the last program then sees all runs' partials
            tl.debug_barrier()
            q0 = (tile * ipt) // per  # the runs that share this tile
            q1 = ((tile + 1) * ipt - 1) // per
            sem = sem_ptr + tile
            if tl.atomic_add(sem, 1, sem="acq_rel") == q1 - q0:
                tl.atomic_xchg(sem, 0)  # ready for the next launch (a graph replay reuses the tickets)
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for q in range(q0, q1 + 1):  # run order, whichever program is last: deterministic
                    qslot = ((q * per) // ipt != tile).to(tl.int32)
                    acc += tl.load(p_ptr + (q * 2 + qslot) * (BLOCK_M * BLOCK_N) + tile_off, cache_modifier=".cg")
                if HAS_BIAS:
                    acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
                tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=omask)


def stream_k_programs(total: int, sms: int, per_sm: int) -> tuple[int, int]:
    """(programs, iterations per program) for ``total`` iterations over ``sms`` x ``per_sm`` programs at most:
    equal runs (the last may be shorter), none empty."""
    per = triton.cdiv(total, max(1, min(total, sms * per_sm)))
    return triton.cdiv(total, per), per


def launch_stream_k(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                    tickets: torch.Tensor, sms: int, c, pdl: dict, prefetch_lines: int, line: int) -> None:
    """y = x W^T (+ bias) by stream-K over ``sms`` x ``c.stream_k`` programs (``c``: a ``GemmConfig``); the
    checks are the caller's (``skinny_gemm``), and ``tickets`` holds a zero per output tile (left at zero)."""
    M, K = x.shape
    N = weight.shape[0]
    tiles_n = triton.cdiv(N, c.block_n)
    ipt = triton.cdiv(K, c.block_k)
    total = triton.cdiv(M, c.block_m) * tiles_n * ipt
    programs, per = stream_k_programs(total, sms, c.stream_k)
    part = torch.empty(programs * 2 * c.block_m * c.block_n, dtype=torch.float32, device=x.device)
    _stream_k_kernel[(programs,)](x, weight, bias if bias is not None else weight, y, part, tickets, M, N, K,
                                  x.stride(0), weight.stride(0), y.stride(0), tiles_n, ipt, per, total,
                                  HAS_BIAS=bias is not None, EVEN_K=K % c.block_k == 0,
                                  IEEE=x.dtype == torch.float32, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                                  BLOCK_K=c.block_k, EVICT="evict_first" if c.evict_first else "",
                                  STAGES=c.num_stages, PREFETCH=prefetch_lines, LINE=line, num_warps=c.num_warps,
                                  num_stages=c.num_stages, **pdl)
