"""Rotary position embedding applied in place to q and k, neox (rotate-half) style, with optional Qwen3 q/k-norm.

RoPE (Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021). For a head vector x
whose first ``rot_dim`` features rotate, split x = [x1 | x2] with x1, x2 of width r = rot_dim / 2; at position p
with inverse frequencies f_i = base ** (-2i / rot_dim):

    x1' = x1 * cos(p f) - x2 * sin(p f)
    x2' = x2 * cos(p f) + x1 * sin(p f)

The cos/sin table ``cos_sin_cache`` [max_pos, rot_dim] holds cos(p f) in its first half and sin(p f) in its
second (float32); ``strataserve.models.rope.build_cos_sin_cache`` makes it, Llama 3's frequency rescaling
included, so the kernel is indifferent to the scaling.

Qwen3 normalises each head with RMSNorm (a learnt weight of width head_dim) before the rotation; with
``q_norm_weight``/``k_norm_weight`` the kernel does both in one pass over q and k (the norm needs the whole head,
which the rotation loads anyway), saving two reads and two writes of q and k.

One program per token; it loops over that token's heads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strataserve.kernels._common import (check, check_float, check_index, check_ndim, check_same_device,
                                         next_pow2, pdl_args, pdl_wait)
from strataserve.kernels.kv_quant import store_value


@triton.jit
def rope_heads(x_ptr, x_off, x_sh, o_ptr, o_off, o_sh, h_start, h_end, cos, sin, w1, w2, eps, D, HALF, offs_h,
               offs_r, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, s_ptr=None, QUANT: tl.constexpr = False,
               INT: tl.constexpr = False):
    """Heads [h_start, h_end) of one token: read at x_ptr + x_off + h * x_sh, (norm,) rotate, write at o_ptr +
    o_off + h * o_sh (the same place for the in-place rotary; a KV-cache slot for the fused store, quantised with
    the per-head scales at ``s_ptr`` when ``QUANT``)."""
    for h0 in range(h_start, h_end, BLOCK_H):
        heads = h0 + offs_h
        hmask = heads < h_end
        src = x_ptr + x_off + heads[:, None] * x_sh
        dst = o_ptr + o_off + heads[:, None] * o_sh
        m = hmask[:, None] & (offs_r[None, :] < HALF)
        x1 = tl.load(src + offs_r[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + offs_r[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_NORM:
            # rot_dim == head_dim is checked on the host, so x1 and x2 together are the whole head
            inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
            x1 = (x1 * inv[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
            x2 = (x2 * inv[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
            x1 = (x1 * w1[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
            x2 = (x2 * w2[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        sc = 1.0
        if QUANT:
            sc = tl.load(s_ptr + heads, mask=hmask, other=1.0)[:, None]
        store_value(dst + offs_r[None, :], o1, sc, m, QUANT, INT)
        store_value(dst + HALF + offs_r[None, :], o2, sc, m, QUANT, INT)


@triton.jit
def rope_operands(x_ptr, x_sh, heads, hmask, offs_d, pos, cache_ptr, cache_stride, w_ptr, D, HALF,
                  HAS_NORM: tl.constexpr):
    """The loads of ``rope_tile`` (float32): heads ``heads`` of one token [heads, BLOCK_D], each feature's partner
    d +- HALF (a second, cached load), cos and signed sin at ``pos``, the norm weight and its partner. Apart from
    ``rope_apply`` so a kernel can issue them early and rotate later."""
    low = offs_d < HALF
    partner = tl.where(low, offs_d + HALF, offs_d - HALF)
    j = tl.where(low, offs_d, offs_d - HALF)
    dmask = offs_d < D
    cos = tl.load(cache_ptr + pos * cache_stride + j, mask=dmask, other=0.0)[None, :]
    sin = tl.load(cache_ptr + pos * cache_stride + HALF + j, mask=dmask, other=0.0)
    sin = tl.where(low, -sin, sin)[None, :]  # x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin
    m = hmask[:, None] & dmask[None, :]
    src = x_ptr + heads[:, None] * x_sh
    x = tl.load(src + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(src + partner[None, :], mask=m, other=0.0).to(tl.float32)
    w = cos  # placeholders without the norm (never read)
    wp = cos
    if HAS_NORM:
        w = tl.load(w_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=dmask, other=0.0).to(tl.float32)[None, :]
    return x, xp, cos, sin, w, wp


@triton.jit
def rope_apply(x, xp, cos, sin, w, wp, eps, D, dt: tl.constexpr, HAS_NORM: tl.constexpr):
    """(Norm and) rotate ``rope_operands``' heads, rounding to ``dt`` as ``rope_heads`` does; float32 out."""
    if HAS_NORM:
        inv = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
        x = ((x * inv).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        xp = ((xp * inv).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
    return x * cos + xp * sin


@triton.jit
def rope_tile(x_ptr, x_sh, heads, hmask, offs_d, pos, cache_ptr, cache_stride, w_ptr, eps, D, HALF,
              HAS_NORM: tl.constexpr):
    """Heads ``heads`` of one token, whole (rot_dim == head_dim), as a float32 [heads, BLOCK_D] tile: (norm,)
    rotated at position ``pos``, rounded as ``rope_heads`` rounds them, not stored: for a kernel that goes on to
    use the rotated heads (decode attention). The tile keeps the head's layout (no split into halves)."""
    x, xp, cos, sin, w, wp = rope_operands(x_ptr, x_sh, heads, hmask, offs_d, pos, cache_ptr, cache_stride, w_ptr,
                                           D, HALF, HAS_NORM)
    return rope_apply(x, xp, cos, sin, w, wp, eps, D, x_ptr.dtype.element_ty, HAS_NORM)


@triton.jit
def rope_constants(pos_ptr, cache_ptr, qw_ptr, kw_ptr, tok, cache_stride, HALF, offs_r, HAS_NORM: tl.constexpr):
    """Token ``tok``'s cos and sin halves, and the two halves of the q and k norm weights (float32)."""
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    rmask = offs_r < HALF
    cos = tl.load(cache_ptr + pos * cache_stride + offs_r, mask=rmask, other=0.0)
    sin = tl.load(cache_ptr + pos * cache_stride + HALF + offs_r, mask=rmask, other=0.0)
    # placeholders when there is no norm (never read)
    qw1 = cos
    qw2 = cos
    kw1 = cos
    kw2 = cos
    if HAS_NORM:
        qw1 = tl.load(qw_ptr + offs_r, mask=rmask, other=0.0).to(tl.float32)
        qw2 = tl.load(qw_ptr + HALF + offs_r, mask=rmask, other=0.0).to(tl.float32)
        kw1 = tl.load(kw_ptr + offs_r, mask=rmask, other=0.0).to(tl.float32)
        kw2 = tl.load(kw_ptr + HALF + offs_r, mask=rmask, other=0.0).to(tl.float32)
    return cos, sin, qw1, qw2, kw1, kw2


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr, qw_ptr, kw_ptr,
                   q_stride_t, q_stride_h, k_stride_t, k_stride_h, cache_stride,
                   n_q_heads, n_k_heads, D, HALF, eps,
                   HAS_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_H)
    cos, sin, qw1, qw2, kw1, kw2 = rope_constants(pos_ptr, cache_ptr, qw_ptr, kw_ptr, tok, cache_stride, HALF,
                                                  offs_r, HAS_NORM)
    rope_heads(q_ptr, tok * q_stride_t, q_stride_h, q_ptr, tok * q_stride_t, q_stride_h, 0, n_q_heads, cos, sin,
               qw1, qw2, eps, D, HALF, offs_h, offs_r, HAS_NORM, BLOCK_H)
    rope_heads(k_ptr, tok * k_stride_t, k_stride_h, k_ptr, tok * k_stride_t, k_stride_h, 0, n_k_heads, cos, sin,
               kw1, kw2, eps, D, HALF, offs_h, offs_r, HAS_NORM, BLOCK_H)


def as_heads(name: str, t: torch.Tensor, head_dim: int | None) -> torch.Tensor:
    """Accept [T, H, D] or [T, H*D] (with ``head_dim``) and return a [T, H, D] view of the same memory."""
    if t.dim() == 2:
        check(head_dim is not None and t.shape[1] % head_dim == 0,
              f"{name}: a 2-D tensor [tokens, heads*head_dim] needs head_dim dividing {t.shape[1]}")
        check(t.stride(1) == 1, f"{name}: last dim must be contiguous, got strides {t.stride()}")
        return t.view(t.shape[0], t.shape[1] // head_dim, head_dim) if t.is_contiguous() else \
            t.as_strided((t.shape[0], t.shape[1] // head_dim, head_dim), (t.stride(0), head_dim, 1))
    check_ndim(name, t, 3, "[tokens, heads, head_dim]")
    check(t.stride(2) == 1, f"{name}: head_dim must be contiguous, got strides {t.stride()}")
    return t


def check_rotary_args(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      head_dim: int | None, q_norm_weight: torch.Tensor | None,
                      k_norm_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The host checks of the rotary kernels; returns q and k as [T, H, D] views and whether the norm is fused."""
    q3, k3 = as_heads("q", q, head_dim), as_heads("k", k, head_dim)
    check_float("q", q)
    check(k.dtype == q.dtype, f"k: dtype {k.dtype} differs from q's {q.dtype}")
    check(q3.shape[0] == k3.shape[0] and q3.shape[2] == k3.shape[2],
          f"q {tuple(q3.shape)} and k {tuple(k3.shape)}: token count and head_dim must agree")
    T, _, D = q3.shape
    check_index("positions", positions)
    check(positions.shape == (T,), f"positions: expected shape ({T},), got {tuple(positions.shape)}")
    check_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_pos, rot_dim]")
    check(cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1,
          "cos_sin_cache: must be float32 with a contiguous last dim")
    rot = cos_sin_cache.shape[1]
    check(rot % 2 == 0 and rot <= D, f"cos_sin_cache: rot_dim {rot} must be even and <= head_dim {D}")
    has_norm = q_norm_weight is not None or k_norm_weight is not None
    if has_norm:
        check(q_norm_weight is not None and k_norm_weight is not None, "give both q_norm_weight and k_norm_weight")
        check(rot == D, f"fused q/k norm needs rot_dim == head_dim, got {rot} and {D}")
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            check(w.shape == (D,) and w.is_contiguous(), f"{name}: expected contiguous shape ({D},)")
    check_same_device(q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
    return q3, k3, has_norm


def rotary_launch_args(q3: torch.Tensor, k3: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[int, int, int]:
    """(half rot_dim, BLOCK_R, BLOCK_H): heads per loop step bounded so a tile holds <= 4096 elements."""
    half = cos_sin_cache.shape[1] // 2
    block_r = next_pow2(half)
    block_h = max(1, min(next_pow2(max(q3.shape[1], k3.shape[1])), 4096 // block_r))
    return half, block_r, block_h


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 head_dim: int | None = None, q_norm_weight: torch.Tensor | None = None,
                 k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hk, D] in place (2-D [T, H*D] accepted with ``head_dim``).

    ``positions`` [T] int; ``cos_sin_cache`` [max_pos, rot_dim] float32. With both norm weights [D], apply
    Qwen3's per-head RMSNorm first. Returns ``(q, k)``.
    """
    q3, k3, has_norm = check_rotary_args(q, k, positions, cos_sin_cache, head_dim, q_norm_weight, k_norm_weight)
    T, _, D = q3.shape
    if T == 0:
        return q, k
    half, block_r, block_h = rotary_launch_args(q3, k3, cos_sin_cache)
    qw = q_norm_weight if has_norm else cos_sin_cache
    kw = k_norm_weight if has_norm else cos_sin_cache
    _rotary_kernel[(T,)](q3, k3, positions, cos_sin_cache, qw, kw,
                         q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), cos_sin_cache.stride(0),
                         q3.shape[1], k3.shape[1], D, half, eps,
                         HAS_NORM=has_norm, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4,
                         **pdl_args(q3, T))
    return q, k


@dataclass(frozen=True)
class DecodeRope:
    """The step's new tokens for ``paged_decode_attention(rope=...)``: ``k``/``v`` [B, Hkv, D] (views with a
    contiguous head_dim), unrotated and not yet in the cache, at ``positions`` [B] (each row's context length - 1),
    going to ``slot_mapping`` [B] (< 0: store nothing, a padding row); rotary over the whole head from
    ``cos_sin_cache`` [max_pos, D], Qwen3's q/k RMSNorm first when both weights are given."""

    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6


def decode_rope_args(rope: DecodeRope | None, q: torch.Tensor, k_cache: torch.Tensor,
                     quant: bool) -> tuple[list, bool]:
    """The decode-attention kernel's rope arguments for ``q`` [B, Hq, D] over ``k_cache`` (placeholders without
    ``rope``), checked, and whether the q/k norm is fused."""
    if rope is None:
        return [q, q, q, q, q, q, q, 0, 0, 0, 0, 0, 0.0, 0], False
    check(not quant, "rope: a quantised cache takes rotary_store_kv before attention (the fused store is float only)")
    B, _, D = q.shape
    _, k3, has_norm = check_rotary_args(q, rope.k, rope.positions, rope.cos_sin_cache, D, rope.q_norm_weight,
                                        rope.k_norm_weight)
    check(rope.cos_sin_cache.shape[1] == D, f"rope: rot_dim {rope.cos_sin_cache.shape[1]} must equal head_dim {D}")
    check(k3.shape == (B, k_cache.shape[2], D) and rope.v.shape == k3.shape and rope.v.stride(2) == 1,
          f"rope: k and v must be [{B}, {k_cache.shape[2]}, {D}] with a contiguous head_dim")
    check(rope.v.dtype == k_cache.dtype == k3.dtype, "rope: k, v and the caches must share one dtype")
    check_index("slot_mapping", rope.slot_mapping)
    check(rope.slot_mapping.shape == (B,), f"rope: slot_mapping must have shape ({B},)")
    qw = rope.q_norm_weight if has_norm else rope.cos_sin_cache
    kw = rope.k_norm_weight if has_norm else rope.cos_sin_cache
    return [rope.positions, k3, rope.v, rope.cos_sin_cache, qw, kw, rope.slot_mapping, k3.stride(0), k3.stride(1),
            rope.v.stride(0), rope.v.stride(1), rope.cos_sin_cache.stride(0), rope.eps, D // 2], has_norm


# ----------------------------------------------------------------------------- PyTorch reference
def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                     eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place reference on [T, H, D] tensors."""
    cs = cos_sin_cache[positions.long()]
    half = cs.shape[1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def one(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        if w is not None:
            xf = x.float()
            xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
            x = (xn.float() * w.float()).to(x.dtype)
        xf = x.float()
        x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(x.dtype)

    return one(q, q_norm_weight), one(k, k_norm_weight)
