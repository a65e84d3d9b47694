"""Programmatic dependent launch (``kernels/_common.py``: ``pdl_args`` / ``pdl_wait``) changes when kernels start,
never what they compute: with PDL on, a chain of dependent kernels, eager and replayed in a CUDA graph, gives
bit-for-bit what it gives with PDL off (the same arithmetic in the same order). A kernel that read its input
before the previous kernel had written it would differ. GPU only (Hopper or newer): conftest.py leaves this file
out of CPU runs."""
from __future__ import annotations

import pytest
import torch

from strataserve import envs
from strataserve.kernels._common import PDL_MAX_ROWS, pdl_args
from strataserve.kernels.argmax import argmax_rows
from strataserve.kernels.gemv import GemvConfig, gemv, gemv_rms_norm, gemv_silu_mul
from strataserve.kernels.rms_norm import fused_add_rms_norm
from strataserve.models.loader import build_random_model
from strataserve.runner.attention import allocate_kv_cache
from strataserve.runner.cuda_graph import CudaGraphDecoder, decode_metadata
from strataserve.runner import triton_ops as triton_ops_module
from strataserve.runner.triton_ops import TritonAttention, TritonOps

from .test_triton_ops import _cfg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="PDL needs a Hopper-or-newer GPU")


@pytest.fixture
def pdl(monkeypatch):
    def set_pdl(on: bool) -> None:
        monkeypatch.setattr(envs, "STRATA_PDL", on)
    return set_pdl


def _chain(x, r, weights, nw):
    """60 dependent launches: each layer's output is the next one's input (split-K reduces, prologues, argmax)."""
    split = GemvConfig(block_n=16, block_k=256, split_k=4, num_warps=4, num_stages=3)
    plain = GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=2, evict_first=True)
    for w_up, w_down in weights:
        h, r = gemv_rms_norm(x, r, nw, 1e-6, w_up, config=plain)
        x = gemv_silu_mul(h, w_down, config=split)
        x, r = fused_add_rms_norm(x, r.clone(), nw, 1e-6)
        x = gemv(x, w_up[: x.shape[1]], config=plain)
    return x, r, argmax_rows(x.float().view(1, -1))


def test_pdl_is_on_for_this_gpu(pdl):
    x = torch.zeros(1, device="cuda")
    pdl(True)
    assert pdl_args(x, 1) == {"PDL": True, "launch_pdl": True}
    assert pdl_args(x, PDL_MAX_ROWS) == {"PDL": True, "launch_pdl": True}
    assert pdl_args(x, PDL_MAX_ROWS + 1) == {"PDL": False}  # (small launches only: PDL_MAX_ROWS)
    pdl(False)
    assert pdl_args(x, 1) == {"PDL": False}
    assert pdl_args(x.cpu(), 1) == {"PDL": False}


