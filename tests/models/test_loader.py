"""Checkpoint loading: sharded files, dtypes, and a clear error for every missing or inconsistent piece."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from _tiny_models import make_tiny_checkpoint
from strataserve.models.hf_config import load_decoder_config
from strataserve.models.loader import build_random_model, load_model, resolve_dtype


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"), tokenizer=False, vocab_size=256)


def logits(model, n=24):
    ids = torch.arange(n) % model.config.vocab_size
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(n)))


def test_sharded_checkpoint_loads_like_single_file(ckpt, tmp_path):
    sharded = make_tiny_checkpoint("qwen2", tmp_path, tokenizer=False, vocab_size=256, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (sharded / "model.safetensors").exists()
    torch.testing.assert_close(logits(load_model(sharded, "float32", "cpu")), logits(load_model(ckpt, "float32", "cpu")),
                               atol=0, rtol=0)


def test_missing_shard_is_named(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path, tokenizer=False, vocab_size=256, max_shard_size="40KB")
    victim = sorted(path.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ValueError, match=victim.name):
        load_model(path, "float32", "cpu")


def test_missing_weights_and_config(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path, tokenizer=False, vocab_size=256)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(path, "float32", "cpu")
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json is missing"):
        load_model(path, "float32", "cpu")


def test_unsupported_architecture(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path, tokenizer=False, vocab_size=256)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*supported: LlamaForCausalLM"):
        load_model(path, "float32", "cpu")


def test_missing_and_misshaped_tensors(tmp_path):
    path = make_tiny_checkpoint("qwen3", tmp_path, tokenizer=False, vocab_size=256)
    weights = load_file(path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.1.self_attn.k_norm" not in k}, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks tensors.*layers\.1\.self_attn\.k_norm\.weight"):
        load_model(path, "float32", "cpu")
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"][:-1]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj.weight.*shape"):
        load_model(path, "float32", "cpu")
    weights = load_file(path / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(128, 64)
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="mlp.extra.weight"):
        load_model(path, "float32", "cpu")


def test_dtypes(ckpt):
    cfg = load_decoder_config(ckpt)
    assert resolve_dtype("auto", cfg, torch.device("cpu")) == torch.float32
    bf16_cfg = type(cfg)(**{**cfg.__dict__, "torch_dtype": "bfloat16"})
    assert resolve_dtype("auto", bf16_cfg, torch.device("cpu")) == torch.float32  # CPU: half types -> float32
    assert resolve_dtype("auto", bf16_cfg, torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("int8", cfg, torch.device("cpu"))
    ref = logits(load_model(ckpt, "float32", "cpu"))
    for dtype, tol in (("bfloat16", 0.15), ("float16", 0.02)):
        model = load_model(ckpt, dtype, "cpu")
        assert all(p.dtype == getattr(torch, dtype) for p in model.parameters())
        got = logits(model)
        assert got.dtype == torch.float32
        assert (got - ref).abs().max() < tol, dtype


def test_bad_device():
    from strataserve.models.loader import resolve_device

    with pytest.raises(ValueError, match="device="):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_random_model_is_deterministic_and_usable(ckpt):
    cfg = load_decoder_config(ckpt)
    a, b = build_random_model(cfg, seed=3), build_random_model(cfg, seed=3)
    c = build_random_model(cfg, seed=4)
    la, lb, lc = logits(a), logits(b), logits(c)
    assert torch.equal(la, lb) and not torch.equal(la, lc)
    assert torch.isfinite(la).all() and la.std() > 0
    assert a.layers[0].self_attn.qkv_bias is not None  # qwen2 shapes, bias included
