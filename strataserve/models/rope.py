"""Rotary position embedding tables (neox / "rotate half" style), with llama3 and linear frequency scaling.

For head_dim D the inverse frequencies are ``inv_freq[i] = theta ** (-2i / D)``, i < D/2. Llama 3.1's "llama3"
scaling (Meta's reference, also transformers' ``_compute_llama3_parameters``) keeps high frequencies (wavelength
< original_len / high_freq_factor), divides low frequencies (wavelength > original_len / low_freq_factor) by
``factor``, and interpolates smoothly in between. "linear" divides every frequency by ``factor``.

The cache is one float32 tensor ``cos_sin [max_positions, D]``: columns [0, D/2) hold cos(pos * inv_freq),
columns [D/2, D) hold sin(pos * inv_freq). It is computed once per model, never per step.
"""
from __future__ import annotations

import math

import torch

from strataserve.models.hf_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    # Same arithmetic order as transformers, so float32 tables match bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(head_dim: int, max_positions: int, theta: float, scaling: RopeScaling,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 ``[max_positions, head_dim]``: cos half then sin half (see module docstring)."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
