"""Store new keys and values into the paged KV cache through a slot mapping.

Paged KV layout (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023): per layer ``k_cache``/``v_cache`` are [num_blocks, block_size, num_kv_heads,
head_dim]. Token t of the step goes to slot s = slot_mapping[t]:

    k_cache[s // block_size, s % block_size] = k[t]      (same for v)

A negative slot means "do not store" (padding tokens of a CUDA-graph batch). One program per token copies all its
KV heads; inputs may be strided views (e.g. slices of a fused qkv projection). An fp8/int8 cache stores
Q(x / s_h) with one scale per KV head (``kv_quant.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strataserve.kernels._common import (check, check_index, check_ndim, check_same_device, next_pow2, pdl_args,
                                        pdl_wait)
from strataserve.kernels.kv_quant import check_kv_scales, quantize_ref, store_value


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
                     k_st, k_sh, v_st, v_sh, c_sb, c_ss, c_sh,
                     H, D, block_size, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     QUANT: tl.constexpr, INT: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        m = (h[:, None] < H) & (d[None, :] < D)
        dst = blk * c_sb + off * c_ss + h[:, None] * c_sh + d[None, :]
        k = tl.load(k_ptr + tok * k_st + h[:, None] * k_sh + d[None, :], mask=m).to(tl.float32)
        v = tl.load(v_ptr + tok * v_st + h[:, None] * v_sh + d[None, :], mask=m).to(tl.float32)
        ks = 1.0
        vs = 1.0
        if QUANT:
            ks = tl.load(ks_ptr + h, mask=h < H, other=1.0)[:, None]
            vs = tl.load(vs_ptr + h, mask=h < H, other=1.0)[:, None]
        store_value(kc_ptr + dst, k, ks, m, QUANT, INT)
        store_value(vc_ptr + dst, v, vs, m, QUANT, INT)


def check_store_kv_args(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> bool:
    """The host checks of the KV store (also used by the fused rotary + store kernel); returns whether the cache is
    quantised (fp8/int8, with per-head scales)."""
    check_ndim("k", k, 3, "[tokens, kv_heads, head_dim]")
    check(v.shape == k.shape, f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    check_ndim("k_cache", k_cache, 4, "[num_blocks, block_size, kv_heads, head_dim]")
    check(v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(),
          "v_cache: must have k_cache's shape and strides")
    T, H, D = k.shape
    check(k_cache.shape[2:] == (H, D), f"k_cache: heads/head_dim {tuple(k_cache.shape[2:])} differ from k's {(H, D)}")
    check(v_cache.dtype == k_cache.dtype, f"caches differ: {k_cache.dtype}/{v_cache.dtype}")
    quant = check_kv_scales(k_cache, k_scale, v_scale)
    check(k.dtype == v.dtype and (quant or k.dtype == k_cache.dtype),
          f"dtypes differ: k {k.dtype}, v {v.dtype}, caches {k_cache.dtype}/{v_cache.dtype}")
    check(k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1, "head_dim must be contiguous everywhere")
    check_index("slot_mapping", slot_mapping)
    check(slot_mapping.shape == (T,), f"slot_mapping: expected shape ({T},), got {tuple(slot_mapping.shape)}")
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    return quant


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write ``k``, ``v`` [T, Hkv, D] into ``k_cache``/``v_cache`` [NB, BS, Hkv, D] at ``slot_mapping`` [T]
    (quantised with ``k_scale``/``v_scale`` [Hkv] for an fp8/int8 cache)."""
    quant = check_store_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    T, H, D = k.shape
    if T == 0:
        return
    _store_kv_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, k_scale if quant else k, v_scale if quant else v,
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                           H, D, k_cache.shape[1], BLOCK_H=next_pow2(H), BLOCK_D=next_pow2(D),
                           QUANT=quant, INT=k_cache.dtype == torch.int8, num_warps=4, **pdl_args(k, T))


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    bs = k_cache.shape[1]
    k, v = k[keep], v[keep]
    if k_scale is not None and v_scale is not None:
        k, v = quantize_ref(k, k_scale, k_cache.dtype), quantize_ref(v, v_scale, v_cache.dtype)
        # through byte views: index_put is not implemented for float8 on every device
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
    k_cache[slots // bs, slots % bs] = k
    v_cache[slots // bs, slots % bs] = v
