"""Quantised KV storage (fp8 e4m3, int8) with one scale per layer and KV head: the shared math of the KV store and
both attention kernels, and its PyTorch reference.

A cached value x of KV head h is stored as q = Q(x / s_h) and read back as x' = q * s_h, where Q is
- fp8 e4m3 (``torch.float8_e4m3fn``): clamp to [-448, 448], round to 3 mantissa bits (nearest, ties to even);
- int8: clamp(round(x / s_h), -127, 127) (symmetric, round half away from zero).

The attention kernels never materialise x': q and int8/fp8 values convert exactly to fp16/bf16/fp32, so K's scale
is folded into the softmax scale (q · k' = s_h (q · k)) and V's into the output (sum_j p_j v'_j = s_h sum_j p_j v_j).

fp8 rounding is done with integer arithmetic on the float32 bits before the cast (the standard round-to-nearest-
even bit trick), so the cast itself is exact: Triton's interpreter (the CPU test path) mis-rounds float32 -> fp8
when the mantissa carries into the exponent (1.96 became 1.0), while the GPU cast already rounds this way.
"""
from __future__ import annotations

import triton
import triton.language as tl

# the PyTorch side, re-exported so kernels and tests import one module
from strataserve.kernels.kv_quant_ref import (FP8, KV_QUANT_DTYPES, QMAX, check_kv_scales,  # noqa: F401
                                              dequantize_ref, is_quantized, quantize_ref)


@triton.jit
def quantize(x, scale, INT: tl.constexpr):
    """float32 ``x`` / ``scale`` clamped and rounded to the storage grid (still float32; the cast is exact)."""
    if INT:
        y = x / scale
        y = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y))
        return tl.minimum(tl.maximum(y, -127.0), 127.0)
    y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 of 23 mantissa bits, nearest even
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def store_value(ptr, x, scale, mask, QUANT: tl.constexpr, INT: tl.constexpr):
    """Store float32 ``x`` into the cache at ``ptr``: quantised with ``scale`` (per head) or cast."""
    if QUANT:
        x = quantize(x, scale, INT)
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)
