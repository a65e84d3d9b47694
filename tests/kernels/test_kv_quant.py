"""fp8 / int8 KV cache: the KV store, the fused rotary + store, and both attention kernels against their PyTorch
references (per-head scales)."""
from __future__ import annotations

import pytest
import torch

from strataserve.kernels.decode_attention import DecodeRope, paged_decode_attention, paged_decode_attention_ref
from strataserve.kernels.kv_cache import store_kv, store_kv_ref
from strataserve.kernels.kv_quant import FP8, dequantize_ref, quantize_ref
from strataserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from strataserve.kernels.rotary_kv import rotary_store_kv, rotary_store_kv_ref
from strataserve.models.hf_config import RopeScaling
from strataserve.models.rope import build_cos_sin_cache
from ._helpers import ATTN_TOL, DTYPES, TOL, assert_close

QDTYPES = [FP8, torch.int8]
# a quantised cache is read as float16 for float16/bf16 models: the interpreter runs float16, so the CPU covers it
ADTYPES = list(dict.fromkeys(DTYPES + [torch.float16]))


def _step(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One quantisation step around each stored value (the grid spacing there), in real units."""
    s = scale[:, None]
    if stored.dtype == torch.int8:
        return s.expand(stored.shape)
    mag = stored.float().abs().clamp_min(2.0 ** -6)  # below 2^-6 e4m3 is subnormal: fixed spacing 2^-9
    return s * torch.exp2(torch.floor(torch.log2(mag)) - 3)


def assert_within_step(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    a, e = dequantize_ref(actual, scale), dequantize_ref(expected, scale)
    bad = (a - e).abs() > _step(expected, scale) * 1.001
    assert not bad.any(), f"{what}: {int(bad.sum())}/{a.numel()} values off by more than one step"


def _scales(H: int, device: str) -> torch.Tensor:
    return torch.rand(H, device=device) * 0.02 + 0.005  # values reach ~|4| / 0.005 = 800: fp8 saturates some


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_quantized(device, dtype, qdtype):
    T, H, D, bs, nb = 37, 3, 24, 8, 12
    kv = torch.randn(T, 2, H, D, device=device, dtype=dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided views
    ks, vs = _scales(H, device), _scales(H, device)
    slots = torch.randperm(nb * bs, device=device)[:T]
    slots[T // 2] = -1  # padding token: must not be stored
    kc = torch.zeros(nb, bs, H, D, device=device, dtype=qdtype)
    vc = torch.zeros_like(kc)
    ekc, evc = kc.clone(), vc.clone()
    store_kv_ref(k, v, ekc, evc, slots, ks, vs)
    store_kv(k, v, kc, vc, slots.to(torch.int32), k_scale=ks, v_scale=vs)
    if qdtype == torch.int8:  # same float32 division and rounding rule: bit-exact
        assert torch.equal(kc, ekc) and torch.equal(vc, evc)
    else:  # values in e4m3's subnormal range may round once more on the cast
        assert_within_step(kc, ekc, ks, "k cache")
        assert_within_step(vc, evc, vs, "v cache")
        assert (kc.view(torch.uint8) == ekc.view(torch.uint8)).float().mean() > 0.99
    assert dequantize_ref(kc, ks).abs().max() <= 448 * ks.max() * 1.0001 or qdtype == torch.int8


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("norm", [False, True])
def test_rotary_store_kv_quantized(device, qdtype, norm):
    T, Hq, Hk, D, bs = 7, 4, 2, 32, 8
    dtype = DTYPES[-1]
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, device=device, dtype=dtype)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    cache = build_cos_sin_cache(D, 100, 10000.0, RopeScaling(), device=device)
    pos = torch.randint(0, 100, (T,), device=device, dtype=torch.int32)
    slots = torch.randperm(4 * bs, device=device)[:T]
    qw = torch.randn(D, device=device, dtype=dtype) if norm else None
    kw = torch.randn(D, device=device, dtype=dtype) if norm else None
    ks, vs = _scales(Hk, device), _scales(Hk, device)
    kc = torch.zeros(4, bs, Hk, D, device=device, dtype=qdtype)
    vc = torch.zeros_like(kc)
    ekc, evc = kc.clone(), vc.clone()
    eq = rotary_store_kv_ref(q.reshape(T, Hq, D), k.reshape(T, Hk, D), v.reshape(T, Hk, D), pos, cache, ekc, evc,
                             slots, qw, kw, 1e-6, k_scale=ks, v_scale=vs)
    rotary_store_kv(q, k, v, pos, cache, kc, vc, slots, head_dim=D, q_norm_weight=qw, k_norm_weight=kw, eps=1e-6,
                    k_scale=ks, v_scale=vs)
    assert_close(q.reshape(T, Hq, D), eq, (2 if norm else 1) * TOL[dtype], "q")
    # the kernel quantises the float32 rotation, the reference its rounding to the model dtype: one step apart
    assert_within_step(kc, ekc, ks, "k cache")
    assert_within_step(vc, evc, vs, "v cache")


def _quant_cache(device, qdtype, lens, H, D, bs):
    need = [(n + bs - 1) // bs for n in lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb).tolist()
    tables = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        del perm[:n]
    ks, vs = _scales(H, device), _scales(H, device)
    kc = quantize_ref(torch.randn(nb, bs, H, D, device=device), ks, qdtype)
    vc = quantize_ref(torch.randn(nb, bs, H, D, device=device), vs, qdtype)
    return kc, vc, tables.to(device), ks, vs


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", ADTYPES)
@pytest.mark.parametrize("splits,target", [(None, 0), (1, 0), (4, 4)])  # (4, 4): adaptive, 123 splits in 3
def test_paged_decode_quantized(device, dtype, qdtype, splits, target):
    lens, Hq, Hkv, D, bs = [5, 123, 0, 40], 4, 2, 32, 16
    kc, vc, tables, ks, vs = _quant_cache(device, qdtype, lens, Hkv, D, bs)
    q = torch.randn(len(lens), Hq + 2 * Hkv, D, device=device, dtype=dtype)[:, :Hq]
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, kc, vc, tables, ctx, D ** -0.5, num_splits=splits, block_n=16,
                                 k_scale=ks, v_scale=vs, split_target=target, num_sms=2)
    exp = paged_decode_attention_ref(q, kc, vc, tables, ctx, D ** -0.5, k_scale=ks, v_scale=vs)
    assert_close(out, exp, ATTN_TOL[dtype], "decode")


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", ADTYPES)
def test_prefill_quantized(device, dtype, qdtype):
    q_lens, prefix, Hq, Hkv, D, bs = [9, 1, 20], [16, 40, 0], 2, 1, 64, 8
    seq = [a + b for a, b in zip(q_lens, prefix)]
    kc, vc, tables, ks, vs = _quant_cache(device, qdtype, seq, Hkv, D, bs)
    q = torch.randn(sum(q_lens), Hq, D, device=device, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    seq_lens = torch.tensor(seq, dtype=torch.int32, device=device)
    out = prefill_attention(q, kc, vc, tables, cu, seq_lens, max(q_lens), D ** -0.5, block_m=16, block_n=16,
                            k_scale=ks, v_scale=vs)
    exp = prefill_attention_ref(q, kc, vc, tables, cu, seq_lens, D ** -0.5, k_scale=ks, v_scale=vs)
    assert_close(out, exp, ATTN_TOL[dtype], "prefill")


def test_quantized_cache_bad_inputs(device):
    k = torch.randn(4, 2, 8, device=device)
    kc = torch.zeros(3, 4, 2, 8, device=device, dtype=torch.int8)
    slots = torch.arange(4, device=device)
    with pytest.raises(ValueError, match="needs per-head scales"):
        store_kv(k, k, kc, kc.clone(), slots)
    with pytest.raises(ValueError, match=r"expected contiguous float32 \[2\]"):
        store_kv(k, k, kc, kc.clone(), slots, k_scale=torch.ones(3, device=device),
                 v_scale=torch.ones(2, device=device))
    with pytest.raises(ValueError, match="only for an fp8/int8 cache"):
        store_kv(k, k, kc.float(), kc.float(), slots, k_scale=torch.ones(2, device=device),
                 v_scale=torch.ones(2, device=device))
    q = torch.randn(1, 2, 8, device=device)
    with pytest.raises(ValueError, match="needs per-head scales"):
        paged_decode_attention(q, kc, kc.clone(), torch.zeros(1, 1, dtype=torch.int32, device=device),
                               torch.ones(1, dtype=torch.int32, device=device), 1.0)
    odd = torch.zeros(3, 4, 2, 6, device=device, dtype=FP8)  # read as int32 words: head_dim must divide by 4
    ones = torch.ones(2, device=device)
    with pytest.raises(ValueError, match="needs head_dim divisible by 4, got 6"):
        paged_decode_attention(torch.randn(1, 2, 6, device=device), odd, odd.clone(),
                               torch.zeros(1, 1, dtype=torch.int32, device=device),
                               torch.ones(1, dtype=torch.int32, device=device), 1.0, k_scale=ones, v_scale=ones)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_decode_rope_refuses_a_quantised_cache(device, qdtype):
    """The rotary + store inside decode attention writes float k / v: with an fp8 / int8 cache the caller must store
    through ``rotary_store_kv`` first (TritonOps does), and the kernel says so instead of writing unquantised bytes."""
    lens, Hq, Hkv, D, bs = [9], 4, 2, 32, 16
    kc, vc, tables, ks, vs = _quant_cache(device, qdtype, lens, Hkv, D, bs)
    qkv = torch.randn(1, Hq + 2 * Hkv, D, device=device)
    cos_sin = build_cos_sin_cache(D, 64, 1e4, RopeScaling(), device=device)
    rope = DecodeRope(torch.tensor([8], device=device), qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:], cos_sin,
                      torch.tensor([8], device=device))
    with pytest.raises(ValueError, match="quantised cache takes rotary_store_kv"):
        paged_decode_attention(qkv[:, :Hq], kc, vc, tables, torch.tensor(lens, dtype=torch.int32, device=device),
                               D ** -0.5, k_scale=ks, v_scale=vs, rope=rope)
