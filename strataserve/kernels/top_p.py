"""Each row's top-p cut-off logit without sorting the row: the value ``runner/sampling_filters.py``'s ``_cutoff``
finds from a full descending sort (keep sorted index j while the mass before j is < p), so that
``x.masked_fill_(x < cut, -inf)`` keeps the same tokens (ties at the cut-off kept).

Why: the sampler's accelerator path sorted every row every step (256 x 151,936 float32 logits at the Qwen3-0.6B
shape), which made top-p the costliest sampling setting (0.63-0.65 of greedy throughput on the H200, run 30).

How (one program per row, no host sync, one launch): with probs = exp(x - lse), let M(t) be the mass of the logits
whose order-preserving int32 key is > t. M only falls as t rises and changes only at keys present in the row, so the
cut-off is the smallest key t with M(t) < p, and a search over keys finds it exactly. Pass 0 reads the row for its
max, log-sum-exp and smallest values. Each further pass splits the bracket (lo, hi] that holds the answer
(M(lo) >= p > M(hi)) at S thresholds (evenly in value; evenly in key after a value split that did not halve the
bracket's count: ulp-close values, values over many binades), sums M at all of them in one read, narrows the bracket
to the logits it holds, and copies those logits to a per-row buffer (at most CAP). Once the bracket fits the buffer,
the passes read the buffer instead of the row (M = the mass above the buffer + the buffer's sums). The search ends
when the bracket's logits all tie or it is one key wide. On model-like rows that is 3-4 reads of the row (pass 0
included) and a few of the buffer; ``benchmarks/top_p_ab.py`` reports the counts.

Sums in another order than the sorted cumsum's can only disagree with it where a row's mass reaches p within
rounding at the boundary (tests/kernels/test_top_p.py counts those).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strataserve.kernels._common import check, check_same_device

_LOG2E = tl.constexpr(1.4426950408889634)
_I32_MAX = tl.constexpr(2**31 - 1)
_I32_MIN = tl.constexpr(-2**31)


@triton.jit
def _key(x):
    """float32 -> int32 with the same order (-0.0 just below +0.0); its own inverse on the bits."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _val(k):
    b = k ^ ((k >> 31) & 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _scan(src, n_src, dst, copy, t, lo, hi, lse, offs, S: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
          COPY: tl.constexpr):
    """One read of ``src[:n_src]``: M at the thresholds ``t`` (the mass of keys > t), the count and the smallest /
    largest key of the logits in (lo, hi], and with COPY (and ``copy``) the first CAP of those logits written to
    ``dst``. Sums, counts and extremes stay per lane until the end (no cross-lane reduction per chunk)."""
    acc = tl.zeros([S, BLOCK], tl.float32)  # [S, BLOCK]: each lane keeps all S sums of its own logits
    cnt = tl.zeros([BLOCK], tl.int32)
    kmin = tl.full([BLOCK], _I32_MAX, tl.int32)
    kmax = tl.full([BLOCK], _I32_MIN, tl.int32)
    stored = 0
    x_next = tl.load(src + offs, mask=offs < n_src, other=float("-inf"))
    for start in range(0, n_src, BLOCK):
        o = start + offs
        valid = o < n_src
        x = x_next.to(tl.float32)
        # the next chunk's load is issued before this chunk's arithmetic, which then hides its latency
        x_next = tl.load(src + o + BLOCK, mask=o + BLOCK < n_src, other=float("-inf"))
        k = _key(x)
        e = tl.exp2((x - lse) * _LOG2E)  # 0 for -inf and for the padding
        acc += tl.where(k[None, :] > t[:, None], e[None, :], 0.0)
        inb = valid & (k > lo) & (k <= hi)
        cnt += inb.to(tl.int32)
        kmin = tl.minimum(kmin, tl.where(inb, k, _I32_MAX))
        kmax = tl.maximum(kmax, tl.where(inb, k, _I32_MIN))
        if COPY:
            if copy & (stored < CAP):  # until the buffer is full
                pos = stored + tl.cumsum(inb.to(tl.int32), axis=0) - 1
                tl.store(dst + pos, x, mask=inb & (pos < CAP))
                stored += tl.sum(inb.to(tl.int32), axis=0)
    return tl.sum(acc, axis=1), tl.sum(cnt, axis=0), tl.min(kmin, axis=0), tl.max(kmax, axis=0)


@triton.jit
def _top_p_cutoff_kernel(x_ptr, p_ptr, cut_ptr, buf_ptr, stats_ptr, V, x_sr, S: tl.constexpr, BLOCK: tl.constexpr,
                         CAP: tl.constexpr, MAX_PASSES: tl.constexpr, STATS: tl.constexpr):
    row = tl.program_id(0)
    xrow = x_ptr + row.to(tl.int64) * x_sr
    brow = buf_ptr + row.to(tl.int64) * CAP
    p = tl.load(p_ptr + row)
    offs = tl.arange(0, BLOCK)

    # pass 0: max, sum of exp (online, per lane), smallest finite value, smallest and largest key (in keys, so that
    # -0.0 and +0.0 keep their order: the bracket must hold every logit)
    mv = tl.full([BLOCK], float("-inf"), tl.float32)
    sv = tl.zeros([BLOCK], tl.float32)
    mnf = tl.full([BLOCK], float("inf"), tl.float32)
    kmn = tl.full([BLOCK], _I32_MAX, tl.int32)
    kmx = tl.full([BLOCK], _I32_MIN, tl.int32)
    x_next = tl.load(xrow + offs, mask=offs < V, other=float("-inf"))
    for start in range(0, V, BLOCK):
        o = start + offs
        valid = o < V
        x = x_next.to(tl.float32)
        x_next = tl.load(xrow + o + BLOCK, mask=o + BLOCK < V, other=float("-inf"))
        m_new = tl.maximum(mv, x)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all -inf lane so far: no NaN from -inf - -inf
        sv = sv * tl.exp2((mv - ref) * _LOG2E) + tl.exp2((x - ref) * _LOG2E)
        mv = m_new
        mnf = tl.minimum(mnf, tl.where(x > float("-inf"), x, float("inf")))
        k = _key(x)
        kmn = tl.minimum(kmn, tl.where(valid, k, _I32_MAX))
        kmx = tl.maximum(kmx, tl.where(valid, k, _I32_MIN))
    m = tl.max(mv, axis=0)
    mref = tl.where(m == float("-inf"), 0.0, m)
    z = tl.sum(sv * tl.exp2((mv - mref) * _LOG2E), axis=0)
    lse = m + tl.log(tl.maximum(z, 1e-30))  # (z >= 1 unless no logit is finite)
    mn_fin = tl.min(mnf, axis=0)

    # the search: the answer lies in (lo, hi], a_hi = M(hi)
    kmn_row = tl.min(kmn, axis=0)
    lo = tl.where(kmn_row == _I32_MIN, kmn_row, kmn_row - 1)
    hi = tl.max(kmx, axis=0)
    a_hi = 0.0
    cut = float("-inf")
    # p >= 1 keeps everything; so does a row without a finite maximum (all -inf; NaN; +inf)
    done = (p >= 1.0) | (m == float("-inf")) | (m != m) | (m == float("inf"))
    in_buf = False  # the bracket's logits are all in the buffer: read those instead of the row
    n_buf = 0
    base = 0.0      # then: the mass above the logits in the buffer
    use_key = False        # how this pass splits: evenly in key, else evenly in value
    made_by_value = False  # whether the current bracket came from a value split
    c_prev = V
    sidx = tl.arange(0, S) + 1
    n_pass = 0
    n_row = 1  # reads of the whole row (pass 0 included)
    while (~done) & (n_pass < MAX_PASSES):
        lo64 = lo.to(tl.int64)
        hi64 = hi.to(tl.int64)
        t_key = lo64 + ((hi64 - lo64) * sidx.to(tl.int64)) // (S + 1)
        va = tl.maximum(_val(lo + 1), mn_fin)
        vb = _val(hi)
        t_val = _key(va + (vb - va) * (sidx.to(tl.float32) / (S + 1))).to(tl.int64)
        # thresholds strictly inside the bracket (hi - lo >= 2 here), so every pass narrows it
        t = tl.minimum(tl.maximum(tl.where(use_key, t_key, t_val), lo64 + 1), hi64 - 1).to(tl.int32)
        if in_buf:
            acc, cnt, kmin, kmax = _scan(brow, n_buf, brow, False, t, lo, hi, lse, offs, S, BLOCK, CAP, False)
            acc += base
        else:
            # (the first split's bracket is the whole row: no copy unless the row fits)
            acc, cnt, kmin, kmax = _scan(xrow, V, brow, (n_pass > 0) | (V <= CAP), t, lo, hi, lse, offs, S, BLOCK,
                                         CAP, True)
            n_row += 1
            if cnt <= CAP:
                in_buf = True
                n_buf = cnt
                base = a_hi
        if kmin >= kmax:  # one value (or, never for finite rows, none) in the bracket: the answer
            cut = tl.where(cnt > 0, _val(kmin), _val(hi))
            done = True
        else:
            f = acc < p
            nlo = tl.maximum(tl.max(tl.where(f, lo, t), axis=0), lo)
            nhi = tl.minimum(tl.min(tl.where(f, t, hi), axis=0), hi)
            a_new = tl.max(tl.where(f & (t == nhi), acc, -1.0), axis=0)
            a_hi = tl.where(nhi < hi, a_new, a_hi)
            # no logit of the bracket lies outside [kmin, kmax]: M is flat there
            lo = tl.maximum(nlo, kmin - 1)
            hi = tl.minimum(nhi, kmax)
            # a value split whose bracket did not halve the count is followed by a key split (ulp-close values,
            # values spread over many binades)
            next_key = (~use_key) & made_by_value & (cnt * 2 > c_prev)
            made_by_value = ~use_key
            use_key = next_key
            c_prev = cnt
            if hi.to(tl.int64) - lo.to(tl.int64) <= 1:
                cut = _val(hi)
                done = True
        n_pass += 1
    if ~done:  # (never on finite rows: each pass narrows the bracket) the largest possible cut-off
        cut = _val(hi)
    tl.store(cut_ptr + row, cut)
    if STATS:
        tl.store(stats_ptr + 2 * row, n_row)
        tl.store(stats_ptr + 2 * row + 1, n_pass + 1 - n_row)


def top_p_cutoff(x: torch.Tensor, p: torch.Tensor, *, block: int = 1024, splits: int = 16, cap: int = 16384,
                 num_warps: int = 8, stats: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [R, 1]: each row's top-p cut-off of ``x`` [R, V] (float32 logits, already temperature-scaled and
    min-p / top-k masked with -inf; last dim contiguous) for ``p`` [R] or [R, 1] (float32): keep ``x >= cut``.
    Rows with p >= 1 get -inf. Sync-free and graph-capturable (one launch, a fixed [R, cap] scratch buffer).
    ``stats`` (int32 [R, 2], optional): per row, the reads of the whole row (pass 0 included) and of the buffer."""
    check(x.dtype == torch.float32, f"x: dtype {x.dtype} not supported; use float32 logits")
    check(x.dim() == 2 and x.shape[1] > 0, f"x: expected [R, V] with V > 0, got {tuple(x.shape)}")
    check(x.stride(1) == 1, "x: the last dimension must be contiguous")
    p = p.reshape(-1)
    check(p.dtype == torch.float32 and p.shape[0] == x.shape[0],
          f"p: expected float32 [{x.shape[0]}] or [{x.shape[0]}, 1], got {p.dtype} {tuple(p.shape)}")
    check_same_device(x=x, p=p)
    for name, v, lo in (("block", block, 16), ("splits", splits, 2), ("cap", cap, 16)):
        check(v >= lo and v & (v - 1) == 0, f"{name}: expected a power of two >= {lo}, got {v}")
    if stats is not None:
        check(stats.dtype == torch.int32 and stats.shape == (x.shape[0], 2) and stats.is_contiguous(),
              f"stats: expected a contiguous int32 [{x.shape[0]}, 2] tensor")
        check_same_device(x=x, stats=stats)
    # (8 warps: ptxas takes ~240 registers a lane against 128 at 16, one program per SM either way; run 31's sweep
    # and run 31b end to end (top-p decode +2-11% in every round) had 8 ahead, so the shorter reductions win)
    R, V = x.shape
    cut = torch.empty(R, 1, dtype=torch.float32, device=x.device)
    if R == 0:
        return cut
    buf = torch.empty(R, cap, dtype=torch.float32, device=x.device)
    _top_p_cutoff_kernel[(R,)](x, p.contiguous(), cut, buf, cut if stats is None else stats, V, x.stride(0),
                               S=splits, BLOCK=block, CAP=cap, MAX_PASSES=64, STATS=stats is not None,
                               num_warps=num_warps)
    return cut


def top_p_cutoff_ref(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The sorted path's cut-off (``sampling_filters._cutoff`` over a full sort), for the same inputs."""
    from strataserve.runner.sampling_filters import _cutoff

    V = x.shape[1]
    k = torch.full((x.shape[0], 1), V, dtype=torch.int64, device=x.device)
    vals = x.sort(dim=-1, descending=True).values
    return _cutoff(vals, x.logsumexp(dim=-1, keepdim=True), k, p.reshape(-1, 1), V)[0]
