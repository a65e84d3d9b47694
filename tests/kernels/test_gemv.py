"""Single-row GEMV against a float32 matmul reference."""
from __future__ import annotations

import pytest
import torch

from strataserve.kernels.activation import silu_and_mul_ref
from strataserve.kernels.gemv import GemvConfig, gemv, gemv_ref, gemv_rms_norm, gemv_silu_mul
from strataserve.kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref

from ._helpers import DTYPES, assert_close

GEMV_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,bias,flat", [(37, 123, False, False), (5, 1100, True, False), (64, 64, True, True)])
def test_gemv(device, dtype, N, K, bias, flat):
    x = torch.randn(K if flat else (1, K), device=device, dtype=dtype)
    w = torch.randn(2 * N, K, device=device, dtype=dtype)[::2]  # strided rows
    b = torch.randn(N, device=device, dtype=dtype) if bias else None
    assert_close(gemv(x, w, b, GemvConfig(block_k=256)), gemv_ref(x, w, b), GEMV_TOL[dtype], "gemv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,split,bias", [(37, 1100, 3, True), (19, 300, 2, False), (8, 64, 4, True)])
def test_gemv_split_k(device, dtype, N, K, split, bias):
    """K cut into ranges (the last one ragged; more splits than K tiles clamps), partials reduced in order; with
    ``split`` tiles in flight (cp.async pipelining on a GPU)."""
    x = torch.randn(1, K, device=device, dtype=dtype)
    w = torch.randn(N, K, device=device, dtype=dtype)
    b = torch.randn(N, device=device, dtype=dtype) if bias else None
    got = gemv(x, w, b, GemvConfig(block_n=8, block_k=64, split_k=split, num_stages=split,
                                 evict_first=split == 3))
    assert_close(got, gemv_ref(x, w, b), GEMV_TOL[dtype], "split-K gemv")


def test_gemv_bad_inputs(device):
    w = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="use F.linear for more rows"):
        gemv(torch.randn(2, 8, device=device), w)
    with pytest.raises(ValueError, match=r"weight: expected \[N, 9\]"):
        gemv(torch.randn(1, 9, device=device), w)
    with pytest.raises(ValueError, match="bias: expected"):
        gemv(torch.randn(1, 8, device=device), w, torch.randn(5, device=device))
    with pytest.raises(ValueError, match="config: invalid"):
        gemv(torch.randn(1, 8, device=device), w, config=GemvConfig(split_k=0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,split,add,bias", [(37, 300, 1, True, False), (19, 1100, 3, True, True),
                                                (24, 256, 2, False, False), (16, 200, 1, False, True)])
def test_gemv_rms_norm_prologue(device, dtype, N, K, split, add, bias):
    """linear(rms_norm(x + residual)): the sum written out once (row block 0 of every split), inputs untouched.
    Split-K (statistics in a pre-pass) rounds the normalised x to the dtype as the separate norm kernel does; one
    split (statistics in the main loop, the row sums scaled at the end) keeps it in float32, so its reference is
    the same math without those two roundings (in bf16 they alone move ~10% of these outputs past the tolerance,
    run 17)."""
    x = torch.randn(1, K, device=device, dtype=dtype)
    r = torch.randn(1, K, device=device, dtype=dtype) if add else None
    nw = torch.rand(K, device=device, dtype=dtype) + 0.5
    w = torch.randn(N, K, device=device, dtype=dtype)
    b = torch.randn(N, device=device, dtype=dtype) if bias else None
    x0, r0 = x.clone(), None if r is None else r.clone()
    y, s = gemv_rms_norm(x, r, nw, 1e-5, w, b, GemvConfig(block_n=8, block_k=64, split_k=split, num_stages=split + 1))
    if add:
        normed, want_s = fused_add_rms_norm_ref(x0, r0, nw, 1e-5)
        assert torch.equal(s, want_s) and s.data_ptr() not in (x.data_ptr(), r.data_ptr())
        assert torch.equal(r, r0)
    else:
        normed, want_s = rms_norm_ref(x0, nw, 1e-5), x0
        assert s is x
    assert torch.equal(x, x0)
    if split == 1:
        sf = want_s.float()
        normed = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.float()
        want = (normed @ w.float().t() + (b.float() if bias else 0.0)).to(dtype)
    else:
        want = gemv_ref(normed, w, b)
    assert_close(y, want, GEMV_TOL[dtype], "gemv with rms_norm prologue")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,split", [(37, 300, 1), (16, 700, 2)])
def test_gemv_silu_mul_prologue(device, dtype, N, K, split):
    x = torch.randn(1, 2 * K, device=device, dtype=dtype)
    w = torch.randn(N, K, device=device, dtype=dtype)
    y = gemv_silu_mul(x, w, config=GemvConfig(block_n=8, block_k=64, split_k=split, num_stages=3))
    assert_close(y, gemv_ref(silu_and_mul_ref(x), w), GEMV_TOL[dtype], "gemv with silu_mul prologue")


def test_gemv_prologue_bad_inputs(device):
    w = torch.randn(4, 8, device=device)
    x = torch.randn(1, 8, device=device)
    with pytest.raises(ValueError, match="norm_weight: expected"):
        gemv_rms_norm(x, None, torch.ones(7, device=device), 1e-5, w)
    with pytest.raises(ValueError, match="residual: expected"):
        gemv_rms_norm(x, torch.randn(1, 7, device=device), torch.ones(8, device=device), 1e-5, w)
    with pytest.raises(ValueError, match="use F.linear for more rows"):
        gemv_rms_norm(torch.randn(2, 8, device=device), None, torch.ones(8, device=device), 1e-5, w)
    with pytest.raises(ValueError, match=r"weight: expected \[N, 4\] \(half of x's \[gate \| up\] width 8\)"):
        gemv_silu_mul(x, w)  # [gate | up] of width 8 needs K = 4
    with pytest.raises(ValueError, match=r"weight: expected \[N, 8\], got \(4, 7\)"):
        gemv_rms_norm(x, None, torch.ones(8, device=device), 1e-5, torch.randn(4, 7, device=device))
