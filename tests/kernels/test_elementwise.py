"""RMSNorm, fused add + RMSNorm, SiLU-and-mul against their PyTorch references."""
from __future__ import annotations

import pytest
import torch

from strataserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from strataserve.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from ._helpers import DTYPES, TOL, assert_close, noncontig


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 123), (1, 64), (3, 4, 257)])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm(device, dtype, shape, strided):
    x = torch.randn(shape, device=device, dtype=dtype) * 3
    w = torch.randn(shape[-1], device=device, dtype=dtype)
    if strided and len(shape) == 2:
        x = noncontig(x)
    out = rms_norm(x, w, 1e-6)
    assert out.is_contiguous()
    assert_close(out, rms_norm_ref(x, w, 1e-6), TOL[dtype], "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 123), (7, 256)])
@pytest.mark.parametrize("strided", [False, True])
def test_fused_add_rms_norm_in_place(device, dtype, shape, strided):
    x = torch.randn(shape, device=device, dtype=dtype)
    r = torch.randn(shape, device=device, dtype=dtype)
    w = torch.randn(shape[-1], device=device, dtype=dtype)
    if strided:
        x, r = noncontig(x), noncontig(r)
    exp_out, exp_res = fused_add_rms_norm_ref(x.clone(), r.clone(), w, 1e-5)
    out, res = fused_add_rms_norm(x, r, w, 1e-5)
    assert out.data_ptr() == x.data_ptr() and res.data_ptr() == r.data_ptr()
    assert_close(res, exp_res, TOL[dtype], "residual")
    assert_close(out, exp_out, TOL[dtype], "normed")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 123), (1, 2 * 1500), (2, 3, 2 * 7)])
def test_silu_and_mul(device, dtype, shape):
    x = torch.randn(shape, device=device, dtype=dtype) * 4
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), TOL[dtype], "silu_and_mul")


def test_silu_and_mul_strided_rows(device):
    x = noncontig(torch.randn(6, 2 * 33, device=device))
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), TOL[torch.float32], "silu_and_mul strided")


def test_bad_inputs_say_what_to_change(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="weight: expected shape"):
        rms_norm(x, torch.ones(7, device=device), 1e-6)
    with pytest.raises(ValueError, match="dtype torch.int64 not supported"):
        rms_norm(x.long(), torch.ones(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        rms_norm(x.t(), torch.ones(4, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual: expected shape"):
        fused_add_rms_norm(x, torch.randn(4, 9, device=device), torch.ones(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="last dim must be even"):
        silu_and_mul(torch.randn(3, 5, device=device))
