"""The KV cache's storage dtype (``--kv-cache-dtype auto|fp8|int8``) and, for fp8/int8, the per-layer, per-KV-head
scales, computed once at start-up by a calibration pass.

Why a start-up calibration rather than the first request's prefill: the scales must exist before CUDA graphs are
captured, stay fixed (a scale that changed later would make earlier cached blocks, prefix-cache hits included,
decode wrongly), and not depend on which request happens to come first (same output for the same request).

Calibration: one forward without a KV cache over ``num_tokens`` token ids drawn with a fixed seed from the
vocabulary, recording per layer and KV head
- for K, a bound that holds at every position: rotary turns each feature pair (i, i + D/2) by an angle, which keeps
  sqrt(k_i^2 + k_{i+D/2}^2), so the largest such pair norm bounds |k| after any rotation;
- for V, the largest |v|.
scale = amax x headroom / qmax (qmax 448 for fp8 e4m3, 127 for int8). Headroom costs nothing on fp8's top end
(its relative precision is the same across the range, so 4x leaves ~2^-7 of amax above the subnormals); int8's
grid is uniform, so it gets 1.5x for V and 1.0 for K's already conservative bound.

Limits: random tokens are not text; a prompt whose activations exceed the calibrated range x headroom saturates
(values clamp at +-qmax x scale). One scale per head cannot follow per-token outliers the way per-token scales can.
Accuracy on the trained demo model: ``tests/engine/test_kv_cache_dtype.py`` and docs/performance.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from strataserve.kernels.kv_quant_ref import KV_QUANT_DTYPES, QMAX

if TYPE_CHECKING:
    from strataserve.models.decoder import DecoderModel

#: scale headroom over the calibrated amax, (K, V) per storage dtype
_HEADROOM = {torch.float8_e4m3fn: (4.0, 4.0), torch.int8: (1.0, 1.5)}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device, kernels: bool,
                           head_dim: int = 128) -> torch.dtype:
    """The KV storage dtype for ``name``; ValueError where the backend cannot store it. ``kernels``: the Triton
    attention kernels run (fp8 conversions need a GPU of compute capability 8.9 or newer there, and the decode
    kernel reads an 8-bit cache as int32 words, so head_dim must be a multiple of 4)."""
    if name == "auto":
        return model_dtype
    if name not in KV_QUANT_DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r}: use one of auto, fp8, int8")
    if kernels and head_dim % 4:
        raise ValueError(f"kv_cache_dtype={name!r} needs head_dim divisible by 4 for the Triton attention kernels; "
                         f"this model's is {head_dim}: use kv_cache_dtype='auto'")
    dtype = KV_QUANT_DTYPES[name]
    if dtype == torch.float8_e4m3fn and kernels and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(f"kv_cache_dtype='fp8' needs a GPU of compute capability >= 8.9 (Ada, Hopper) for the "
                             f"Triton kernels; this one is {cap[0]}.{cap[1]}: use kv_cache_dtype='int8' or 'auto'")
    return dtype


def pair_norm_amax(k: torch.Tensor) -> torch.Tensor:
    """k [T, H, D] -> [H]: max over tokens and pairs of sqrt(k_i^2 + k_{i+D/2}^2), a bound on |k| under any
    rotary angle."""
    half = k.shape[-1] // 2
    kf = k.float()
    return torch.sqrt(kf[..., :half] ** 2 + kf[..., half:2 * half] ** 2).amax(dim=(0, 2))


@torch.inference_mode()
def calibrate_kv_scales(model: DecoderModel, kv_dtype: torch.dtype, num_tokens: int = 512,
                        seed: int = 0) -> torch.Tensor:
    """Scales [num_layers, 2 (K, V), num_kv_heads] float32 for an fp8/int8 cache, from one forward of ``model``
    without a KV cache, where its attention backend's ``kv_observer`` sees every layer's rotated k and v."""
    cfg, device, attention = model.config, model.device, model.ops.attention
    amax = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, device=device)

    def observe(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        amax[layer, 0] = torch.maximum(amax[layer, 0], pair_norm_amax(k))
        amax[layer, 1] = torch.maximum(amax[layer, 1], v.float().abs().amax(dim=(0, 2)))

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=gen).to(device)
    attention.kv_observer = observe
    try:
        model(ids, torch.arange(num_tokens, device=device), None)
    finally:
        attention.kv_observer = None
    head_k, head_v = _HEADROOM[kv_dtype]
    headroom = torch.tensor([head_k, head_v], device=device)[None, :, None]
    scales = amax * headroom / QMAX[kv_dtype]
    # a head that never fired (all zeros) still needs a usable scale
    return torch.where(scales > 0, scales, torch.full_like(scales, 1.0 / QMAX[kv_dtype]))
