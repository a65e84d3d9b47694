"""Rotary (+ Qwen3 q/k RMSNorm) and the paged KV store in one kernel: the decoder's step between the qkv
projection and attention, one launch per layer instead of two (four with the q/k norm run separately).

Math: ``rotary.py`` (neox rotation of q and k, optional per-head RMSNorm first) and ``kv_cache.py`` (token t's
k and v go to slot s = slot_mapping[t]: block s // block_size, row s % block_size; s < 0 = store nothing).
Here q is rotated in place, while the rotated k is written straight into the cache slot (k itself is left as
it was: the Triton attention kernels read keys only from the cache), and v is copied into its slot.

One program per (token, group of heads): a decode step has few tokens, and one program per token left a batch-1
step's launch to a single SM walking 40 heads one after another; small groups spread it over many SMs, while
long prefill chunks take larger groups (fewer, fuller programs). The rotation covers the whole head
(rot_dim == head_dim, checked), so the store writes every feature of k. An fp8/int8 cache gets the rotated k and
the v quantised with their per-head scales (``kv_quant.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strataserve.kernels._common import check, pdl_args, pdl_wait
from strataserve.kernels.kv_cache import check_store_kv_args, store_kv_ref
from strataserve.kernels.kv_quant import store_value
from strataserve.kernels.rotary import (apply_rotary_ref, as_heads, check_rotary_args, rope_constants,
                                        rope_heads, rotary_launch_args)


# up to this many tokens (decode-sized steps), groups of at most this many heads per program
_SMALL_T, _SMALL_T_HEADS = 512, 4


@triton.jit
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cache_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr,
                            ks_ptr, vs_ptr,
                            q_st, q_sh, k_st, k_sh, v_st, v_sh, cache_stride, c_sb, c_ss, c_sh,
                            n_q_heads, n_k_heads, D, HALF, eps, block_size,
                            HAS_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_D: tl.constexpr, QUANT: tl.constexpr, INT: tl.constexpr, PDL: tl.constexpr):
    """Program (t, g): token t's group g of BLOCK_H heads; the first cdiv(Hq, BLOCK_H) groups are q heads, the
    rest k heads (rotated into the cache, with the same heads of v copied beside them)."""
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    n_qg = tl.cdiv(n_q_heads, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_H)
    cos, sin, qw1, qw2, kw1, kw2 = rope_constants(pos_ptr, cache_ptr, qw_ptr, kw_ptr, tok, cache_stride, HALF,
                                                  offs_r, HAS_NORM)
    if g < n_qg:
        h0 = g * BLOCK_H
        rope_heads(q_ptr, tok * q_st, q_sh, q_ptr, tok * q_st, q_sh, h0, tl.minimum(h0 + BLOCK_H, n_q_heads),
                   cos, sin, qw1, qw2, eps, D, HALF, offs_h, offs_r, HAS_NORM, BLOCK_H)
    else:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            h0 = (g - n_qg) * BLOCK_H
            h1 = tl.minimum(h0 + BLOCK_H, n_k_heads)
            dst = (slot // block_size) * c_sb + (slot % block_size) * c_ss
            rope_heads(k_ptr, tok * k_st, k_sh, kc_ptr, dst, c_sh, h0, h1, cos, sin, kw1, kw2, eps, D, HALF,
                       offs_h, offs_r, HAS_NORM, BLOCK_H, ks_ptr, QUANT, INT)
            h = h0 + offs_h
            d = tl.arange(0, BLOCK_D)
            m = (h[:, None] < h1) & (d[None, :] < D)
            v = tl.load(v_ptr + tok * v_st + h[:, None] * v_sh + d[None, :], mask=m).to(tl.float32)
            vs = 1.0
            if QUANT:
                vs = tl.load(vs_ptr + h, mask=h < h1, other=1.0)[:, None]
            store_value(vc_ptr + dst + h[:, None] * c_sh + d[None, :], v, vs, m, QUANT, INT)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, head_dim: int | None = None,
                    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                    eps: float = 1e-6, heads_per_program: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``q`` [T, Hq, D] in place; write rotated ``k`` and ``v`` [T, Hkv, D] into the paged caches
    [NB, BS, Hkv, D] at ``slot_mapping`` [T] (2-D [T, H*D] views accepted with ``head_dim``). With both norm
    weights [D], Qwen3's per-head RMSNorm comes first. ``k`` is not modified. Returns ``q``.
    ``heads_per_program`` (a power of two) overrides the launch's head grouping. ``k_scale``/``v_scale`` [Hkv]:
    the per-head scales of an fp8/int8 cache."""
    q3, k3, has_norm = check_rotary_args(q, k, positions, cos_sin_cache, head_dim, q_norm_weight, k_norm_weight)
    T, _, D = q3.shape
    check(cos_sin_cache.shape[1] == D,
          f"rotary_store_kv rotates whole heads: rot_dim {cos_sin_cache.shape[1]} must equal head_dim {D}")
    v3 = as_heads("v", v, D)
    quant = check_store_kv_args(k3, v3, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if T == 0:
        return q
    half, block_r, block_h = rotary_launch_args(q3, k3, cos_sin_cache)
    if heads_per_program is not None:
        check(heads_per_program >= 1 and heads_per_program & (heads_per_program - 1) == 0,
              f"heads_per_program={heads_per_program}: must be a power of two")
        block_h = heads_per_program
    elif T <= _SMALL_T:
        block_h = min(block_h, _SMALL_T_HEADS)
    qw = q_norm_weight if has_norm else cos_sin_cache
    kw = k_norm_weight if has_norm else cos_sin_cache
    groups = triton.cdiv(q3.shape[1], block_h) + triton.cdiv(k3.shape[1], block_h)
    _rotary_store_kv_kernel[(T, groups)](
        q3, k3, v3, positions, cos_sin_cache, qw, kw, k_cache, v_cache, slot_mapping, k_scale if quant else q3,
        v_scale if quant else q3,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        q3.shape[1], k3.shape[1], D, half, eps, k_cache.shape[1],
        HAS_NORM=has_norm, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(D), QUANT=quant,
        INT=k_cache.dtype == torch.int8, num_warps=4, **pdl_args(q3, T))
    return q


def rotary_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                        k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference on [T, H, D] tensors: the rotated q (returned; q itself untouched) and the caches written."""
    rq, rk = apply_rotary_ref(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps)
    store_kv_ref(rk, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return rq
