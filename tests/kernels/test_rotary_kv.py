"""Rotary (plain and with Qwen3 q/k-norm fused) and the paged KV store against their references."""
from __future__ import annotations

import pytest
import torch

from strataserve.kernels.kv_cache import store_kv, store_kv_ref
from strataserve.kernels.rotary import apply_rotary, apply_rotary_ref
from strataserve.kernels.rotary_kv import rotary_store_kv, rotary_store_kv_ref
from strataserve.models.hf_config import RopeScaling
from strataserve.models.rope import build_cos_sin_cache
from ._helpers import DTYPES, TOL, assert_close

LLAMA3 = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hk,D,scaling", [(5, 4, 2, 32, RopeScaling()), (13, 3, 1, 64, LLAMA3),
                                               (1, 8, 8, 16, RopeScaling())])
def test_rotary_on_fused_qkv_views(device, dtype, T, Hq, Hk, D, scaling):
    # q and k are strided column slices of one qkv projection output, as the model passes them
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, device=device, dtype=dtype)
    q, k = qkv[:, : Hq * D], qkv[:, Hq * D: (Hq + Hk) * D]
    v_before = qkv[:, (Hq + Hk) * D:].clone()
    cache = build_cos_sin_cache(D, 300, 10000.0, scaling, device=device)
    pos = torch.randint(0, 300, (T,), device=device)
    eq, ek = apply_rotary_ref(q.view(T, Hq, D), k.reshape(T, Hk, D), pos, cache)
    apply_rotary(q, k, pos, cache, head_dim=D)
    assert_close(q.reshape(T, Hq, D), eq, TOL[dtype], "q")
    assert_close(k.reshape(T, Hk, D), ek, TOL[dtype], "k")
    assert torch.equal(qkv[:, (Hq + Hk) * D:], v_before), "v must be untouched"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_partial_rot_dim_leaves_tail(device, dtype):
    T, H, D = 6, 2, 32
    q = torch.randn(T, H, D, device=device, dtype=dtype)
    k = torch.randn(T, H, D, device=device, dtype=dtype)
    cache = build_cos_sin_cache(16, 50, 10000.0, RopeScaling(), device=device)
    pos = torch.arange(T, device=device)
    eq, ek = apply_rotary_ref(q, k, pos, cache)
    apply_rotary(q, k, pos, cache)
    assert_close(q, eq, TOL[dtype], "q")
    assert_close(k, ek, TOL[dtype], "k")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_with_fused_qk_norm(device, dtype):
    T, Hq, Hk, D = 7, 4, 2, 64
    q = torch.randn(T, Hq, D, device=device, dtype=dtype) * 2
    k = torch.randn(T, Hk, D, device=device, dtype=dtype)
    qw = torch.randn(D, device=device, dtype=dtype)
    kw = torch.randn(D, device=device, dtype=dtype)
    cache = build_cos_sin_cache(D, 64, 1e6, RopeScaling(), device=device)
    pos = torch.randint(0, 64, (T,), device=device, dtype=torch.int32)
    eq, ek = apply_rotary_ref(q, k, pos, cache, qw, kw, 1e-6)
    apply_rotary(q, k, pos, cache, q_norm_weight=qw, k_norm_weight=kw, eps=1e-6)
    # bf16/fp16: the norm output is rounded twice before the rotation, so allow one more ulp of slack
    assert_close(q, eq, 2 * TOL[dtype], "q")
    assert_close(k, ek, 2 * TOL[dtype], "k")


def test_rotary_bad_inputs(device):
    q = torch.randn(3, 2, 8, device=device)
    cache = build_cos_sin_cache(8, 10, 1e4, RopeScaling(), device=device)
    with pytest.raises(ValueError, match="positions: expected shape"):
        apply_rotary(q, q.clone(), torch.zeros(4, dtype=torch.long, device=device), cache)
    with pytest.raises(ValueError, match="needs head_dim"):
        apply_rotary(q.view(3, 16), q.clone().view(3, 16), torch.zeros(3, dtype=torch.long, device=device), cache)
    with pytest.raises(ValueError, match="float32"):
        apply_rotary(q, q.clone(), torch.zeros(3, dtype=torch.long, device=device), cache.half())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D,bs", [(5, 2, 32, 16), (37, 3, 24, 8)])
