"""Paged decode (split-KV) and prefill-with-prefix attention against their PyTorch references."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from strataserve.kernels.decode_attention import DecodeRope, paged_decode_attention, paged_decode_attention_ref
from strataserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from strataserve.kernels.prefill_tiles import build_prefill_tiles
from strataserve.kernels.rotary_kv import rotary_store_kv_ref
from strataserve.models.hf_config import RopeScaling
from strataserve.models.rope import build_cos_sin_cache
from ._helpers import ATTN_TOL, DTYPES, assert_close


def _paged_cache(device, dtype, lens, H, D, bs):
    """A cache whose blocks are handed out in shuffled order, with block tables for ``lens``."""
    need = [(n + bs - 1) // bs for n in lens]
    nb = sum(need) + 3
    perm = torch.randperm(nb).tolist()
    width = max(max(need), 1) + 1
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        del perm[:n]
    kc = torch.randn(nb, bs, H, D, device=device, dtype=dtype)
    vc = torch.randn(nb, bs, H, D, device=device, dtype=dtype)
    return kc, vc, tables.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,Hq,Hkv,D,bs,splits", [
    ([5, 123, 1, 40], 4, 2, 32, 16, None),     # GQA 2, odd lengths, default splits
    ([77], 6, 1, 64, 8, 3),                    # MQA, 3 uneven splits
    ([0, 17, 300], 2, 2, 16, 16, 7),           # MHA, a padding row (length 0) and empty splits
    ([0, 9, 130], 4, 1, 32, 16, 1),            # one split: written directly, no reduce kernel
])
@pytest.mark.parametrize("reverse", [True, False])  # launch order only: the same rows, the same results
def test_paged_decode(device, dtype, lens, Hq, Hkv, D, bs, splits, reverse):
    kc, vc, tables = _paged_cache(device, dtype, lens, Hkv, D, bs)
    qkv = torch.randn(len(lens), Hq + 2 * Hkv, D, device=device, dtype=dtype)
    q = qkv[:, :Hq]  # strided view, like a slice of the qkv projection
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = D ** -0.5
    out = paged_decode_attention(q, kc, vc, tables, ctx, scale, num_splits=splits, block_n=16, reverse=reverse)
    assert_close(out, paged_decode_attention_ref(q, kc, vc, tables, ctx, scale), ATTN_TOL[dtype], "decode")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,Hq,Hkv,D,bs,splits,target,norm", [
    ([5, 123, 1, 40], 4, 2, 32, 16, None, 0, False),   # GQA, default splits, the new token in each row's last split
    ([77, 0], 6, 1, 64, 8, 3, 0, True),                 # MQA, Qwen3 q/k norm, a padding row (slot -1)
    ([0, 9, 130], 4, 1, 32, 16, 1, 0, True),            # one split: direct
    ([200, 200, 3, 0], 8, 2, 32, 16, 4, 4, False),      # adaptive splits (in-kernel combine)
])
def test_paged_decode_with_rotary_and_store(device, dtype, lens, Hq, Hkv, D, bs, splits, target, norm):
    """``rope=``: q and the new k unrotated, the new k/v not yet stored; the kernel must give what rotary_store_kv
    followed by attention gives: the same output and the same caches (the new slot written, nothing else)."""
    kc, vc, tables = _paged_cache(device, dtype, lens, Hkv, D, bs)
    B = len(lens)
    qkv = torch.randn(B, Hq + 2 * Hkv, D, device=device, dtype=dtype)
    q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]  # strided views of one projection
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    pos = (ctx - 1).clamp(min=0).long()
    last = pos.view(-1, 1)
    slots = (tables.long().gather(1, last // bs).view(-1) * bs + pos % bs).masked_fill(ctx == 0, -1)
    cos_sin = build_cos_sin_cache(D, 512, 1e6, RopeScaling(), device=device)
    qw = torch.rand(D, device=device, dtype=dtype) + 0.5 if norm else None
    kw = torch.rand(D, device=device, dtype=dtype) + 0.5 if norm else None
    kc_ref, vc_ref = kc.clone(), vc.clone()
    rq = rotary_store_kv_ref(q, k, v, pos, cos_sin, kc_ref, vc_ref, slots, qw, kw, 1e-6)
    want = paged_decode_attention_ref(rq, kc_ref, vc_ref, tables, ctx, D ** -0.5)
    q_before = q.clone()
    rope = DecodeRope(pos, k, v, cos_sin, slots, qw, kw, 1e-6)
    sems = torch.zeros(B * Hkv, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, kc, vc, tables, ctx, D ** -0.5, num_splits=splits, block_n=16, rope=rope,
                                 split_target=target, num_sms=2, semaphores=sems)
    tol = 2 * ATTN_TOL[dtype] if norm else ATTN_TOL[dtype]  # (the norm rounds twice before the rotation)
    assert_close(out, want, tol, "decode with rope")
    assert_close(kc, kc_ref, 2 * tol, "k cache")
    assert torch.equal(vc, vc_ref), "v cache: the new v in its slot, nothing else"
    assert torch.equal(q, q_before), "q is rotated in registers, not in memory"
    with pytest.raises(ValueError, match="rot_dim"):
        paged_decode_attention(q, kc, vc, tables, ctx, 0.3, rope=DecodeRope(pos, k, v, cos_sin[:, :D // 2], slots))
    with pytest.raises(ValueError, match="slot_mapping"):
        paged_decode_attention(q, kc, vc, tables, ctx, 0.3, rope=DecodeRope(pos, k, v, cos_sin, slots[:1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,Hkv,splits,sms,target,below", [
    ([5, 123, 1, 40, 0], 2, 4, 2, 4, 2),    # chunk 48: 123 splits in 3; 40 (longer than the mean) in 1; padding row
    ([9, 17, 20, 300], 1, 5, 1, 4, 2),      # only the long row splits (chunk 96: 4 of its 5 splits), others direct
    ([33, 40, 47], 2, 3, 1, 1, 2),           # chunk >= every row: no row splits, all written directly
    ([40, 40, 40, 0], 2, 3, 1, 8, 2),        # equal rows never split, however small the chunk (32); padding
    ([200, 200, 200, 0], 2, 3, 2, 4, 4),     # but 6 real programs < 4 per SM x 2 SMs and chunk 160 >= 4 tiles:
                                             # they split too (2 each)
    ([40, 40, 40, 0], 2, 3, 2, 8, 4),        # not when the chunk (32) is under 4 tiles
    ([200, 3], 2, 4, 64, 4, 2),              # fewer programs (4) than SMs: the fixed split count + reduce kernel
])
def test_paged_decode_adaptive_splits(device, dtype, lens, Hkv, splits, sms, target, below):
    """Per-row split counts chosen in the kernel, combined by the last split program (no reduce launch); the
    semaphores it uses are left zeroed, so a second launch over the same buffer (a graph replay) is right too."""
    Hq, D, bs = 4 * Hkv, 32, 16
    kc, vc, tables = _paged_cache(device, dtype, lens, Hkv, D, bs)
    q = torch.randn(len(lens), Hq, D, device=device, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    sems = torch.zeros(len(lens) * Hkv + 3, dtype=torch.int32, device=device)
    exp = paged_decode_attention_ref(q, kc, vc, tables, ctx, 0.3)
    for _ in range(2):
        out = paged_decode_attention(q, kc, vc, tables, ctx, 0.3, num_splits=splits, block_n=16, split_target=target,
                                     num_sms=sms, semaphores=sems, split_all_below=below)
        assert_close(out, exp, ATTN_TOL[dtype], "adaptive decode")
        assert int(sems.abs().sum()) == 0, "semaphores not reset"
    with pytest.raises(ValueError, match="semaphores"):
        paged_decode_attention(q, kc, vc, tables, ctx, 0.3, num_splits=splits, split_target=target,
                               semaphores=sems[:1])
    with pytest.raises(ValueError, match="split_all_below -1"):
        paged_decode_attention(q, kc, vc, tables, ctx, 0.3, split_target=target, split_all_below=-1)


@pytest.mark.parametrize("lens,split", [([200, 200, 200, 0], True), ([40, 40, 40, 0], False)])
def test_equal_rows_split_only_on_a_short_machine(device, lens, split):
    """The ``split_all_below`` rule changes the path, not just the result's tolerance: where it applies (6 real
    programs on 2 SMs, chunk 160 = 10 tiles of 16) the equal rows are cut, so the float32 sums run in another order
    than under run 8's rule (``split_all_below=0``); below 4 tiles per chunk the kernel takes run 8's path exactly."""
    Hkv, D = 2, 32
    kc, vc, tables = _paged_cache(device, torch.float32, lens, Hkv, D, 16)
    q = torch.randn(len(lens), 4 * Hkv, D, device=device)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    target = 4 if split else 8
    a, b = (paged_decode_attention(q, kc, vc, tables, ctx, 0.3, num_splits=3, block_n=16, split_target=target,
                                   num_sms=2, split_all_below=below) for below in (4, 0))
    assert torch.equal(a, b) != split, "split" if split else "run 8's path"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pack", ["one", "all"])
@pytest.mark.parametrize("q_lens,prefix,Hq,Hkv,D,bs,bm,bn", [
    ([5, 37], [0, 0], 4, 2, 32, 16, 16, 16),            # plain prefill, two segments
    ([9, 1, 20], [16, 40, 3], 2, 1, 64, 8, 16, 16),      # cached prefixes (block-aligned and not), a 1-token chunk
    ([50, 3], [70, 0], 8, 2, 32, 8, 8, 32),              # 4 heads per kv head, keys tiles span 4 pages
])
def test_prefill_with_prefix(device, dtype, pack, q_lens, prefix, Hq, Hkv, D, bs, bm, bn):
    """Every row against the reference, with the query heads of a kv head in one program (``pack``) or not, and
    key tiles wholly below the causal edge (the unmasked loop) as well as across it."""
    seq = [a + b for a, b in zip(q_lens, prefix)]
    kc, vc, tables = _paged_cache(device, dtype, seq, Hkv, D, bs)
    T = sum(q_lens)
    q = torch.randn(T, Hq + 2 * Hkv, D, device=device, dtype=dtype)[:, :Hq]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    seq_lens = torch.tensor(seq, dtype=torch.int32, device=device)
    scale = D ** -0.5
    out = prefill_attention(q, kc, vc, tables, cu, seq_lens, max(q_lens), scale, block_m=bm, block_n=bn,
                            pack=1 if pack == "one" else Hq // Hkv)
    exp = prefill_attention_ref(q, kc, vc, tables, cu, seq_lens, scale)
    assert_close(out, exp, ATTN_TOL[dtype], "prefill")


def test_prefill_matches_decode_on_last_token(device):
    """The last row of a prefill equals a decode over the same context: the two kernels agree."""
    kc, vc, tables = _paged_cache(device, torch.float32, [29], 2, 32, 16)
    q = torch.randn(29, 4, 32, device=device)
    cu = torch.tensor([0, 29], dtype=torch.int32, device=device)
    lens = torch.tensor([29], dtype=torch.int32, device=device)
    pre = prefill_attention(q, kc, vc, tables, cu, lens, 29, 0.2, block_m=16, block_n=16)
    dec = paged_decode_attention(q[-1:], kc, vc, tables, lens, 0.2, num_splits=2, block_n=16)
    assert_close(pre[-1:], dec, 1e-5, "prefill last row vs decode")


def test_attention_bad_inputs(device):
    kc = torch.zeros(4, 16, 2, 32, device=device)
    tables = torch.zeros(2, 3, dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_decode_attention(torch.zeros(2, 3, 32, device=device), kc, kc, tables, lens, 1.0)
    with pytest.raises(ValueError, match="context_lens: expected shape"):
        paged_decode_attention(torch.zeros(2, 4, 32, device=device), kc, kc, tables, lens[:1], 1.0)
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_decode_attention(torch.zeros(2, 4, 32, device=device, dtype=torch.float16), kc, kc, tables, lens, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected shape"):
        prefill_attention(torch.zeros(3, 4, 32, device=device), kc, kc, tables,
                          torch.zeros(2, dtype=torch.int32, device=device), lens, 3, 1.0)
    with pytest.raises(ValueError, match="pack=4"):
        prefill_attention(torch.zeros(3, 4, 32, device=device), kc, kc, tables,
                          torch.tensor([0, 1, 3], dtype=torch.int32, device=device), lens, 2, 1.0, pack=4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_tile_map(device, dtype):
    """The tile-map launch (fixed grid, spare entries unused) equals the reference; segments the map leaves out
    are not written, so a graph can size its map for the largest step and reuse it for any smaller one."""
    q_lens, prefix = [21, 1, 40], [8, 30, 0]
    seq = [a + b for a, b in zip(q_lens, prefix)]
    kc, vc, tables = _paged_cache(device, dtype, seq, 2, 32, 8)
    T = sum(q_lens)
    q = torch.randn(T, 4, 32, device=device, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    seq_lens = torch.tensor(seq, dtype=torch.int32, device=device)
    exp = prefill_attention_ref(q, kc, vc, tables, cu, seq_lens, 0.25)
    spare = np.zeros((12, 2), dtype=np.int32)
    tiles = build_prefill_tiles(q_lens, 16, spare)
    assert (tiles[:6, 1] == [2, 1, 1, 0, 0, 0]).all() and (tiles[6:] == [-1, 0]).all()
    for pack in (1, 2):
        out = prefill_attention(q, kc, vc, tables, cu, seq_lens, 0, 0.25, block_m=16, block_n=16,
                                tiles=torch.from_numpy(tiles).to(device), pack=pack)
        assert_close(out, exp, ATTN_TOL[dtype], f"tiled prefill, {pack} heads per program")
    # a map naming only segment 2: the other rows keep what ``out`` held
    only = torch.tensor([[2, 0], [2, 1], [2, 2], [-1, 0]], dtype=torch.int32, device=device)
    out = torch.full_like(q, 7.0)
    prefill_attention(q, kc, vc, tables, cu, seq_lens, 0, 0.25, block_m=16, block_n=16, out=out, tiles=only)
    assert_close(out[22:], exp[22:], ATTN_TOL[dtype], "segment 2")
    assert bool((out[:22] == 7.0).all())
    with pytest.raises(ValueError, match="do not fit"):
        build_prefill_tiles([100], 16, np.zeros((3, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="tiles"):
        prefill_attention(q, kc, vc, tables, cu, seq_lens, 0, 0.25, tiles=only[:, :1])
