"""Paged decode attention: one query token per sequence against its KV cache, split-KV (flash-decoding).

Math, for sequence b and query head h with KV head g = h // G (G = query heads per KV head, GQA), context
length L_b (the current token's KV already stored), scale s:

    o[b, h] = sum_j softmax_j(s * q[b, h] · K[b, j, g]) V[b, j, g],   j < L_b

K/V rows are found through the block table: row j lives at k_cache[block_tables[b, j // block_size],
j % block_size, g].

Algorithm: the online softmax of FlashAttention (Dao et al., 2022) within a program, and the split-KV scheme of
Flash-Decoding (Dao, Haziza, Massa, Sizov, 2023): the context is cut into ``num_splits`` ranges processed by
separate programs, each writing a partial output o_s and its log-sum-exp lse_s; a second kernel combines

    o = sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m),   m = max_s lse_s

so one long sequence still fills the GPU. The G query heads sharing one KV head are packed into the rows of one
program's tile (padded to 16 rows for the tensor cores), so each K/V row is read once per KV head, not G times.
A sequence with L_b = 0 (padding in a CUDA-graph batch) yields zeros. ``num_splits`` is a launch parameter, not
derived from L_b on the host, so a captured graph replays correctly for any context length.

Adaptive splits (``split_target``, for launches of at least one program per SM): ``num_splits`` is then only the
grid's upper bound. Every program reads all B context lengths and sets the step's chunk length
c = max(Hkv * sum_b L_b / slots, BLOCK_N), slots = SMs x target; a row longer than the mean uses
n_b = min(num_splits, ceil(L_b / c)) splits, any other row one. So equal rows never split (run 8: splitting 64
rows of 576 tokens in two cost 17%), while the long rows of a mixed batch are cut to about the machine's fair
share. Except when the real rows give fewer than ``split_all_below`` programs per SM unsplit and c is at least
4 key tiles: then every row longer than c splits, since a half-empty machine costs more than the combine (run 11:
32 rows of 8,192 tokens, one program per (row, kv head), left 2 programs per SM: bf16 306 -> 254 us, fp8
342 -> 213 us), while chunks of a few tiles do not pay for it (32 rows of 576 tokens, c = 3 tiles: bf16 +5%).
A split row's partials are combined by the last of its programs to finish (an atomic ticket per
(row, kv head), reset by that program), so there is no reduce launch. The grid is fixed per batch size, so CUDA
graphs stay valid. Smaller launches (batch 1) keep the fixed split count and the reduce kernel: there the
in-kernel combine's fence, ticket and reload cost ~3 us more than the reduce launch (run 8 sweep).
An fp8/int8 cache (``kv_quant.py``) is read as int32 words and unpacked to float16 (``kv_quant.load_tile``); q
is then scaled by ``scale`` and cast to float16 (float32 for a float32 model), the per-head K scale multiplies
the logits and the V scale the output.

With ``rope`` (``DecodeRope``: a decode-only step, a float cache) the step's new token arrives unrotated and not yet
stored: every program rotates its q heads itself (Qwen3's q/k norm first, ``rotary.rope_tile``), the program whose
range holds the new position loads that token's k and v before its loop (which stops short of it), then rotates k,
adds the token to its online softmax and writes k and v into their slot, so the separate rotary + KV-store launch
before attention goes away (run 18). Under PDL such a program also asks L2 for its first key tile's K and V lines
before it waits for the previous kernel (an adaptive launch after choosing its split count): none of what it reads
before the wait (lengths, block table, cached rows before the new token) is written by the kernel just before it
(the qkv projection), only at the step's start.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strataserve import envs
from strataserve.kernels._common import dot as _dot
from strataserve.kernels._common import (check, check_index, check_ndim, check_paged_qkv, check_same_device, next_pow2,
                                        pdl_args, pdl_wait, prefetch_l2)
from strataserve.kernels.kv_quant import dequantize_ref, load_tile, word_view
from strataserve.kernels.rotary import DecodeRope, decode_rope_args, rope_apply, rope_operands, rope_tile


# the block-table width changes from step to step on the eager path: not specialised on, so a width that
# happens to be a multiple of 16 (or 1) does not compile another variant mid-run (docs/gpu_notes.md, run 12)
@triton.jit(do_not_specialize=["bt_sb"])
def _paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, po_ptr, pl_ptr, o_ptr, sem_ptr, ks_ptr, vs_ptr,
                         q_sb, q_sh, c_sb, c_ss, c_sh, bt_sb, po_sb, po_sh, po_ss, pl_sb, pl_sh, o_sb, o_sh,
                         scale, D, slots, few, pos_ptr, kn_ptr, vn_ptr, cs_ptr, qw_ptr, kw_ptr, slot_ptr,
                         kn_sb, kn_sh, vn_sb, vn_sh, cs_stride, eps, HALF, G: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         IEEE: tl.constexpr, DIRECT: tl.constexpr, REVERSE: tl.constexpr, QUANT: tl.constexpr,
                         INT: tl.constexpr, ASM: tl.constexpr, ADAPTIVE: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_S: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr,
                         EARLY: tl.constexpr, BLOCK_L: tl.constexpr, LINE: tl.constexpr):
    if not EARLY:
        pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    if REVERSE:  # the GPU starts programs in id order: with rows sorted by length, the longest go first
        b = tl.num_programs(0) - 1 - b
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    ctx = tl.load(ctx_ptr + b)
    if ADAPTIVE:  # this row's split count from its length against the whole step's (module docstring)
        offs_b = tl.arange(0, BLOCK_B)
        lens = tl.load(ctx_ptr + offs_b, mask=offs_b < tl.num_programs(0), other=0).to(tl.int64)
        total = tl.sum(lens)
        chunk = tl.maximum(tl.cdiv(total * tl.num_programs(1), slots), BLOCK_N)
        chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
        # longer than the mean of the real rows (a graph bucket's padding rows have length 0): only those split,
        # unless the real rows leave the machine short of programs (``few``: their count below which all may)
        n_real = tl.sum((lens > 0).to(tl.int64))
        longer = (ctx * n_real > total) | ((n_real * tl.num_programs(1) < few) & (chunk >= 4 * BLOCK_N))
        num_splits = tl.where(longer, tl.minimum(tl.maximum(tl.cdiv(ctx, chunk), 1), num_splits), 1).to(tl.int32)
        if split >= num_splits:
            return
    split_len = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < G
    dmask = offs_d < D
    heads = kvh * G + offs_h
    last = ctx - 1  # the position of the token being decoded
    mine = (start <= last) & (last < end)  # this program's range holds it
    loop_end = end
    if ROPE:  # the new token is not in the cache yet: the loop stops short of it (it is added after the loop)
        loop_end = tl.where(mine, last, end)
    if EARLY:  # (PDL, rope, fixed splits) the first key tile's K and V lines to L2 while the previous kernel runs
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < loop_end
        blk = tl.load(bt_ptr + b * bt_sb + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
        offs_l = tl.arange(0, BLOCK_L) * LINE
        lines = (blk * c_sb + (offs_n % PAGE) * c_ss + kvh * c_sh)[:, None] + offs_l[None, :]
        lmask = nmask[:, None] & (offs_l[None, :] < D)
        prefetch_l2(kc_ptr + lines, lmask)
        prefetch_l2(vc_ptr + lines, lmask)
        pdl_wait(PDL)
    if ROPE:  # q rotated here, rounded as the in-place rotary rounds it
        pos = tl.load(pos_ptr + b).to(tl.int64)
        q = rope_tile(q_ptr + b * q_sb, q_sh, heads, hmask, offs_d, pos, cs_ptr, cs_stride, qw_ptr, eps, D, HALF,
                      HAS_NORM).to(q_ptr.dtype.element_ty)
        # the new token's k / v are loaded now (the loop hides their latency); after the loop it is rotated,
        # attended to and stored
        one = kvh + tl.zeros([1], tl.int32)
        lim = tl.where(mine, D, 0)  # (masks as comparisons: a block & a scalar bool is not a mask everywhere)
        kx, kxp, kcos, ksin, kw, kwp = rope_operands(kn_ptr + b * kn_sb, kn_sh, one, one * 0 < lim, offs_d, pos,
                                                     cs_ptr, cs_stride, kw_ptr, D, HALF, HAS_NORM)
        v_new = tl.load(vn_ptr + b * vn_sb + kvh * vn_sh + offs_d[None, :], mask=offs_d[None, :] < lim, other=0.0)
    else:
        q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + offs_d[None, :],
                    mask=hmask[:, None] & dmask[None, :], other=0.0)

    qk_scale = scale
    v_scale = 1.0
    offs_w = tl.arange(0, BLOCK_D // 4)  # int32 words of a quantised cache (4 values each)
    if QUANT:  # q carries the softmax scale: a float16 q then stays well inside float16's range
        q = q.to(tl.float32) * scale
        if not IEEE:
            q = q.to(tl.float16)
        qk_scale = tl.load(ks_ptr + kvh)
        v_scale = tl.load(vs_ptr + kvh)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, loop_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < loop_end
        # PAGE is a compile-time constant: the page lookup is a shift and a mask (powers of two), not a division
        blk = tl.load(bt_ptr + b * bt_sb + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
        row = blk * c_sb + (offs_n % PAGE) * c_ss + kvh * c_sh  # in words for a quantised cache
        kvmask = nmask[:, None] & dmask[None, :]
        wmask = nmask[:, None] & (offs_w[None, :] < D // 4)
        if QUANT:
            k = load_tile(kc_ptr, row, offs_w, wmask, INT, ASM).to(q.dtype)
        else:
            k = tl.load(kc_ptr + row[:, None] + offs_d[None, :], mask=kvmask, other=0.0)
        qk = _dot(q, tl.trans(k), IEEE) * qk_scale
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:
            v = load_tile(vc_ptr, row, offs_w, wmask, INT, ASM).to(q.dtype)
        else:
            v = tl.load(vc_ptr + row[:, None] + offs_d[None, :], mask=kvmask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, IEEE)
        m_i = m_new

    if ROPE:
        if mine:  # the new token: one more key in the online softmax, then its k and v into their slot
            k_new = rope_apply(kx, kxp, kcos, ksin, kw, kwp, eps, D, kn_ptr.dtype.element_ty, HAS_NORM)
            k_new = k_new.to(kc_ptr.dtype.element_ty)
            s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * qk_scale
            m_new = tl.maximum(m_i, s)
            p = tl.exp(s - m_new)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)
            m_i = m_new
            slot = tl.load(slot_ptr + b).to(tl.int64)
            if slot >= 0:
                dst = (slot // PAGE) * c_sb + (slot % PAGE) * c_ss + kvh * c_sh + offs_d[None, :]
                tl.store(kc_ptr + dst, k_new, mask=dmask[None, :])
                tl.store(vc_ptr + dst, v_new, mask=dmask[None, :])
    nonempty = l_i > 0
    out = acc * (v_scale / tl.where(nonempty, l_i, 1.0))[:, None]
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    hd_mask = hmask[:, None] & dmask[None, :]
    if ADAPTIVE:
        if num_splits == 1:  # the row is not split: its final output, no partials
            tl.store(o_ptr + b * o_sb + heads[:, None] * o_sh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=hd_mask)
        else:
            _store_partial_and_combine(out, lse, po_ptr, pl_ptr, o_ptr, sem_ptr + b * tl.num_programs(1) + kvh,
                                       b, heads, offs_d, hmask, hd_mask, split, num_splits, po_sb, po_sh, po_ss,
                                       pl_sb, pl_sh, o_sb, o_sh, BLOCK_H, BLOCK_D, BLOCK_S)
    else:
        # DIRECT (one split): po_ptr is the final output, so no partials and no reduce kernel
        tl.store(po_ptr + b * po_sb + heads[:, None] * po_sh + split * po_ss + offs_d[None, :],
                 out.to(po_ptr.dtype.element_ty), mask=hd_mask)
        if not DIRECT:
            tl.store(pl_ptr + b * pl_sb + heads * pl_sh + split, lse, mask=hmask)


@triton.jit
def _store_partial_and_combine(out, lse, po_ptr, pl_ptr, o_ptr, sem, b, heads, offs_d, hmask, hd_mask, split,
                               num_splits, po_sb, po_sh, po_ss, pl_sb, pl_sh, o_sb, o_sh,
                               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Write this split's partial; the row's last program to arrive combines all ``num_splits`` of them."""
    po = po_ptr + b * po_sb + heads[:, None] * po_sh + offs_d[None, :]
    pl = pl_ptr + b * pl_sb + heads * pl_sh
    tl.store(po + split * po_ss, out, mask=hd_mask)
    tl.store(pl + split, lse, mask=hmask)
    # every thread's stores before the ticket; acq_rel: the last program then sees all of them
    tl.debug_barrier()
    ticket = tl.atomic_add(sem, 1, sem="acq_rel")
    if ticket == num_splits - 1:
        tl.atomic_xchg(sem, 0)  # ready for the next launch (a graph replay reuses the counters)
        offs_s = tl.arange(0, BLOCK_S)
        lses = tl.load(pl[:, None] + offs_s[None, :], mask=hmask[:, None] & (offs_s[None, :] < num_splits),
                       other=float("-inf"), cache_modifier=".cg")  # .cg: from L2, never a stale L1 line
        m = tl.max(lses, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.exp(lses - m[:, None]), axis=1)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for s in range(0, num_splits):
            w = tl.exp(tl.load(pl + s, mask=hmask, other=float("-inf"), cache_modifier=".cg") - m)
            acc += w[:, None] * tl.load(po + s * po_ss, mask=hd_mask, other=0.0, cache_modifier=".cg")
        res = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(o_ptr + b * o_sb + heads[:, None] * o_sh + offs_d[None, :], res.to(o_ptr.dtype.element_ty),
                 mask=hd_mask)


