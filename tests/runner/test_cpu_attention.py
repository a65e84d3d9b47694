"""The CPU paged-attention kernel (K/V read from the blocks in place) against dense attention over the same keys,
and the backend against the torch gather + SDPA backend on a mixed step built by the real input batcher."""
from __future__ import annotations

import ctypes
import random

import pytest
import torch

from strataserve import envs
from strataserve.types.outputs import ScheduledChunk
from strataserve.models.hf_config import DecoderConfig
from strataserve.runner import cpu_kernel
from strataserve.runner.attention import TorchAttention
from strataserve.runner.cpu_attention import CpuPagedAttention, eager_attention
from strataserve.runner.input_batch import build_input_batch

CPU = torch.device("cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def dense(q, k, v, window):
    """float64 attention of one sequence's last q.shape[0] queries over its keys: causal, optionally windowed."""
    hq, hkv = q.shape[1], k.shape[1]
    k, v = k.double().repeat_interleave(hq // hkv, 1), v.double().repeat_interleave(hq // hkv, 1)
    total, n_q = k.shape[0], q.shape[0]
    s = torch.einsum("qhd,khd->hqk", q.double(), k) / q.shape[-1] ** 0.5
    keys, pos = torch.arange(total)[None, :], torch.arange(total - n_q, total)[:, None]
    allowed = keys <= pos
    if window:
        allowed &= keys > pos - window
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def _against_dense(dtype, hq, hkv, d, window, q_len, kv_len, bs=4, seed=0):
    """Sequences of q_len query rows and kv_len keys each in scattered blocks of size bs, q a strided view of a
    fused qkv tensor (as the decoder hands it over), a gap row after each sequence: the kernel against ``dense``."""
    nblocks = sum(-(-n // bs) for n in kv_len) + 8
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(nblocks, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(nblocks, bs, hkv, d, generator=gen).to(dtype)
    free = list(range(nblocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in kv_len]
    width = max(len(t) for t in tables) + 1  # a column past every table: padding must never be read
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    starts = [0]
    for n in q_len:
        starts.append(starts[-1] + n + 1)  # a gap row between sequences: left alone by the kernel
    rows = starts[-1]
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q = qkv[:, :hq * d].view(rows, hq, d)
    out = torch.full((rows, hq, d), 7.0, dtype=dtype)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    cpu_kernel.paged_attention(q, out, k_cache, v_cache, bt, i32(starts[:-1]), i32(q_len), i32(kv_len),
                               d ** -0.5, window)
    for i, t in enumerate(tables):
        idx = torch.tensor(t)
        k = k_cache[idx].reshape(-1, hkv, d)[:kv_len[i]]
        v = v_cache[idx].reshape(-1, hkv, d)[:kv_len[i]]
        s = starts[i]
        ref = dense(q[s:s + q_len[i]], k, v, window)
        torch.testing.assert_close(out[s:s + q_len[i]].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
        assert (out[s + q_len[i]] == 7.0).all()  # the gap row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# Head dims that are a multiple of 16 take the AVX-512 row on machines that have it (cpu_attention_avx512.h):
# 14 heads leave a tail of score pairs short of sixteen, 80 is not one of its compiled-in head dims.
@pytest.mark.parametrize("hq,hkv,d,window", [(8, 4, 32, None), (6, 2, 24, None), (4, 4, 64, 7), (2, 1, 128, None),
                                             (14, 2, 64, None), (16, 8, 80, 5), (32, 8, 128, 11)])
def test_kernel_matches_dense_attention(dtype, hq, hkv, d, window):
    """Decode rows, chunks after cached tokens and fresh chunks, all shorter than the tiles' minimum."""
    rng = random.Random(hq * d)
    q_len = [1] * 9 + [rng.randint(2, 9) for _ in range(4)]
    kv_len = [rng.randint(1, 60) if n == 1 else n + rng.choice([0, rng.randint(1, 30)]) for n in q_len]
    _against_dense(dtype, hq, hkv, d, window, q_len, kv_len, seed=hq * d)


def _set_blas(lib, blas) -> None:
    lib.strata_set_blas(*((None, None) if blas is None else (ctypes.c_void_p(a) for a in blas)))


@pytest.mark.parametrize("hq,hkv,d,window,bs", [(8, 4, 32, None, 4), (14, 2, 64, None, 16), (4, 4, 64, 20, 16),
                                                (16, 8, 128, None, 16), (6, 2, 24, 9, 4)])
def test_long_prompt_chunks_take_the_tiles_and_match_dense_attention(hq, hkv, d, window, bs):
    """float32 chunks of >= 128 rows go through tiles of sgemm (cpu_attention_gemm.h): a fresh prompt over three
    tiles (64 + 64 + 22 rows), a chunk of 130 after 100 cached tokens (64 + 64 + 2), one of exactly 128 rows, one
    of 127 (rows path), and decode rows in the same call; with a window a tile's later rows see keys its first rows
    do not. torch's sgemm sits behind a counting callback: two products per (tile, KV head) prove that the tiles
    ran."""
    blas = cpu_kernel.torch_blas()
    if blas is None:
        pytest.skip("torch has no MKL sgemm here: the tiles are not used")
    ip, fp, vp = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_float), ctypes.c_void_p
    proto = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ip, ip, ip, fp, vp, ip, vp, ip, fp, vp, ip)
    real, calls = proto(blas[0]), []

    def counting_sgemm(*args):
        calls.append(1)
        real(*args)

    fn = proto(counting_sgemm)
    lib = cpu_kernel.load()
    _set_blas(lib, (ctypes.cast(fn, ctypes.c_void_p).value, blas[1]))
    try:
        _against_dense(torch.float32, hq, hkv, d, window, [150, 130, 128, 127, 1, 1, 1],
                       [150, 230, 128, 160, 33, 200, 5], bs=bs, seed=d + hq)
    finally:
        _set_blas(lib, blas)
    assert len(calls) == 2 * hkv * (3 + 3 + 2)


def test_without_blas_long_prompt_chunks_take_the_rows():
    lib = cpu_kernel.load()
    lib.strata_set_blas(None, None)
    try:
        _against_dense(torch.float32, 8, 4, 32, None, [140, 1], [160, 12], seed=3)
    finally:
        _set_blas(lib, cpu_kernel.torch_blas())


def test_backend_matches_torch_backend_on_a_built_step():
    """33 requests (30 decodes, a chunk after cached tokens, fresh chunks) through ``build_input_batch``: the kernel
    backend (lean metadata) and the torch backend (its padded views) store the same K/V and agree."""
    hq, hkv, d, bs, nblocks = 8, 2, 32, 4, 400
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    free = list(range(nblocks))
    rng.shuffle(free)
    caches = [(torch.randn(nblocks, bs, hkv, d, generator=gen), torch.randn(nblocks, bs, hkv, d, generator=gen))
              for _ in range(2)]
    chunks = []
    for i in range(33):
        n_new = 1 if i < 30 else rng.randint(2, 9)
        start = rng.randint(0, 40) if i < 30 or i == 31 else 0
        table = [free.pop() for _ in range(-(-(start + n_new) // bs) + 1)]  # one block allocated ahead
        chunks.append(ScheduledChunk(f"r{i}", [0] * n_new, start, table, sample=True))
    torch_meta = build_input_batch(chunks, bs, CPU).attn_meta
    lean_meta = build_input_batch(chunks, bs, CPU, torch_views=False).attn_meta
    t = torch_meta.slot_mapping.shape[0]
    q, k, v = (torch.randn(t, h * d, generator=gen) for h in (hq, hkv, hkv))
    ref_att, att = TorchAttention(hq, hkv, d), CpuPagedAttention(hq, hkv, d, max_rows=4)  # rows grow on demand
    ref_att.bind_kv_cache([tuple(c.clone() for c in caches[0])])
    att.bind_kv_cache([tuple(c.clone() for c in caches[0])])
    for layer in range(1):
        ref = ref_att.forward(layer, q, k, v, torch_meta)
        got = att.forward(layer, q, k, v, lean_meta)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(att.kv_caches[layer][0], ref_att.kv_caches[layer][0], atol=0, rtol=0)
    assert att.forward(0, q, k, v, None).shape == (t, hq * d)  # no metadata: one causal sequence


def test_bad_inputs_say_what_is_wrong():
    k_cache = torch.zeros(4, 4, 2, 8)
    bt, one = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    q = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="dtype"):
        cpu_kernel.paged_attention(q.double(), q.double(), k_cache, k_cache, bt, one - 1, one, one, 1.0)
    with pytest.raises(ValueError, match="shapes"):
        cpu_kernel.paged_attention(torch.zeros(1, 4, 16), torch.zeros(1, 4, 16), k_cache, k_cache, bt, one - 1,
                                   one, one, 1.0)
    with pytest.raises(ValueError, match="kv_lens must be contiguous int32"):
        cpu_kernel.paged_attention(q, q.clone(), k_cache, k_cache, bt, one - 1, one, one.long(), 1.0)


def _config(arch="LlamaForCausalLM", window=None) -> DecoderConfig:
    return DecoderConfig(architecture=arch, vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                         rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False,
                         qk_norm=False, bos_token_id=None, eos_token_ids=(), torch_dtype="float32",
                         sliding_window=window)


def test_eager_runner_picks_the_kernel_unless_switched_off(monkeypatch):
    cfg = _config("MistralForCausalLM", window=8)
    att = eager_attention(cfg, CPU)
    assert isinstance(att, CpuPagedAttention) and att.window == 8
    monkeypatch.setattr(envs, "STRATA_CPU_ATTENTION", False)
    assert isinstance(eager_attention(cfg, CPU), TorchAttention)


def test_without_a_compiler_the_runner_keeps_the_torch_path(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert cpu_kernel.load.__wrapped__() is None  # the cached library of this process stays as it is
    assert "no C compiler" in caplog.text
    monkeypatch.setattr(cpu_kernel, "load", lambda: None)
    assert isinstance(eager_attention(_config(), CPU), TorchAttention)
