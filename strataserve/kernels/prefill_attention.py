"""Prefill attention over a paged KV cache with a cached prefix: variable-length, causal, block tables.

Segment s of the step holds q_len_s new query tokens of a sequence whose total length (cached prefix plus the
new tokens, all already stored in the cache) is L_s. Query row i has position p_i = L_s - q_len_s + i and attends
to keys j ≤ p_i (causal; the whole prefix included):

    o_i = sum_{j ≤ p_i} softmax_j(s · q_i · K_j) V_j,   K_j = k_cache[block_table[j // bs], j % bs, h // G]

Algorithm: FlashAttention's tiling with an online softmax (Dao et al., "FlashAttention: Fast and Memory-Efficient
Exact Attention with IO-Awareness", 2022): a program owns BLOCK_M query rows of one head of one segment and
streams the keys in BLOCK_N tiles, gathered row by row through the block table, stopping at the causal edge.
Queries are packed back to back ([total_tokens, Hq, D], ``cu_seqlens_q`` marks segments). An fp8/int8 cache is
converted on load with its per-head scales folded in. Unlike the decode kernel, the tile is converted as loaded,
not unpacked from int32 words (``kv_quant.load_tile``): with 64 query rows per key tile the words' extra trip
through shared memory cost more than it saved (device run 11: fp8 61 vs 56 us, int8 61 vs 55 us for one
1,024-token 8B prompt). fp8 tiles convert to float16 (one instruction per pair; bf16 takes a second per value), so
q is then scaled and cast to float16; int8 tiles convert fastest to q's own dtype.

Two launch forms. By default the grid is (cdiv(max_q_len, BLOCK_M), segments, heads) and sized from host values.
With a *tile map* (``tiles`` int32 [n, 2] of (segment, query block), unused entries (-1, 0)) the grid is
(n, heads) and depends only on the map's length, so a CUDA graph captured for a token bucket replays for any mix
of segments that fits it (``runner/mixed_graph.py``); ``kernels/prefill_tiles.py`` builds a map.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strataserve.kernels._common import dot as _dot
from strataserve.kernels._common import (check, check_index, check_paged_qkv, check_same_device, next_pow2)
from strataserve.kernels.decode_attention import gather_kv_ref
from strataserve.kernels.kv_quant import FP8
from strataserve.kernels.prefill_tiles import PREFILL_BLOCK_M


@triton.jit
def _attend_tile(acc, l_i, m_i, q, kc_ptr, vc_ptr, bt_row, c_sb, c_ss, kv_off, n0, pos_m, hi, qk_scale, offs_d,
                 dmask, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr):
    """One BLOCK_N tile of keys into the online softmax (base 2: ``qk_scale`` carries log2(e)). An unmasked tile
    lies wholly below every row's causal edge and inside the sequence, so it needs neither mask."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < hi
    if MASKED:
        blk = tl.load(bt_row + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
        kvmask = nmask[:, None] & dmask[None, :]
    else:
        blk = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
        kvmask = dmask[None, :]
    row = blk * c_sb + (offs_n % PAGE) * c_ss + kv_off
    k = tl.load(kc_ptr + row[:, None] + offs_d[None, :], mask=kvmask, other=0.0).to(q.dtype)
    qk = _dot(q, tl.trans(k), IEEE) * qk_scale
    if MASKED:
        qk = tl.where((offs_n[None, :] <= pos_m[:, None]) & nmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(vc_ptr + row[:, None] + offs_d[None, :], mask=kvmask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, IEEE)
    return acc, l_i, m_new


# the block-table width changes from step to step on the eager path: not specialised on, so a width that
# happens to be a multiple of 16 (or 1) does not compile another variant mid-run (docs/gpu_notes.md, run 12)
@triton.jit(do_not_specialize=["bt_sb"])
def _prefill_attention_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, bt_ptr, cu_ptr, len_ptr, ks_ptr, vs_ptr,
                              q_st, q_sh, o_st, o_sh, c_sb, c_ss, c_sh, bt_sb,
                              scale, D, tile_ptr,
                              G: tl.constexpr, GP: tl.constexpr, PAGE: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                              IEEE: tl.constexpr, QUANT: tl.constexpr, F16: tl.constexpr, TILED: tl.constexpr):
    # a program owns BLOCK_M query positions of GP heads that share one kv head (GQA packing: the K/V tiles are
    # loaded once for GP heads): BLOCK_M * GP rows, row r = (position r // GP, head h0 + r % GP)
    if TILED:  # (segment, query block) from the map; a negative segment is an unused entry
        seg = tl.load(tile_ptr + 2 * tl.program_id(0)).to(tl.int64)
        mb = tl.load(tile_ptr + 2 * tl.program_id(0) + 1)
        h0 = tl.program_id(1) * GP
        live = seg >= 0
        seg = tl.maximum(seg, 0)
    else:
        mb = tl.program_id(0)
        seg = tl.program_id(1).to(tl.int64)
        h0 = tl.program_id(2) * GP
        live = mb >= 0
    q_start = tl.load(cu_ptr + seg).to(tl.int64)
    q_len = tl.load(cu_ptr + seg + 1).to(tl.int64) - q_start
    if live & (mb * BLOCK_M < q_len):
        seq_len = tl.load(len_ptr + seg).to(tl.int64)
        prefix = seq_len - q_len
        kvh = h0 // G
        offs_r = tl.arange(0, BLOCK_M * GP)
        offs_m = mb * BLOCK_M + offs_r // GP
        head = h0 + offs_r % GP
        offs_d = tl.arange(0, BLOCK_D)
        mmask = offs_m < q_len
        dmask = offs_d < D
        q = tl.load(q_ptr + (q_start + offs_m)[:, None] * q_st + head[:, None] * q_sh + offs_d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)
        pos_m = prefix + offs_m
        qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs in base 2
        v_scale = 1.0
        if F16:  # q carries the softmax scale, which keeps a float16 q well inside float16's range
            q = (q.to(tl.float32) * qk_scale).to(tl.float16)
            qk_scale = 1.0
        if QUANT:
            qk_scale = qk_scale * tl.load(ks_ptr + kvh)
            v_scale = tl.load(vs_ptr + kvh)
        m_i = tl.full([BLOCK_M * GP], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * GP], tl.float32)
        acc = tl.zeros([BLOCK_M * GP, BLOCK_D], tl.float32)
        bt_row = bt_ptr + seg * bt_sb
        kv_off = kvh * c_sh
        # keys up to the first row's position are visible to every row: whole tiles of them skip the masks
        lo = (prefix + mb * BLOCK_M + 1) // BLOCK_N * BLOCK_N
        hi = tl.minimum(seq_len, prefix + (mb + 1) * BLOCK_M)
        for n0 in range(0, lo, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, kc_ptr, vc_ptr, bt_row, c_sb, c_ss, kv_off, n0, pos_m,
                                         hi, qk_scale, offs_d, dmask, PAGE, BLOCK_N, IEEE, False)
        for n0 in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, kc_ptr, vc_ptr, bt_row, c_sb, c_ss, kv_off, n0, pos_m,
                                         hi, qk_scale, offs_d, dmask, PAGE, BLOCK_N, IEEE, True)
        out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
        tl.store(o_ptr + (q_start + offs_m)[:, None] * o_st + head[:, None] * o_sh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, max_q_len: int, scale: float,
                      out: torch.Tensor | None = None, block_m: int = PREFILL_BLOCK_M, block_n: int = 64,
                      num_warps: int = 4, num_stages: int = 2, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, tiles: torch.Tensor | None = None,
                      pack: int = 1) -> torch.Tensor:
    """``q`` [T, Hq, D] packed segments; ``cu_seqlens_q`` [S+1]; ``seq_lens`` [S] (prefix + new tokens);
    ``block_tables`` [S, max_blocks]; ``max_q_len`` the longest segment (host int, sizes the grid; ignored with
    ``tiles``); ``k_scale``/``v_scale`` [Hkv] for an fp8/int8 cache. ``tiles``: int32 [n, 2] tile map made with
    the same ``block_m`` (module docstring); segments it does not name are not computed. ``pack``: query heads per
    program (a power of two dividing q_heads // kv_heads; each program then holds ``block_m * pack`` rows)."""
    quant = check_paged_qkv(q, k_cache, v_cache, "[tokens, q_heads, head_dim]", k_scale, v_scale)
    T, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    check_index("cu_seqlens_q", cu_seqlens_q)
    check_index("seq_lens", seq_lens)
    check_index("block_tables", block_tables)
    S = seq_lens.shape[0]
    check(cu_seqlens_q.shape == (S + 1,), f"cu_seqlens_q: expected shape ({S + 1},), got {tuple(cu_seqlens_q.shape)}")
    check(block_tables.dim() == 2 and block_tables.shape[0] == S and block_tables.stride(1) == 1,
          f"block_tables: expected [{S}, max_blocks] with contiguous columns, got {tuple(block_tables.shape)}")
    check(max_q_len >= 0, "max_q_len: must be >= 0")
    check(pack >= 1 and pack & (pack - 1) == 0 and (Hq // Hkv) % pack == 0,
          f"pack={pack}: must be a power of two dividing q_heads // kv_heads = {Hq // Hkv}")
    check_same_device(q=q, k_cache=k_cache, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)
    if out is None:
        out = torch.empty_like(q)
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out: must match q")
    if tiles is not None:
        check_index("tiles", tiles)
        check(tiles.dim() == 2 and tiles.shape[1] == 2 and tiles.is_contiguous(),
              f"tiles: expected a contiguous [n, 2] map, got {tuple(tiles.shape)}")
        check_same_device(q=q, tiles=tiles)
        grid: tuple[int, ...] = (tiles.shape[0], Hq // pack)
    else:
        grid = (triton.cdiv(max_q_len, block_m), S, Hq // pack)
    if T == 0 or S == 0 or grid[0] == 0:
        return out
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, k_scale if quant else q,
        v_scale if quant else q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale, D, tiles if tiles is not None else cu_seqlens_q, G=Hq // Hkv, GP=pack, PAGE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(D)), IEEE=q.dtype == torch.float32,
        QUANT=quant, F16=k_cache.dtype == FP8 and q.dtype != torch.float32, TILED=tiles is not None,
        num_warps=num_warps, num_stages=num_stages)
    return out


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(q)
    G = q.shape[1] // k_cache.shape[2]
    for s in range(seq_lens.shape[0]):
        a, b, L = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]), int(seq_lens[s])
        n = b - a
        k = gather_kv_ref(k_cache, block_tables[s], L, k_scale).repeat_interleave(G, dim=1)
        v = gather_kv_ref(v_cache, block_tables[s], L, v_scale).repeat_interleave(G, dim=1)
        att = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale
        pos = torch.arange(L - n, L, device=q.device)
        att = att.masked_fill(torch.arange(L, device=q.device)[None, :] > pos[:, None], float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).to(q.dtype)
    return out