@triton.jit
def _paged_decode_reduce_kernel(po_ptr, pl_ptr, o_ptr, po_sb, po_sh, po_ss, pl_sb, pl_sh, o_sb, o_sh,
                                num_splits, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < num_splits
    lse = tl.load(pl_ptr + b * pl_sb + h * pl_sh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    total = tl.sum(w, axis=0)
    o = tl.load(po_ptr + b * po_sb + h * po_sh + offs_s[:, None] * po_ss + offs_d[None, :],
                mask=smask[:, None] & (offs_d[None, :] < D), other=0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * o_sb + h * o_sh + offs_d, out.to(o_ptr.dtype.element_ty), mask=offs_d < D)


def default_num_splits(batch: int, num_kv_heads: int, num_sms: int = 132, max_splits: int = 16,
                       programs_per_sm: int = 16) -> int:
    """Splits so the launch has about ``programs_per_sm`` programs per SM; fixed per batch size so CUDA graphs can
    capture it. 16 (run 6 sweep over mixed context lengths, docs/gpu_notes.md): several waves of short programs
    balance unequal lengths (batch 256: 0.922 -> 0.935 of copy bandwidth at 2 splits; batch 60: 0.69 -> 0.78 at
    4); the earlier 2 per SM left one split per row from batch 33 up."""
    want = (programs_per_sm * num_sms + batch * num_kv_heads - 1) // (batch * num_kv_heads)
    return max(1, min(max_splits, want))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, out: torch.Tensor | None = None,
                           block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                           reverse: bool = True, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, split_target: int = 0, num_sms: int = 132,
                           semaphores: torch.Tensor | None = None, split_all_below: int = 2,
                           rope: DecodeRope | None = None) -> torch.Tensor:
    """``q`` [B, Hq, D]; caches [NB, BS, Hkv, D]; ``block_tables`` [B, max_blocks]; ``context_lens`` [B];
    ``k_scale``/``v_scale`` [Hkv] for an fp8/int8 cache.

    Returns ``out`` [B, Hq, D] in q's dtype. ``reverse``: launch the rows last to first. The runner sorts decode
    rows by ascending context length, so this starts the longest sequences first and the short ones fill the
    tail (longest-processing-time-first), instead of the longest programs starting last and running alone.
    ``split_target`` > 0: adaptive splits (module docstring) aiming at that many programs per SM (of ``num_sms``),
    ``num_splits`` being the most any row takes, when B * Hkv >= ``num_sms``; ``semaphores``: int32 zeros,
    >= B * Hkv, which the kernel leaves zeroed (a caller that keeps one buffer saves a memset per launch; None
    allocates one); ``split_all_below``: programs per SM under which adaptive splits cut equal rows too (0: never).
    ``rope``: q is not rotated yet, and the new tokens' k/v (``DecodeRope``) are rotated, stored and attended to in
    this launch (module docstring).
    """
    quant = check_paged_qkv(q, k_cache, v_cache, "[batch, q_heads, head_dim]", k_scale, v_scale)
    B, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    check_ndim("block_tables", block_tables, 2, "[batch, max_blocks]")
    check(block_tables.shape[0] == B and block_tables.stride(1) == 1,
          f"block_tables: expected {B} rows with contiguous columns, got {tuple(block_tables.shape)}")
    check_index("block_tables", block_tables)
    check_index("context_lens", context_lens)
    check(context_lens.shape == (B,), f"context_lens: expected shape ({B},), got {tuple(context_lens.shape)}")
    check_same_device(q=q, k_cache=k_cache, block_tables=block_tables, context_lens=context_lens)
    if out is None:
        out = torch.empty_like(q)
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out: must match q")
    rope_args, has_norm = decode_rope_args(rope, q, k_cache, quant)
    if B == 0:
        return out
    G = Hq // Hkv
    splits = num_splits or default_num_splits(B, Hkv)
    check(split_target >= 0 and num_sms > 0 and split_all_below >= 0,
          f"split_target {split_target} / num_sms {num_sms} / split_all_below {split_all_below}: "
          "must be >= 0 / > 0 / >= 0")
    block_d = max(16, next_pow2(D))
    direct = splits == 1
    adaptive = split_target > 0 and not direct and B * Hkv >= num_sms
    if semaphores is not None:
        check(semaphores.dtype == torch.int32 and semaphores.numel() >= B * Hkv and semaphores.is_contiguous(),
              f"semaphores: need contiguous int32 zeros with >= {B * Hkv} elements")
    sems = q  # unused unless adaptive
    if adaptive:
        sems = semaphores if semaphores is not None else torch.zeros(B * Hkv, dtype=torch.int32, device=q.device)
    if direct:
        partial, lse = out, out  # lse is never written in DIRECT mode
        po_strides, pl_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        partial = torch.empty(B, Hq, splits, block_d, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device)
        po_strides, pl_strides = partial.stride()[:3], lse.stride()[:2]
    is_int = asm = False
    if quant:
        (k_cache, is_int, asm), v_cache = word_view(k_cache), word_view(v_cache)[0]
    pdl = pdl_args(q, B)
    line = 128 // k_cache.element_size()  # cache elements per 128-byte line
    _paged_decode_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, partial, lse, out, sems, k_scale if quant else q,
        v_scale if quant else q,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *po_strides, *pl_strides, out.stride(0), out.stride(1), scale, D, max(1, split_target * num_sms),
        split_all_below * num_sms, *rope_args,
        G=G, PAGE=block_size, BLOCK_H=max(16, next_pow2(G)), BLOCK_N=block_n, BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32,
        DIRECT=direct, REVERSE=reverse, QUANT=quant, INT=is_int, ASM=asm, ADAPTIVE=adaptive,
        BLOCK_B=next_pow2(B) if adaptive else 1,
        BLOCK_S=max(2, next_pow2(splits)), ROPE=rope is not None, HAS_NORM=has_norm,
        EARLY=rope is not None and pdl["PDL"] and envs.STRATA_PDL_PREFETCH,
        BLOCK_L=next_pow2(triton.cdiv(D, line)), LINE=line,
        num_warps=num_warps, num_stages=num_stages, **pdl)
    if direct or adaptive:
        return out
    _paged_decode_reduce_kernel[(B, Hq)](
        partial, lse, out, partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), splits, D, BLOCK_S=max(2, next_pow2(splits)), BLOCK_D=block_d, num_warps=4,
        **pdl)
    return out


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``length`` rows [length, Hkv, D] of one sequence's paged cache (float32, dequantised with
    ``scale`` [Hkv] for an fp8/int8 cache)."""
    bs = cache.shape[1]
    j = torch.arange(length, device=cache.device)
    rows = block_table[j // bs].long(), j % bs
    if scale is None:
        return cache[rows].float()
    return dequantize_ref(cache.view(torch.uint8)[rows].view(cache.dtype), scale)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.zeros_like(q)
    G = q.shape[1] // k_cache.shape[2]
    for b in range(q.shape[0]):
        L = int(context_lens[b])
        if L == 0:
            continue
        k = gather_kv_ref(k_cache, block_tables[b], L, k_scale).repeat_interleave(G, dim=1)  # [L, Hq, D]
        v = gather_kv_ref(v_cache, block_tables[b], L, v_scale).repeat_interleave(G, dim=1)
        att = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale
        out[b] = torch.einsum("hl,lhd->hd", att.softmax(-1), v).to(q.dtype)
    return out
