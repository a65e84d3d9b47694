"""Shared by the kernels: argument checks for the host wrappers (each failure is a ValueError that says what to
change), and small device helpers."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from strataserve import envs
from strataserve.kernels.kv_quant_ref import check_kv_scales

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


def check_paged_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_layout: str,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> bool:
    """q [*, q_heads, head_dim] against paged caches [num_blocks, block_size, kv_heads, head_dim] (both kernels);
    returns whether the caches are quantised (fp8/int8 with per-head scales)."""
    check_ndim("q", q, 3, q_layout)
    check_ndim("k_cache", k_cache, 4, "[num_blocks, block_size, kv_heads, head_dim]")
    check(v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(),
          "v_cache: must have k_cache's shape and strides")
    check_float("q", q)
    check(k_cache.dtype == v_cache.dtype, f"caches differ: {k_cache.dtype}/{v_cache.dtype}")
    quant = check_kv_scales(k_cache, k_scale, v_scale)
    check(quant or q.dtype == k_cache.dtype, f"dtypes differ: q {q.dtype}, caches {k_cache.dtype}")
    hq, d = q.shape[1], q.shape[2]
    hkv, dc = k_cache.shape[2], k_cache.shape[3]
    check(dc == d, f"head_dim differs: q {d}, cache {dc}")
    check(hq % hkv == 0, f"q heads {hq} must be a multiple of kv heads {hkv}")
    check(q.stride(2) == 1 and k_cache.stride(3) == 1, "head_dim must be contiguous in q and the caches")
    check(not quant or d % 4 == 0, f"an {k_cache.dtype} KV cache needs head_dim divisible by 4, got {d}")
    return quant


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """tl.dot; for float32 inputs (IEEE) in full precision, since tl.dot's float32 default is tf32 on GPUs."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


# ----------------------------------------------------------------------------- programmatic dependent launch
@functools.lru_cache(maxsize=None)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# PDL only for launches over at most this many rows (tokens, sequences; ``STRATA_PDL_MAX_ROWS``, default 64). At
# batch 1 every matmul is our GEMV and PDL paid (run 18: -5.3% per 8B step, -12% at the Qwen3-0.6B shape). Run 18
# limited it to batch 1: with up to 64 rows, while cuBLAS did every multi-row matmul, nano-vllm's workload ran
# 3.1-3.7% slower (18f). Since run 19 the few-rows Triton GEMM does most of those steps' matmuls (gate_up, down,
# lm_head at the 8B shape), and PDL up to 64 rows gave the 8B batch-64 step -0.4% to -1.9% (19b, 19c).
PDL_MAX_ROWS = envs.STRATA_PDL_MAX_ROWS


def pdl_enabled(device: torch.device, rows: int) -> bool:
    """Whether a launch over ``rows`` rows on ``device`` uses PDL: a Hopper-or-newer GPU, ``STRATA_PDL`` on, and
    ``rows`` <= ``PDL_MAX_ROWS``."""
    return (envs.STRATA_PDL and rows <= PDL_MAX_ROWS and device.type == "cuda"
            and _hopper_or_newer(device.index or 0))


def pdl_args(t: torch.Tensor, rows: int) -> dict:
    """The launch keywords for programmatic dependent launch (PDL) of a kernel whose data lives with ``t``, over
    ``rows`` rows: ``PDL=True`` plus Triton's ``launch_pdl`` where ``pdl_enabled``, else ``PDL=False``.

    Why: at batch 1 a decode step is ~230 short kernels in a row, and each one normally starts only after the
    previous has finished and its launch has gone through. With PDL the next kernel's programs are placed on the
    SMs while the previous one drains (its last programs triggered the launch) and block in ``pdl_wait`` until
    its results are visible, so the launch latency and the programs' start overlap the previous kernel's tail.
    Every kernel launched so must call ``pdl_wait`` before it reads or writes anything another kernel writes."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(t.device, rows) else {"PDL": False}


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the lines holding ``ptrs`` (where ``mask``) without waiting for them (PTX ``prefetch.global.L2``).
    A PDL kernel calls it on data no kernel writes (weights) before its ``pdl_wait``: the bytes then stream in
    while the previous kernel drains, and its first loads hit L2 instead of waiting on DRAM."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel in the stream has finished and its memory is visible, then let the
    next kernel launch (its programs then wait here in turn). Called first, before any early return: a kernel that
    finished without waiting would let the next one run ahead of the one before (the wait is not transitive then).
    Without PDL: nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
