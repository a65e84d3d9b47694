"""The PyTorch side of the fp8/int8 KV cache (no triton needed: the CPU attention path uses it): storage dtypes,
argument checks, and the reference quantise / dequantise. The math is in ``kv_quant.py``."""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
#: the storage dtype of each quantised ``kv_cache_dtype`` name
KV_QUANT_DTYPES: dict[str, torch.dtype] = {"fp8": FP8, "int8": torch.int8}
#: the largest stored magnitude
QMAX: dict[torch.dtype, float] = {FP8: 448.0, torch.int8: 127.0}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_kv_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """A quantised cache [NB, BS, Hkv, D] needs float32 scales [Hkv] on its device; a float cache takes none.
    Returns whether the cache is quantised."""
    quant = is_quantized(cache.dtype)
    if not quant:
        _check(k_scale is None and v_scale is None, f"k_scale/v_scale: only for an fp8/int8 cache, not {cache.dtype}")
        return False
    hkv = cache.shape[2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check(s is not None, f"{name}: a {cache.dtype} KV cache needs per-head scales (float32 [{hkv}])")
        assert s is not None
        _check(s.dtype == torch.float32 and s.shape == (hkv,) and s.stride(0) == 1,
               f"{name}: expected contiguous float32 [{hkv}], got {s.dtype} {tuple(s.shape)}")
        _check(s.device == cache.device, f"{name}: on {s.device}, the cache on {cache.device}")
    return True


def quantize_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` [..., Hkv, D] -> ``dtype`` values of x / scale[h] (see ``kv_quant.py``)."""
    y = x.float() / scale[:, None]
    if dtype == torch.int8:
        return (y.sign() * (y.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)
    return y.clamp(-448.0, 448.0).to(dtype)


def dequantize_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored values [..., Hkv, D] -> ``dtype`` (x * scale[h])."""
    return (x.float() * scale[:, None]).to(dtype)
