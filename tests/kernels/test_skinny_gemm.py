"""The few-rows matmul of decode steps against a float32 matmul reference."""
from __future__ import annotations

import pytest
import torch

from strataserve.kernels.activation import silu_and_mul
from strataserve.kernels.skinny_gemm import (GemmConfig, skinny_gemm, skinny_gemm_ref, skinny_gemm_silu_mul,
                                             skinny_gemm_silu_mul_ref)

from ._helpers import DTYPES, assert_close

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("combine", [False, True], ids=["reduce", "combine"])
@pytest.mark.parametrize("M,N,K,split,bias", [
    (16, 64, 256, 1, False),   # whole tiles, one split
    (5, 37, 200, 1, True),     # ragged M, N and K (masked tiles), bias in the epilogue
    (33, 48, 320, 3, True),    # split-K, last range ragged, bias in the reduce
    (20, 32, 128, 8, False),   # more splits asked than K tiles: clamped to 4
])
def test_skinny_gemm(device, dtype, M, N, K, split, bias, combine):
    """Split launches add their partials in a reduce launch or, given tickets, in the tile's last program."""
    x = torch.randn(M, K, device=device, dtype=dtype)
    w = torch.randn(2 * N, K, device=device, dtype=dtype)[::2]  # strided rows, as a fused weight's slice
    b = torch.randn(N, device=device, dtype=dtype) if bias else None
    cfg = GemmConfig(block_m=16, block_n=16, block_k=32, split_k=split)
    tickets = torch.zeros(64, dtype=torch.int32, device=device) if combine else None
    ref = skinny_gemm_ref(x, w, b)
    for rep in range(2):  # the tickets are left at zero, so the same buffer serves the next launch
        got = skinny_gemm(x, w, b, cfg, tickets=tickets)
        assert got.shape == (M, N) and got.dtype == dtype
        assert_close(got, ref, TOL[dtype], f"skinny gemm {M}x{N}x{K} split {split} (launch {rep})")
        if combine:
            assert int(tickets.abs().sum()) == 0


def test_skinny_gemm_strided_rows_and_empty(device):
    """x may be a row-strided view (a slice of a wider activation); zero rows give an empty result."""
    x = torch.randn(6, 96, device=device)[:, :64]
    w = torch.randn(24, 64, device=device)
    assert_close(skinny_gemm(x, w, config=GemmConfig(16, 16, 32)), x @ w.t(), 1e-3, "strided x")
    assert skinny_gemm(x[:0], w).shape == (0, 24)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,inter,K", [(16, 32, 256), (7, 37, 200), (40, 48, 96)])
def test_skinny_gemm_silu_mul(device, dtype, M, inter, K):
    """The SiLU-and-mul epilogue over the fused [gate; up] weight: equal to the matmul then the activation (ragged
    rows, columns and K included); gate and up scaled apart, so a swapped or shifted half fails."""
    x = torch.randn(M, K, device=device, dtype=dtype)
    w = torch.cat([torch.randn(inter, K, device=device, dtype=dtype),
                   0.25 * torch.randn(inter, K, device=device, dtype=dtype) + 0.5])
    cfg = GemmConfig(block_m=16, block_n=16, block_k=32)
    got = skinny_gemm_silu_mul(x, w, cfg)
    assert got.shape == (M, inter) and got.dtype == dtype
    assert_close(got, skinny_gemm_silu_mul_ref(x, w), TOL[dtype], f"gate_up + silu {M}x{inter}x{K}")
    # the same launch configuration unfused: the same accumulators, so only the epilogue's arithmetic differs
    assert_close(got, silu_and_mul(skinny_gemm(x, w, config=cfg)), TOL[dtype] / 10, "fused vs unfused")


def test_skinny_gemm_silu_mul_bad_inputs(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match=r"the \[gate; up\] rows \[2I, K\]"):
        skinny_gemm_silu_mul(x, torch.randn(5, 8, device=device))
    with pytest.raises(ValueError, match="runs unsplit"):
        skinny_gemm_silu_mul(x, torch.randn(4, 8, device=device), GemmConfig(split_k=2))


def test_skinny_gemm_bad_inputs(device):
    w = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"weight: expected \[N, 9\]"):
        skinny_gemm(torch.randn(2, 9, device=device), w)
    with pytest.raises(ValueError, match="expected \\[M, K\\]"):
        skinny_gemm(torch.randn(8, device=device), w)
    with pytest.raises(ValueError, match="bias: expected"):
        skinny_gemm(torch.randn(2, 8, device=device), w, torch.randn(5, device=device))
    with pytest.raises(ValueError, match="config: invalid"):
        skinny_gemm(torch.randn(2, 8, device=device), w, config=GemmConfig(split_k=0))
    with pytest.raises(ValueError, match="tickets: expected int32 zeros"):
        skinny_gemm(torch.randn(2, 64, device=device), torch.randn(40, 64, device=device),
                    config=GemmConfig(16, 16, 16, split_k=2), tickets=torch.zeros(2, dtype=torch.int32, device=device))
