"""The C layer ops (``runner/cpu_layer_ops.c`` behind ``CpuOps``) against ``TorchOps``, the PyTorch reference:
residual add + RMSNorm, SiLU-and-mul, and (q/k norm,) rotary + K/V store + attention on a step built by the real
input batcher; the fallbacks for what the C path does not take; and the runner choosing it."""
from __future__ import annotations

import random

import pytest
import torch

from strataserve import envs
from strataserve.models.hf_config import DecoderConfig, RopeScaling
from strataserve.models.rope import build_cos_sin_cache
from strataserve.runner import cpu_kernel
from strataserve.runner.attention import TorchAttention
from strataserve.runner.cpu_attention import CpuPagedAttention
from strataserve.runner.cpu_ops import CpuOps
from strataserve.runner.execution_plan import select_ops
from strataserve.runner.input_batch import build_input_batch
from strataserve.runner.ops import TorchOps
from strataserve.types.outputs import ScheduledChunk

CPU = torch.device("cpu")
LIB = cpu_kernel.load_layer_ops()  # make install puts a C compiler on the machine: a None here fails the tests


def pair(attention_factory=lambda: TorchAttention(4, 2, 16)):
    return TorchOps(attention_factory()), CpuOps(attention_factory(), LIB)


@pytest.mark.parametrize("rows,h", [(1, 64), (7, 256), (300, 256), (129, 96)])
def test_add_rms_norm_and_rms_norm(rows, h):
    ref, ops = pair()
    gen = torch.Generator().manual_seed(rows)
    x, res, w = torch.randn(rows, h, generator=gen), torch.randn(rows, h, generator=gen), torch.randn(h, generator=gen)
    want, want_res = ref.fused_add_rms_norm(x.clone(), res, w, 1e-6)
    xc = x.clone()
    got, got_res = ops.fused_add_rms_norm(xc, res, w, 1e-6)
    assert got_res.data_ptr() == xc.data_ptr()  # the residual stream is updated in place, as TorchOps does
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    # a strided view of rows (e.g. the last token of each prompt): the C path reads through the row stride
    wide = torch.randn(rows, 2 * h, generator=gen)
    torch.testing.assert_close(ops.rms_norm(wide[:, :h], w, 1e-6), ref.rms_norm(wide[:, :h].clone(), w, 1e-6),
                               rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows,n", [(1, 8), (33, 688), (300, 688)])
def test_silu_and_mul(rows, n):
    ref, ops = pair()
    x = torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(n)) * 6  # saturated both ways too
    x[0, 0], x[0, 1] = 100.0, -100.0
    torch.testing.assert_close(ops.silu_and_mul(x), ref.silu_and_mul(x.clone()), rtol=2e-6, atol=1e-6)


