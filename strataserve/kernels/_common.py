"""Shared by the kernels: argument checks for the host wrappers (each failure is a ValueError that says what to
change), and small device helpers."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_float(name: str, t: torch.Tensor) -> None:
    check(t.dtype in FLOAT_DTYPES, f"{name}: dtype {t.dtype} not supported; use float32, float16 or bfloat16")


def check_index(name: str, t: torch.Tensor) -> None:
    check(t.dtype in INDEX_DTYPES, f"{name}: dtype {t.dtype} not supported; use int32 or int64")


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    check(t.dim() == ndim, f"{name}: expected {ndim} dims {layout}, got shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devs = {name: t.device for name, t in tensors.items()}
    check(len(set(devs.values())) == 1, f"all tensors must be on one device, got {devs}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    check(t.stride(-1) == 1 or t.shape[-1] == 1,
          f"{name}: the last dimension must be contiguous (stride 1), got strides {t.stride()}; call .contiguous()")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """tl.dot; for float32 inputs (IEEE) in full precision, since tl.dot's float32 default is tf32 on GPUs."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)
