"""The decode GEMM tuning (2-64 rows): which row class a step's matmul takes its plan from, and the choices kept on
disk like the batch-1 ones (measured once, reused by a restart, measured again when an input changes). The timing
needs CUDA graphs, so ``tune_gemm`` and ``tune_gate_up_silu`` are replaced by recorders returning fixed choices."""
from __future__ import annotations

import types

import pytest
import torch

from strataserve import envs
from strataserve.kernels import _common
from strataserve.kernels.skinny_gemm import GemmConfig
from strataserve.models.hf_config import DecoderConfig, RopeScaling
from strataserve.models.loader import build_random_model
from strataserve.runner import gemm_tuning
from strataserve.runner.attention import TorchAttention
from strataserve.runner.ops import TorchOps

CFG = DecoderConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                    rope_scaling=RopeScaling(), max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False,
                    qk_norm=False, bos_token_id=1, eos_token_ids=(2,), torch_dtype="float32")


def test_row_classes():
    assert [gemm_tuning.plan_rows(r) for r in (0, 1, 2, 16, 17, 64, 65, 4096)] == [None, None, 16, 16, 64, 64,
                                                                                    None, None]
    assert gemm_tuning.MAX_ROWS == 64


def test_row_classes_from_the_environment(monkeypatch):
    """``STRATA_GEMM_ROWS`` (run 24): more classes send larger steps to their own plans; bad lists are refused."""
    assert envs._row_classes("16,64,128,256") == (16, 64, 128, 256)
    for bad in ("", "64,16", "1,64", "16,16", "16;64", "a"):
        with pytest.raises(ValueError, match="STRATA_GEMM_ROWS"):
            envs._row_classes(bad)
    monkeypatch.setattr(gemm_tuning, "ROW_CLASSES", tuple((r, r) for r in envs._row_classes("16,64,128,256")))
    assert [gemm_tuning.plan_rows(r) for r in (1, 2, 64, 65, 128, 129, 256, 257)] == [None, 16, 64, 128, 128, 256,
                                                                                    256, None]


def test_gemm_choices_are_kept_and_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(envs, "STRATA_KERNEL_CACHE", str(tmp_path))
    cfg = CFG
    model = build_random_model(cfg, torch.float32, "cpu",
                               ops=TorchOps(TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)), seed=0)
    down = tuple(model.layers[0].mlp.down_weight.shape)
    win = GemmConfig(64, 32, 256, evict_first=True)
    calls = []

    def fake_tune(weights):
        calls.append(sorted(weights))
        return [gemm_tuning.GemmChoice(s, rows, 10.0, 8.0 if s == down else 12.0, win if s == down and rows == 64
                                       else None) for s in weights for rows, _ in gemm_tuning.ROW_CLASSES]

    gate_up = tuple(model.layers[0].mlp.gate_up_weight.shape)
    fused = GemmConfig(64, 64, 64, num_stages=5)

    def fake_silu(weights, plain):  # sees the plain choices (its baseline is gate_up's choice + the activation)
        assert len(plain) == 2 * len(calls[-1])
        return [gemm_tuning.GemmChoice(s, rows, 10.0, 9.0, fused if rows == 16 else None, "silu")
                for s in weights for rows, _ in gemm_tuning.ROW_CLASSES]

    monkeypatch.setattr(gemm_tuning, "tune_gemm", fake_tune)
    monkeypatch.setattr(gemm_tuning, "tune_gate_up_silu", fake_silu)
    plans = []
    for _ in range(2):  # a start, then a restart
        ops = types.SimpleNamespace()
        choices = gemm_tuning.apply_gemm_tuning(model, ops)
        plans.append((ops.gemm_plan, ops.silu_plan))
    assert len(calls) == 1 and down in calls[0]  # measured once
    assert plans[0] == plans[1] == ({(64, down): win}, {(16, gate_up): fused})  # the kinds kept apart on disk
    assert len(choices) == 2 * len(calls[0]) + 2 and len(list(tmp_path.glob("gemm-*.json"))) == 1
    monkeypatch.setattr(envs, "STRATA_GEMM_SILU", False)  # the switch: the record stays, the epilogue is not used
    ops = types.SimpleNamespace()
    gemm_tuning.apply_gemm_tuning(model, ops)
    assert len(calls) == 1 and ops.gemm_plan == {(64, down): win} and ops.silu_plan == {}

    monkeypatch.setattr(gemm_tuning, "CANDIDATES", gemm_tuning.CANDIDATES[:2])  # another input: measured again
    gemm_tuning.apply_gemm_tuning(model, types.SimpleNamespace())
    assert len(calls) == 2 and len(list(tmp_path.glob("gemm-*.json"))) == 2
    monkeypatch.setattr(_common, "PDL_MAX_ROWS", 1)  # PDL changes the timings too
    gemm_tuning.apply_gemm_tuning(model, types.SimpleNamespace())
    assert len(calls) == 3 and len(list(tmp_path.glob("gemm-*.json"))) == 3
