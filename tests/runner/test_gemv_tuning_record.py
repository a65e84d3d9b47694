"""The batch-1 tuning's choices kept on disk: measured once, reused by a restart with the same inputs, measured
again when an input changes (here the prologue switch); the plans installed are the same either way. The timing
itself needs CUDA graphs, so ``tune_gemv`` / ``tune_prologues`` are replaced by recorders returning fixed choices."""
from __future__ import annotations

import types

import torch

from strataserve import envs
from strataserve.kernels.gemv import GemvConfig
from strataserve.models.hf_config import DecoderConfig, RopeScaling
from strataserve.models.loader import build_random_model
from strataserve.runner import gemv_tuning
from strataserve.runner.attention import TorchAttention
from strataserve.runner.ops import TorchOps

CFG = DecoderConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                    rope_scaling=RopeScaling(), max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False,
                    qk_norm=False, bos_token_id=1, eos_token_ids=(2,), torch_dtype="float32")


def test_tuning_choices_are_kept_and_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(envs, "STRATA_KERNEL_CACHE", str(tmp_path))
    cfg = CFG
    model = build_random_model(cfg, torch.float32, "cpu",
                               ops=TorchOps(TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)), seed=0)
    qkv = tuple(model.layers[0].self_attn.qkv_weight.shape)
    down = tuple(model.layers[0].mlp.down_weight.shape)
    calls = []

    def fake_plain(weights):
        calls.append("plain")
        return [gemv_tuning.ShapeChoice(s, 10.0, 8.0 if s == qkv else 11.0, GemvConfig(block_n=8) if s == qkv
                                        else None) for s in weights]

    def fake_prologues(weights, plain, ranked=None):
        calls.append(("prologue", dict(plain)))
        return [gemv_tuning.ShapeChoice(s, 9.0, 7.0, GemvConfig(split_k=2, evict_first=True) if k == "silu" else None,
                                        k) for k, s in weights]

    monkeypatch.setattr(gemv_tuning, "tune_gemv", fake_plain)
    monkeypatch.setattr(gemv_tuning, "tune_prologues", fake_prologues)
    monkeypatch.setattr(envs, "STRATA_GEMV_PROLOGUE", True)
    plans = []
    for _ in range(2):  # a start, then a restart
        ops = types.SimpleNamespace()
        gemv_tuning.apply_tuning(model, ops)
        plans.append((ops.gemv_plan, ops.prologue_plan))
    assert calls == ["plain", ("prologue", {qkv: GemvConfig(block_n=8)})]  # measured once
    assert plans[0] == plans[1] == ({qkv: GemvConfig(block_n=8)}, {("silu", down): GemvConfig(split_k=2,
                                                                                                evict_first=True)})
    assert len(list(tmp_path.glob("gemv-*.json"))) == 1

    monkeypatch.setattr(envs, "STRATA_GEMV_PROLOGUE", False)  # another input: measured again, kept apart
    ops = types.SimpleNamespace()
    gemv_tuning.apply_tuning(model, ops)
    assert calls[2:] == ["plain"] and ops.prologue_plan == {}
    assert len(list(tmp_path.glob("gemv-*.json"))) == 2

    for f in tmp_path.glob("gemv-*.json"):  # a damaged record is measured again, not trusted
        f.write_text("{not json")
    gemv_tuning.apply_tuning(model, types.SimpleNamespace())
    assert calls[3:] == ["plain"]


def test_tuning_ranks_and_chooses_with_a_margin(monkeypatch):
    """The selection logic of ``tune_gemv`` / ``tune_prologues`` with the CUDA-graph timer replaced by fixed
    times in call order (per shape: the baseline, then each candidate): a configuration that fails is left out,
    one is chosen only if it beats the baseline by ``min_gain``, and the prologues try the plain GEMV's two
    fastest configurations of their shape (the norm also their 32-row versions, here one: a and b differ only in
    their row count)."""
    a, b, c = GemvConfig(block_n=4), GemvConfig(block_n=8), GemvConfig(block_n=16)
    times = iter([10.0, 9.5, 12.0, RuntimeError("out of shared memory"),   # shape X: baseline, a, b, c
                  10.0, 9.9, 9.8, 9.75,                                     # shape Y: nothing 3% faster
                  10.0, 9.8, 8.0,                                           # silu on X: tries a, b only
                  10.0, 9.9, 9.9, 8.5])                                     # norm on X: a, b, then 32 rows

    def fake_seconds(fn, reps):
        t = next(times)
        if isinstance(t, Exception):
            raise t
        return t * len(ws)

    ws = [torch.zeros(4, 8), torch.zeros(4, 8)]
    monkeypatch.setattr(gemv_tuning, "_graph_seconds", fake_seconds)
    plain = gemv_tuning.tune_gemv({(4, 8): ws, (6, 8): ws}, candidates=(a, b, c))
    assert [(p.shape, p.config, p.ranked) for p in plain] == [((4, 8), a, (a, b)), ((6, 8), None, (c, b))]
    assert plain[0].baseline_us == 10e6 and plain[0].best_us == 9.5e6
    fused = gemv_tuning.tune_prologues({("silu", (4, 8)): ws, ("norm", (4, 8)): ws}, {(4, 8): a},
                                       ranked={p.shape: p.ranked for p in plain})
    assert [(f.prologue, f.shape, f.config) for f in fused] == [("silu", (4, 8), b),
                                                                 ("norm", (4, 8), GemvConfig(block_n=32))]
    assert next(times, None) is None  # exactly the timings expected, no more