@pytest.mark.parametrize("graph", [False, True])
def test_kernel_chain_is_identical_with_and_without_pdl(pdl, graph):
    torch.manual_seed(0)
    K, N = 1024, 2048
    weights = [(torch.randn(2 * N, K, device="cuda", dtype=torch.bfloat16) / 32,
                torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / 45) for _ in range(10)]
    nw = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5
    x0 = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    r0 = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    results = {}
    for on in (False, True):
        pdl(on)
        x, r = x0.clone(), r0.clone()
        if not graph:
            results[on] = _chain(x, r, weights, nw)
            continue
        _chain(x, r, weights, nw)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = _chain(x, r, weights, nw)
        for _ in range(3):
            x.copy_(x0)
            r.copy_(r0)
            g.replay()
        results[on] = tuple(t.clone() for t in out)
    torch.cuda.synchronize()
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b), f"PDL changed a result: {(a != b).sum().item()} of {a.numel()} elements differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_graph_is_identical_with_and_without_pdl(pdl, dtype, monkeypatch):
    """The runner's decode step (the rotary + KV store inside split decode attention, GEMVs, norms) replayed in a
    graph. The rotary-in-attention path is chosen only where PDL is on; held on here for both runs, so that only
    the launches differ."""
    monkeypatch.setattr(triton_ops_module, "pdl_enabled", lambda device, rows: rows <= PDL_MAX_ROWS)
    cfg = _cfg(num_layers=6)
    dev = torch.device("cuda")
    bs, nb = 8, 40
    got = {}
    for on in (False, True):
        pdl(on)
        att = TritonAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        model = build_random_model(cfg, dtype, dev, ops=TritonOps(att, use_gemv=True), seed=1)
        kv = allocate_kv_cache(cfg.num_layers, nb + 1, bs, cfg.num_kv_heads, cfg.head_dim, dtype, dev)
        gen = torch.Generator(device=dev).manual_seed(2)
        for k, v in kv:
            k.normal_(generator=gen)
            v.normal_(generator=gen)
        att.bind_kv_cache(kv)

        def step(ids, pos, slots, tables, lens):
            return model(ids, pos, decode_metadata(slots, tables, lens, bs))

        graphs = CudaGraphDecoder(step, 4, 4, dev, pad_slot=-1)
        graphs.capture()
        n = 1
        tables = torch.arange(4, device=dev, dtype=torch.int32).view(1, 4)
        outs = []
        with torch.inference_mode():
            for length in (5, 17, 30):  # three steps, each writing the KV the next one reads
                lens = torch.tensor([length], device=dev, dtype=torch.int32)
                pos = (lens - 1).long()
                slots = tables.gather(1, (pos // bs).view(-1, 1).long()).view(-1).long() * bs + pos % bs
                ids = torch.full((n,), length % cfg.vocab_size, device=dev, dtype=torch.long)
                outs.append(graphs.run(ids, pos, slots, tables, lens).clone())
        got[on] = (torch.stack(outs), [(k.clone(), v.clone()) for k, v in kv])
    assert torch.equal(got[False][0], got[True][0])
    for (k0, v0), (k1, v1) in zip(got[False][1], got[True][1]):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


@pytest.mark.parametrize("graph", [False, True])
def test_adaptive_decode_with_rope_is_identical_with_and_without_pdl(pdl, graph):
    """Run 21: an adaptive-split decode launch (more programs than SMs) with the rotary + KV store inside, right
    after the projection that writes its q, k and v. Under PDL each program reads the lengths and block table and
    prefetches its first key tile before it waits: reading q, k or v early would change the output or the cache."""
    from strataserve.kernels.decode_attention import DecodeRope, paged_decode_attention
    from strataserve.kernels.skinny_gemm import skinny_gemm
    from strataserve.models.hf_config import RopeScaling
    from strataserve.models.rope import build_cos_sin_cache

    from .test_attention import _paged_cache

    torch.manual_seed(0)
    B, Hq, Hkv, D, bs, K = 48, 32, 8, 128, 16, 512
    lens = [int(n) for n in torch.randint(20, 300, (B,))]
    kc0, vc0, tables = _paged_cache("cuda", torch.bfloat16, lens, Hkv, D, bs)
    x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn((Hq + 2 * Hkv) * D, K, device="cuda", dtype=torch.bfloat16) / 24
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    pos = (ctx - 1).long()
    slots = tables.long().gather(1, (pos // bs).view(-1, 1)).view(-1) * bs + pos % bs
    cos_sin = build_cos_sin_cache(D, 512, 1e6, RopeScaling(), device="cuda")
    sems = torch.zeros(B * Hkv, dtype=torch.int32, device="cuda")

    def step(kc, vc):
        qkv = skinny_gemm(x, w).view(B, Hq + 2 * Hkv, D)
        rope = DecodeRope(pos, qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:], cos_sin, slots)
        return paged_decode_attention(qkv[:, :Hq], kc, vc, tables, ctx, D ** -0.5, num_splits=4, rope=rope,
                                      split_target=6, num_sms=132, semaphores=sems)
    results = {}
    for on in (False, True):
        pdl(on)
        kc, vc = kc0.clone(), vc0.clone()
        if graph:
            step(kc.clone(), vc.clone())  # compile outside the capture
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = step(kc, vc)
            g.replay()
        else:
            out = step(kc, vc)
        torch.cuda.synchronize()
        results[on] = (out.clone(), kc, vc)
    assert not torch.equal(results[True][1], kc0), "the new tokens' k must be stored"
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b), f"PDL changed a result: {(a != b).sum().item()} of {a.numel()} elements differ"
