"""Shared constants and assertions of the kernel tests (the device is chosen in conftest.py)."""
from __future__ import annotations

import os

import torch

DEVICE = os.environ.get("STRATA_TEST_DEVICE", "cpu")

# The interpreter runs kernels through numpy: no bf16 arithmetic there, so CPU runs check float32 only.
DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.float16, torch.bfloat16]
# rtol/atol per dtype (the elementwise ops); attention gets a little more (long sums, p rounded to dtype)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
ATTN_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """Like torch.testing.assert_close, but the message says how many elements mismatch and the worst error."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.float(), expected.float()
    assert not torch.isnan(a).any(), f"{what}: NaN in output"
    bad = (a - e).abs() > tol + tol * e.abs()
    n = int(bad.sum())
    if n:
        err = (a - e).abs().max().item()
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {n}/{a.numel()} elements mismatch (tol {tol}); max abs err {err:.3g}; "
                             f"first at {idx}: {a[tuple(idx)].item()} vs {e[tuple(idx)].item()}")


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values, row stride padded: a strided view with a contiguous last dim."""
    pad = torch.empty(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype, device=t.device).fill_(float("nan"))
    pad[..., : t.shape[-1]] = t
    return pad[..., : t.shape[-1]]
