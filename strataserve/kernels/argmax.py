"""Row-wise argmax of the logits (the greedy token), ``torch.argmax(x, dim=-1)``'s result exactly: the first index
of the largest value, and the first NaN's index in a row that holds one.

Why a kernel: at batch 1 the decode graph's ``logits.argmax`` over a 128,256-entry vocabulary ran as one PyTorch
reduction of ~27 us on the H200 (run 17's profile of the 8B shape: more than a whole decoder layer's norms), a
latency-bound launch over 256 KB. Here the row is cut into ``BLOCK``-wide chunks, one program each (a few dozen
per row), and a second launch takes the best of each row's chunks; both are short. Ties keep the smallest index at
both stages (chunks are visited in order), so the result does not depend on the chunking.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strataserve.kernels._common import check, check_float, pdl_args, pdl_wait

_BIG = tl.constexpr(2**31 - 1)  # (a jitted function reads only constexpr globals)


@triton.jit
def _chunk_argmax_kernel(x_ptr, pv_ptr, pi_ptr, V, x_sr, chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Chunk pid1 of row pid0: its largest value (NaN if it holds one) and that value's first index."""
    pdl_wait(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * x_sr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    nan = x != x
    m = tl.max(tl.where(nan, float("-inf"), x), axis=0)
    idx = tl.min(tl.where(x == m, offs, _BIG), axis=0)
    first_nan = tl.min(tl.where(nan, offs, _BIG), axis=0)
    has_nan = first_nan < _BIG
    tl.store(pv_ptr + row * chunks + chunk, tl.where(has_nan, float("nan"), m))
    tl.store(pi_ptr + row * chunks + chunk, tl.where(has_nan, first_nan, idx))


@triton.jit
def _row_argmax_kernel(pv_ptr, pi_ptr, out_ptr, chunks, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """The best of row pid0's chunk results (the first NaN chunk, else the first chunk holding the maximum)."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    cmask = offs < chunks
    v = tl.load(pv_ptr + row * chunks + offs, mask=cmask, other=float("-inf"))
    i = tl.load(pi_ptr + row * chunks + offs, mask=cmask, other=_BIG)
    nan = (v != v) & cmask
    m = tl.max(tl.where(nan, float("-inf"), v), axis=0)
    best = tl.min(tl.where((v == m) & cmask, i, _BIG), axis=0)
    first_nan = tl.min(tl.where(nan, i, _BIG), axis=0)
    tl.store(out_ptr + row, tl.where(first_nan < _BIG, first_nan, best).to(tl.int64))


def argmax_rows(x: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """``x`` [B, V] (float32 / float16 / bfloat16, last dim contiguous) -> int64 [B], as ``x.argmax(dim=-1)``.
    Capturable in a CUDA graph (fixed launches, no host sync)."""
    check_float("x", x)
    check(x.dim() == 2 and x.shape[1] > 0, f"x: expected [B, V] with V > 0, got {tuple(x.shape)}")
    check(x.stride(1) == 1, "x: the last dimension must be contiguous")
    check(block >= 16 and block & (block - 1) == 0, f"block: expected a power of two >= 16, got {block}")
    B, V = x.shape
    chunks = triton.cdiv(V, block)
    check(chunks <= 4096, f"x: a row of {V} needs {chunks} chunks of {block}; use a larger block")
    out = torch.empty(B, dtype=torch.int64, device=x.device)
    if B == 0:
        return out
    pv = torch.empty(B, chunks, dtype=torch.float32, device=x.device)
    pi = torch.empty(B, chunks, dtype=torch.int32, device=x.device)
    pdl = pdl_args(x, B)
    _chunk_argmax_kernel[(B, chunks)](x, pv, pi, V, x.stride(0), chunks, BLOCK=block, num_warps=8, **pdl)
    _row_argmax_kernel[(B,)](pv, pi, out, chunks, BLOCK_C=max(16, triton.next_power_of_2(chunks)), num_warps=1,
                             **pdl)
    return out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: ``argmax_rows`` on a GPU, ``torch.argmax`` elsewhere (the same index either way)."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1:
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)
