"""Per-row log-prob statistics of the logits in one read of each row: the log-sum-exp, the chosen token's log-prob
and rank, and the top-n tokens with their log-probs, as ``torch.log_softmax`` + gather + rank count + argmax / topk
give them.

Why a kernel: the sampler's logprobs (``runner/sampler.py: token_logprobs_deferred``) ran ``log_softmax`` over the
full float32 [rows, V] logits (a full copy written), a gather, ``(lps > chosen_lp).sum(-1)`` (a bool tensor of the
full size, then a reduction) and ``lps.topk``: ~8-10 passes over 155 MB per step at 256 x 151,936 (nano-vllm's
workload ran at 0.64-0.74 of greedy with ``logprobs=1`` on the H200). Here each row is read once.

How (argmax.py's chunked two-launch design): one program per (row, BLOCK-wide chunk) keeps the chunk's max, its sum
of exp(x - max), the count of values > x[chosen] (the chosen value is loaded once per program) and the chunk's
argmax; one program per row then combines the chunks (an online log-sum-exp: sum_c s_c * exp(m_c - M)). For top-n
> 1 each chunk program also takes its n largest values out one by one in registers (the row's top n lie among its
chunks' top n) and the row program merges those few candidates the same way: no sort, no second read of the row.

Ranks come from the raw values: log_softmax(x) = x - lse is monotone in x, so "log-prob > the chosen one's" is
"x > x[chosen]". Counting on raw values is exact; torch's count on the rounded log-probs may merge two values closer
than one log-prob ulp (rare: none in 256 rows of random ids over 151,936 entries; never at the argmax). Log-probs
are (x - max) - log(sum exp(x - max)), torch's order of operations; the top-n ids equal torch.topk's where values
are distinct (equal values come by index here, in no set order there).

Rows that hold a NaN or a +inf entry (log_softmax is NaN across them) and rows of all -inf (likewise NaN) give NaN
log-probs (chosen and top) and rank 1, as the torch path does (NaN compares false); their lse is
``torch.logsumexp``'s (NaN with a NaN, else +inf with a +inf, -inf for all -inf); their top-1 id (top_n = 1) is
``torch.argmax``'s (the first NaN, else the first maximum), while top_n > 1 skips NaN entries (torch.topk puts them
first).
A chosen id outside [0, V) gives a NaN log-prob and rank 1 (the torch path's gather would fault instead).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strataserve.kernels._common import check, check_float, check_index, check_same_device

_BIG = tl.constexpr(2**31 - 1)  # (a jitted function reads only constexpr globals)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _chunk_stats_kernel(x_ptr, rows_ptr, chosen_ptr, pm_ptr, ps_ptr, pc_ptr, pi_ptr, cv_ptr, ci_ptr, V, x_sr, chunks,
                        HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, TOPK: tl.constexpr):
    """Chunk pid1 of output row pid0: max (NaN if the chunk holds one), sum of exp(x - max), count of x > x[chosen],
    first index of the max (of the first NaN); with TOPK > 1 also the chunk's TOPK largest values (NaN skipped) and
    their indices, largest first, ties by index (a short chunk pads with index _BIG)."""
    out_row, chunk = tl.program_id(0), tl.program_id(1)
    row = tl.load(rows_ptr + out_row) if HAS_ROWS else out_row
    base = x_ptr + row.to(tl.int64) * x_sr
    ch = tl.load(chosen_ptr + out_row)
    ok = (ch >= 0) & (ch < V)
    c = tl.load(base + tl.where(ok, ch, 0), mask=ok, other=float("nan")).to(tl.float32)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32)
    nan = x != x
    xs = tl.where(nan, float("-inf"), x)
    m = tl.max(xs, axis=0)
    # exp2 of (x - m) * log2(e); a chunk of all -inf has nothing to sum (and -inf - -inf would be NaN)
    s = tl.where(m > float("-inf"), tl.sum(tl.exp2((xs - m) * _LOG2E), axis=0), 0.0)
    cnt = tl.sum((x > c).to(tl.int32), axis=0)  # NaN entries and a NaN c compare false
    idx = tl.min(tl.where(xs == m, offs, _BIG), axis=0)
    first_nan = tl.min(tl.where(nan, offs, _BIG), axis=0)
    has_nan = first_nan < _BIG
    p = out_row * chunks + chunk
    tl.store(pm_ptr + p, tl.where(has_nan, float("nan"), m))
    tl.store(ps_ptr + p, s)
    tl.store(pc_ptr + p, cnt)
    tl.store(pi_ptr + p, tl.where(has_nan, first_nan, idx))
    if TOPK > 1:  # the row's top TOPK lie among its chunks' top TOPK: take them out one by one, in registers
        left = inside
        for k in tl.static_range(TOPK):
            mk = tl.max(tl.where(left, xs, float("-inf")), axis=0)
            ik = tl.min(tl.where(left & (xs == mk), offs, _BIG), axis=0)
            tl.store(cv_ptr + p * TOPK + k, mk)
            tl.store(ci_ptr + p * TOPK + k, ik)
            left = left & (offs != ik)


@triton.jit
def _row_stats_kernel(x_ptr, rows_ptr, chosen_ptr, pm_ptr, ps_ptr, pc_ptr, pi_ptr, cv_ptr, ci_ptr, lse_ptr, clp_ptr,
                      rank_ptr, tid_ptr, tlp_ptr, V, x_sr, chunks, HAS_ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
                      TOPK: tl.constexpr, BLOCK_CK: tl.constexpr):
    """Row pid0 from its chunks: lse = M + log(sum_c s_c exp(m_c - M)); log-probs as (x - M) - log(S), torch's
    order of operations; rank = 1 + the chunks' counts; the top TOPK from the chunks' candidates (TOPK > 1) or the
    argmax (TOPK = 1)."""
    out_row = tl.program_id(0)
    row = tl.load(rows_ptr + out_row) if HAS_ROWS else out_row
    ch = tl.load(chosen_ptr + out_row)
    ok = (ch >= 0) & (ch < V)
    c = tl.load(x_ptr + row.to(tl.int64) * x_sr + tl.where(ok, ch, 0), mask=ok, other=float("nan")).to(tl.float32)
    offs = tl.arange(0, BLOCK_C)
    cmask = offs < chunks
    p = out_row * chunks + offs
    pm = tl.load(pm_ptr + p, mask=cmask, other=float("-inf"))
    ps = tl.load(ps_ptr + p, mask=cmask, other=0.0)
    pc = tl.load(pc_ptr + p, mask=cmask, other=0)
    pi = tl.load(pi_ptr + p, mask=cmask, other=_BIG)
    nan = (pm != pm) & cmask
    mv = tl.where(nan, float("-inf"), pm)
    M = tl.max(mv, axis=0)
    S = tl.sum(tl.where(mv > float("-inf"), ps * tl.exp2((mv - M) * _LOG2E), 0.0), axis=0)
    log_s = tl.log2(S) * _LN2  # -inf for an all -inf row: lse -inf, log-probs (-inf - -inf) - -inf = NaN
    first_nan = tl.min(tl.where(nan, pi, _BIG), axis=0)
    has_nan = first_nan < _BIG
    bad = has_nan | (M == float("inf"))  # log_softmax is NaN across the row
    lse = tl.where(has_nan, float("nan"), tl.where(M == float("inf"), M, M + log_s))  # (torch.logsumexp's)
    clp = tl.where(bad, float("nan"), (c - M) - log_s)
    rank = tl.where(bad | (c != c), 1, tl.sum(pc, axis=0) + 1)
    tl.store(lse_ptr + out_row, lse)
    tl.store(clp_ptr + out_row, clp)
    tl.store(rank_ptr + out_row, rank.to(tl.int64))
    if TOPK > 1:  # merge the chunks' candidates the same way: largest first, ties by index, padding never taken
        q = tl.arange(0, BLOCK_CK)
        cand = out_row * chunks * TOPK + q
        qmask = q < chunks * TOPK
        cv = tl.load(cv_ptr + cand, mask=qmask, other=float("-inf"))
        ci = tl.load(ci_ptr + cand, mask=qmask, other=_BIG)
        left = qmask & (ci < _BIG)
        for k in tl.static_range(TOPK):
            mk = tl.max(tl.where(left, cv, float("-inf")), axis=0)
            ik = tl.min(tl.where(left & (cv == mk), ci, _BIG), axis=0)
            tl.store(tid_ptr + out_row * TOPK + k, ik.to(tl.int64))
            tl.store(tlp_ptr + out_row * TOPK + k, tl.where(bad, float("nan"), (mk - M) - log_s))
            left = left & (ci != ik)
    else:
        best = tl.min(tl.where((mv == M) & cmask, pi, _BIG), axis=0)
        tl.store(tid_ptr + out_row, tl.where(has_nan, first_nan, best).to(tl.int64))
        tl.store(tlp_ptr + out_row, tl.where(bad, float("nan"), (M - M) - log_s))


#: the most top log-probs one launch finds (MAX_LOGPROBS is 20); the count is rounded up to a multiple of 4 (one
#: compiled variant per bucket, not per count) and the extra columns are cut off
MAX_TOP_N = 32


def row_logprob_stats(x: torch.Tensor, chosen: torch.Tensor, rows: torch.Tensor | None = None, top_n: int = 1,
                      block: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [B, V] float (any row stride, last dim contiguous), ``chosen`` int [R] token ids, ``rows`` (optional)
    int [R]: the row of ``x`` each output describes (default: R = B, row i), so a subset needs no gathered copy.

    Returns per output row ``(lse, chosen_lp, rank, top_ids, top_lps)``: float32 / int64 [R] log-sum-exp of the row,
    log_softmax at ``chosen``, 1 + the number of log-probs strictly above it; int64 / float32 [R, top_n] the
    ``top_n`` (1..MAX_TOP_N, at most V) most likely tokens, largest first, equal values by index, and their
    log-probs. Column 0 is the argmax (``torch.argmax``'s index; with top_n > 1 NaN entries are skipped, see the
    module docstring for NaN / inf rows). No host sync."""
    check_float("x", x)
    check(x.dim() == 2 and x.shape[1] > 0, f"x: expected [B, V] with V > 0, got {tuple(x.shape)}")
    check(x.stride(1) == 1 or x.shape[1] == 1, "x: the last dimension must be contiguous; call .contiguous()")
    check_index("chosen", chosen)
    check(chosen.dim() == 1, f"chosen: expected [R], got {tuple(chosen.shape)}")
    if rows is None:
        check(chosen.shape[0] == x.shape[0], f"chosen: expected {x.shape[0]} ids (one per row of x), "
                                             f"got {chosen.shape[0]}")
    else:
        check_index("rows", rows)
        check(rows.shape == chosen.shape, f"rows: expected the shape of chosen {tuple(chosen.shape)}, "
                                          f"got {tuple(rows.shape)}")
        check_same_device(x=x, rows=rows)
    check_same_device(x=x, chosen=chosen)
    R, V = chosen.shape[0], x.shape[1]
    check(1 <= top_n <= min(MAX_TOP_N, V), f"top_n: expected 1..{min(MAX_TOP_N, V)}, got {top_n}")
    check(block >= 16 and block & (block - 1) == 0, f"block: expected a power of two >= 16, got {block}")
    chunks = triton.cdiv(V, block)
    check(chunks <= 4096, f"x: a row of {V} needs {chunks} chunks of {block}; use a larger block")
    topk = 1 if top_n == 1 else 2 if top_n == 2 else -(-top_n // 4) * 4
    dev = x.device
    lse = torch.empty(R, dtype=torch.float32, device=dev)
    clp = torch.empty(R, dtype=torch.float32, device=dev)
    rank = torch.empty(R, dtype=torch.int64, device=dev)
    tid = torch.empty(R, topk, dtype=torch.int64, device=dev)
    tlp = torch.empty(R, topk, dtype=torch.float32, device=dev)
    if R == 0:
        return lse, clp, rank, tid[:, :top_n], tlp[:, :top_n]
    pm = torch.empty(R, chunks, dtype=torch.float32, device=dev)
    ps = torch.empty(R, chunks, dtype=torch.float32, device=dev)
    pc = torch.empty(R, chunks, dtype=torch.int32, device=dev)
    pi = torch.empty(R, chunks, dtype=torch.int32, device=dev)
    cv = torch.empty(R, chunks, topk, dtype=torch.float32, device=dev) if topk > 1 else pm  # (unused at 1)
    ci = torch.empty(R, chunks, topk, dtype=torch.int32, device=dev) if topk > 1 else pi
    has_rows = rows is not None
    rows_arg = rows if has_rows else chosen  # (never read without HAS_ROWS)
    _chunk_stats_kernel[(R, chunks)](x, rows_arg, chosen, pm, ps, pc, pi, cv, ci, V, x.stride(0), chunks,
                                     HAS_ROWS=has_rows, BLOCK=block, TOPK=topk, num_warps=8)
    _row_stats_kernel[(R,)](x, rows_arg, chosen, pm, ps, pc, pi, cv, ci, lse, clp, rank, tid, tlp, V, x.stride(0),
                            chunks, HAS_ROWS=has_rows, BLOCK_C=max(16, triton.next_power_of_2(chunks)), TOPK=topk,
                            BLOCK_CK=max(16, triton.next_power_of_2(chunks * topk)), num_warps=4 if topk > 1 else 1)
    return lse, clp, rank, tid[:, :top_n], tlp[:, :top_n]


def row_logprob_stats_ref(x: torch.Tensor, chosen: torch.Tensor, top_n: int = 1
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain PyTorch statistics (the torch path's): log_softmax, gather, rank count, argmax / topk."""
    lps = torch.log_softmax(x.float(), dim=-1)
    clp = lps.gather(1, chosen.long().unsqueeze(1))
    rank = (lps > clp).sum(dim=-1) + 1
    tid = x.argmax(dim=-1, keepdim=True) if top_n == 1 else x.topk(top_n, dim=-1).indices
    return torch.logsumexp(x.float(), dim=-1), clp.squeeze(1), rank, tid, lps.gather(1, tid)