def _step(bs: int, nblocks: int, rng: random.Random):
    free = list(range(nblocks))
    rng.shuffle(free)
    chunks = []
    for i in range(20):
        n_new = 1 if i < 16 else rng.randint(2, 9)  # decodes, chunks after cached tokens, fresh prompts
        start = rng.randint(0, 40) if i < 18 else 0
        table = [free.pop() for _ in range(-(-(start + n_new) // bs))]
        chunks.append(ScheduledChunk(f"r{i}", [0] * n_new, start, table, sample=True))
    return build_input_batch(chunks, bs, CPU, torch_views=False).attn_meta, chunks


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attend_rotates_stores_and_attends_like_torch_ops(qk_norm):
    """One layer's attend on a mixed step: the same cache contents (bitwise without q/k norm: the rotary rounds
    as PyTorch does) and the same attention output as the PyTorch rotary + index_copy path."""
    hq, hkv, d, bs, nblocks = 4, 2, 16, 4, 200
    rng, gen = random.Random(qk_norm), torch.Generator().manual_seed(int(qk_norm))
    meta, _ = _step(bs, nblocks, rng)
    t = meta.slot_mapping.shape[0]
    positions = torch.randint(0, 60, (t,), generator=gen)
    cos_sin = build_cos_sin_cache(d, 64, 1e4, RopeScaling())
    qn, kn = (torch.randn(d, generator=gen), torch.randn(d, generator=gen)) if qk_norm else (None, None)
    caches = (torch.randn(nblocks, bs, hkv, d, generator=gen), torch.randn(nblocks, bs, hkv, d, generator=gen))
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    outs = []
    for ops in pair(lambda: CpuPagedAttention(hq, hkv, d)):
        ops.attention.bind_kv_cache([tuple(c.clone() for c in caches)])
        x = qkv.clone()
        q, k, v = x.split([hq * d, hkv * d, hkv * d], dim=-1)
        outs.append((ops.attend(0, positions, q, k, v, d, cos_sin, qn, kn, 1e-6, meta), ops.attention.kv_caches[0]))
    (want, want_cache), (got, got_cache) = outs
    tol = dict(rtol=2e-6, atol=2e-6) if qk_norm else dict(rtol=0, atol=0)
    for a, b in zip(got_cache, want_cache):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_attend_without_a_cache_rotates_only():
    """No metadata (one causal sequence, no KV cache): rotary in C, then the backend's own attention."""
    ref, ops = pair()
    gen = torch.Generator().manual_seed(3)
    qkv, positions = torch.randn(9, 8 * 16, generator=gen), torch.arange(9)
    cos_sin = build_cos_sin_cache(16, 16, 1e4, RopeScaling())
    got = ops.attend(0, positions, *qkv.clone().split([64, 32, 32], -1), 16, cos_sin, None, None, 1e-6, None)
    want = ref.attend(0, positions, *qkv.clone().split([64, 32, 32], -1), 16, cos_sin, None, None, 1e-6, None)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_what_the_c_path_does_not_take_falls_back_to_torch_ops():
    """bfloat16 tensors and q/k/v that are not one packed row go through TorchOps unchanged (bitwise equal)."""
    ref, ops = pair()
    gen = torch.Generator().manual_seed(5)
    x, res, w = (torch.randn(*shape, generator=gen).bfloat16() for shape in ((5, 32), (5, 32), (32,)))
    assert torch.equal(ops.fused_add_rms_norm(x.clone(), res, w, 1e-6)[0],
                       ref.fused_add_rms_norm(x.clone(), res, w, 1e-6)[0])
    g = torch.randn(5, 64, generator=gen).bfloat16()
    assert torch.equal(ops.silu_and_mul(g.clone()), ref.silu_and_mul(g.clone()))
    q, k, v = (torch.randn(4, n, generator=gen) for n in (64, 32, 32))  # separate tensors: not packed
    cos_sin = build_cos_sin_cache(16, 8, 1e4, RopeScaling())
    got = ops.attend(0, torch.arange(4), q.clone(), k.clone(), v.clone(), 16, cos_sin, None, None, 1e-6, None)
    want = ref.attend(0, torch.arange(4), q.clone(), k.clone(), v.clone(), 16, cos_sin, None, None, 1e-6, None)
    assert torch.equal(got, want)


def _config() -> DecoderConfig:
    return DecoderConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=128,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                         rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False,
                         qk_norm=False, bos_token_id=None, eos_token_ids=(), torch_dtype="float32")


def test_the_eager_cpu_runner_picks_cpu_ops_unless_switched_off(monkeypatch):
    assert type(select_ops("eager", _config(), CPU, cpu_kernel=True).ops) is CpuOps
    assert type(select_ops("eager", _config(), CPU).ops) is TorchOps  # e.g. an fp8/int8 KV cache
    monkeypatch.setattr(envs, "STRATA_CPU_LAYER_OPS", False)
    assert type(select_ops("eager", _config(), CPU, cpu_kernel=True).ops) is TorchOps


def test_without_a_compiler_the_runner_keeps_torch_ops(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert cpu_kernel.load_layer_ops.__wrapped__() is None  # the cached library of this process stays as it is
    assert "no C compiler" in caplog.text
    monkeypatch.setattr(cpu_kernel, "load_layer_ops", lambda: None)
    assert type(select_ops("eager", _config(), CPU, cpu_kernel=True).ops) is TorchOps
