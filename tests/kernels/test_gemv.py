"""Single-row GEMV against a float32 matmul reference."""
from __future__ import annotations

import pytest
import torch

from strataserve.kernels.gemv import GemvConfig, gemv, gemv_ref

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
    """K cut into ranges (the last one ragged; more splits than K tiles clamps), partials reduced in order."""
    x = torch.randn(1, K, device=device, dtype=dtype)
    w = torch.randn(N, K, device=device, dtype=dtype)
    b = torch.randn(N, device=device, dtype=dtype) if bias else None
    got = gemv(x, w, b, GemvConfig(block_n=8, block_k=64, split_k=split))
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
