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

import torch
import triton
import triton.language as tl

from strataserve.kernels._common import (check, check_float, check_index, check_ndim, check_same_device,
                                         next_pow2)
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
                   HAS_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
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
                         HAS_NORM=has_norm, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4)
    return q, k


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
