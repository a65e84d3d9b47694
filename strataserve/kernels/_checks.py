"""Argument checks shared by the kernel host wrappers: each failure is a ValueError that says what to change."""
from __future__ import annotations

import torch

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


def dot_precision(dtype: torch.dtype) -> str:
    """float32 tl.dot defaults to tf32 on GPUs; ask for full precision so fp32 matches the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"
