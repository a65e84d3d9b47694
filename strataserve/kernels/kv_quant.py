"""Quantised KV storage (fp8 e4m3, int8) with one scale per layer and KV head: the shared math of the KV store and
both attention kernels, and its PyTorch reference.

A cached value x of KV head h is stored as q = Q(x / s_h) and read back as x' = q * s_h, where Q is
- fp8 e4m3 (``torch.float8_e4m3fn``): clamp to [-448, 448], round to 3 mantissa bits (nearest, ties to even);
- int8: clamp(round(x / s_h), -127, 127) (symmetric, round half away from zero).

The attention kernels never materialise x': q and int8/fp8 values convert exactly to fp16/bf16/fp32, so K's scale
is folded into the softmax scale (q · k' = s_h (q · k)) and V's into the output (sum_j p_j v'_j = s_h sum_j p_j v_j).

Reading a quantised tile in the decode kernel (``load_tile``; the prefill kernel converts the loaded tile, see
there): the cache is read as int32 words of four values each, unpacked into four float16 tensors and interleaved
back into [rows, head_dim] with join/reshape. Converting the plain fp8/int8 tile instead lets Triton sink the
conversion after its shared-memory stage, where it reads the transposed V operand byte by byte (LDS.U8) and
converts fp8 to bf16 through fp16 one value at a time: ~4x the instructions per byte of the bf16 path, which made
the quantised decode kernel instruction-bound and slower than bf16 (device run 7). Unpacked first, the float16
tile takes the bf16 path's ldmatrix route (sm_90 SASS, ``benchmarks/kernel_sass.py``: 999 -> 460 instructions
per 64-row loop iteration for fp8, 1,026 -> 559 for int8). On CUDA the unpacking is inline PTX: the hardware's
pair conversion ``cvt.rn.f16x2.e4m3x2`` (sm_89+) and, for int8, the magic-number trick: byte ^ 0x80 placed under
the float16 exponent of 1024 reads as 1024 + 128 + x, minus 1152 is x exactly. Elsewhere (the interpreter; fp8
before sm_89, which the engine refuses anyway) the same unpacking is plain Triton casts, value by value. float16
holds every e4m3 and int8 value exactly.

fp8 rounding is done with integer arithmetic on the float32 bits before the cast (the standard round-to-nearest-
even bit trick), so the cast itself is exact: Triton's interpreter (the CPU test path) mis-rounds float32 -> fp8
when the mantissa carries into the exponent (1.96 became 1.0), while the GPU cast already rounds this way.
"""
from __future__ import annotations

import functools

import torch
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


@triton.jit
def _unpack_words(w, INT: tl.constexpr, ASM: tl.constexpr):
    """int32 words -> four float16 tensors: bytes 0, 1, 2, 3 of each word as e4m3 (``INT`` False) or int8."""
    if ASM:
        if INT:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, m, p, q; xor.b32 t, $4, 0x80808080; mov.b32 m, 0x64806480; "
                "prmt.b32 p, t, 0x64646464, 0x5140; prmt.b32 q, t, 0x64646464, 0x7362; "
                "sub.f16x2 p, p, m; sub.f16x2 q, q, m; mov.b32 {$0, $1}, p; mov.b32 {$2, $3}, q; }",
                "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 p, q; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 p, lo; "
            "cvt.rn.f16x2.e4m3x2 q, hi; mov.b32 {$0, $1}, p; mov.b32 {$2, $3}, q; }",
            "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    if INT:  # shift the byte to the top, then an arithmetic shift sign-extends it
        return (((w << 24) >> 24).to(tl.float16), ((w << 16) >> 24).to(tl.float16),
                ((w << 8) >> 24).to(tl.float16), (w >> 24).to(tl.float16))
    return ((w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16),
            ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16),
            ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16),
            ((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16))


@triton.jit
def load_tile(ptr, row, offs_w, mask, INT: tl.constexpr, ASM: tl.constexpr):
    """The unscaled float16 values [R, 4 * W] of a quantised cache tile whose int32 words are at
    ``ptr + row[:, None] + offs_w[None, :]`` (``offs_w`` [W], ``mask`` [R, W]; masked words read as zeros)."""
    a, b, c, d = _unpack_words(tl.load(ptr + row[:, None] + offs_w[None, :], mask=mask, other=0), INT, ASM)
    # [R, W, 2, 2] with element (j, x, t) = value 4j + 2x + t, so the row-major reshape keeps the cache's order
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), (row.shape[0], offs_w.shape[0] * 4))


@functools.cache
def _asm_ok(device: torch.device, is_int: bool) -> bool:
    """Whether ``_unpack_words``'s inline PTX runs here: NVIDIA GPUs; fp8's pair conversion needs sm_89+."""
    return device.type == "cuda" and torch.version.hip is None and (
        is_int or torch.cuda.get_device_capability(device) >= (8, 9))


def word_view(cache: torch.Tensor) -> tuple[torch.Tensor, bool, bool]:
    """A quantised cache as ``load_tile`` reads it: (int32 view, INT, ASM). head_dim must be a multiple of 4
    (checked by the kernels)."""
    is_int = cache.dtype == torch.int8
    return cache.view(torch.int32), is_int, _asm_ok(cache.device, is_int)
