"""Row-wise argmax against ``torch.argmax``: the same index in every case, ties and NaN included."""
from __future__ import annotations

import pytest
import torch

from strataserve.kernels.argmax import argmax_rows, argmax_rows_ref

from ._helpers import DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,V,block", [(3, 1000, 64), (1, 5, 16), (4, 4096, 1024), (2, 1031, 128)])
def test_argmax_random(device, dtype, B, V, block):
    x = torch.randn(B, V, device=device, dtype=dtype) * 4
    assert torch.equal(argmax_rows(x, block), argmax_rows_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_ties_nan_inf(device, dtype):
    """Ties inside a chunk and across chunks keep the first index; a NaN wins (the first one); all -inf gives 0;
    a strided row view (a graph's padded logits) is read in place."""
    x = torch.randn(6, 300, device=device, dtype=dtype)
    x[0, 250] = x[0, 7] = x[0, 70] = 50.0                  # across chunks of 64: the first
    x[1, 130] = x[1, 131] = 50.0                          # inside one chunk
    x[2, 200], x[2, 10], x[2, 280] = 50.0, float("nan"), float("nan")  # NaN beats the max
    x[3] = float("-inf")
    x[4, 299] = float("inf")                              # the last entry of a ragged chunk
    x[5, 100] = float("inf")
    x[5, 40] = float("inf")
    want = torch.tensor([7, 130, 10, 0, 299, 40], device=device)
    got = argmax_rows(x, 64)
    assert torch.equal(got, want) and torch.equal(got, argmax_rows_ref(x))
    wide = torch.randn(3, 512, device=device, dtype=dtype)
    assert torch.equal(argmax_rows(wide[:, :300], 64), argmax_rows_ref(wide[:, :300]))


def test_argmax_bad_inputs(device):
    with pytest.raises(ValueError, match=r"expected \[B, V\]"):
        argmax_rows(torch.randn(8, device=device))
    with pytest.raises(ValueError, match="dtype torch.int64 not supported"):
        argmax_rows(torch.zeros(2, 8, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        argmax_rows(torch.randn(8, 4, device=device).t())
    with pytest.raises(ValueError, match="power of two"):
        argmax_rows(torch.randn(2, 8, device=device), block=48)
    assert argmax_rows(torch.randn(0, 8, device=device)).shape == (0,)