def test_store_kv(device, dtype, T, H, D, bs):
    nb = 12
    kv = torch.randn(T, 2, H, D, device=device, dtype=dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided views
    slots = torch.randperm(nb * bs, device=device)[:T]
    slots[T // 2] = -1  # padding token: must not be stored
    kc = torch.randn(nb, bs, H, D, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    ekc, evc = kc.clone(), vc.clone()
    store_kv_ref(k, v, ekc, evc, slots)
    store_kv(k, v, kc, vc, slots.to(torch.int32))
    assert torch.equal(kc, ekc) and torch.equal(vc, evc)


def test_store_kv_bad_inputs(device):
    k = torch.randn(4, 2, 8, device=device)
    kc = torch.zeros(3, 4, 2, 8, device=device)
    with pytest.raises(ValueError, match="slot_mapping: expected shape"):
        store_kv(k, k, kc, kc.clone(), torch.zeros(5, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="heads/head_dim"):
        store_kv(k, k, torch.zeros(3, 4, 1, 8, device=device), torch.zeros(3, 4, 1, 8, device=device),
                 torch.zeros(4, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="dtypes differ"):
        store_kv(k, k, kc.half(), kc.half(), torch.zeros(4, dtype=torch.long, device=device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hk,D,bs,norm,hpp", [(5, 4, 2, 32, 16, False, None), (11, 3, 3, 24, 8, True, None),
                                                     (1, 6, 2, 64, 4, True, None), (3, 12, 4, 16, 8, True, 8),
                                                     (2, 5, 3, 32, 4, False, 1)])
def test_rotary_store_kv_fused(device, dtype, T, Hq, Hk, D, bs, norm, hpp):
    """q rotated in place; rotated k and v land in their cache slots; k and padding slots (-1) untouched."""
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, device=device, dtype=dtype)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)  # strided views, as the decoder passes them
    k_before = k.clone()
    cache = build_cos_sin_cache(D, 200, 10000.0, LLAMA3, device=device)
    pos = torch.randint(0, 200, (T,), device=device, dtype=torch.int32)
    nb = 2 * T + 2
    slots = torch.randperm(nb * bs, device=device)[:T]
    slots[T // 2] = -1
    qw = torch.randn(D, device=device, dtype=dtype) if norm else None
    kw = torch.randn(D, device=device, dtype=dtype) if norm else None
    kc = torch.randn(nb, bs, Hk, D, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    ekc, evc = kc.clone(), vc.clone()
    eq = rotary_store_kv_ref(q.reshape(T, Hq, D), k.reshape(T, Hk, D), v.reshape(T, Hk, D), pos, cache, ekc, evc,
                             slots, qw, kw, 1e-6)
    rotary_store_kv(q, k, v, pos, cache, kc, vc, slots, head_dim=D, q_norm_weight=qw, k_norm_weight=kw, eps=1e-6,
                    heads_per_program=hpp)
    tol = (2 if norm else 1) * TOL[dtype]
    assert_close(q.reshape(T, Hq, D), eq, tol, "q")
    assert_close(kc, ekc, tol, "k cache")
    assert torch.equal(vc, evc), "v cache"
    assert torch.equal(k, k_before), "k must be untouched"


def test_rotary_store_kv_bad_inputs(device):
    T, H, D = 3, 2, 8
    q, k = torch.randn(T, H, D, device=device), torch.randn(T, H, D, device=device)
    kc = torch.zeros(4, 4, H, D, device=device)
    pos = torch.zeros(T, dtype=torch.long, device=device)
    slots = torch.arange(T, device=device)
    with pytest.raises(ValueError, match="rot_dim 4 must equal head_dim 8"):
        rotary_store_kv(q, k, k.clone(), pos, build_cos_sin_cache(4, 10, 1e4, RopeScaling(), device=device), kc,
                        kc.clone(), slots)
    cache = build_cos_sin_cache(D, 10, 1e4, RopeScaling(), device=device)
    with pytest.raises(ValueError, match="slot_mapping: expected shape"):
        rotary_store_kv(q, k, k.clone(), pos, cache, kc, kc.clone(), slots[:2])
    with pytest.raises(ValueError, match="dtypes differ"):
        rotary_store_kv(q, k, k.clone(), pos, cache, kc.half(), kc.half(), slots)
    with pytest.raises(ValueError, match="must be a power of two"):
        rotary_store_kv(q, k, k.clone(), pos, cache, kc, kc.clone(), slots, heads_per_program=3)
