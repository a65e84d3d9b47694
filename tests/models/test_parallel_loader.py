"""Tensor-parallel shards without processes: each rank reads only its slice of the safetensors (counted through a
wrapped ``safe_open``), the shards are exactly the slices of the unsplit model, dummy weights agree across splits,
and a model that cannot be split says why."""
from __future__ import annotations

import pytest
import torch

import strataserve.models.loader as loader
from _tiny_models import make_tiny_checkpoint
from strataserve.models.hf_config import load_decoder_config
from strataserve.models.loader import build_random_model, load_model
from strataserve.models.parallel import TensorParallel, check_tensor_parallel


class _CountingFile:
    """A safe_open handle that records every tensor read and the elements each read returned."""

    def __init__(self, inner, log: dict) -> None:
        self.inner, self.log = inner, log

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_tensor(self, name):
        t = self.inner.get_tensor(name)
        self.log.setdefault("whole", {})[name] = t.numel()
        return t

    def get_slice(self, name):
        log, piece = self.log, self.inner.get_slice(name)

        class _Slice:
            def __getitem__(self, idx):
                t = piece[idx]
                log.setdefault("sliced", {})[name] = t.numel()
                return t
        return _Slice()


def _load_counting(monkeypatch, path, tp):
    log: dict = {}
    real = loader.safe_open
    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: _CountingFile(real(*a, **k), log))
    model = load_model(path, "float32", "cpu", tp=tp)
    monkeypatch.setattr(loader, "safe_open", real)
    return model, log


@pytest.mark.parametrize("family,overrides", [("llama", dict(num_key_value_heads=2)),  # KV heads split
                                              ("mistral", {})])  # one KV head: replicated on both ranks
def test_each_rank_reads_only_its_slice(monkeypatch, tmp_path, family, overrides):
    path = make_tiny_checkpoint(family, tmp_path, tokenizer=False, vocab_size=301, **overrides)  # odd vocab
    full = load_model(path, "float32", "cpu")
    cfg = load_decoder_config(path)
    full_params = dict(full.named_parameters())
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        shard, log = _load_counting(monkeypatch, path, tp)
        # only norms are read whole; every projection and the vocab matrices are read as this rank's slice
        assert all(n.endswith("norm.weight") for n in log["whole"])
        sliced = log["sliced"]
        assert "model.layers.0.mlp.down_proj.weight" in sliced and "model.embed_tokens.weight" in sliced
        assert sliced["model.layers.0.mlp.gate_proj.weight"] == cfg.intermediate_size // 2 * cfg.hidden_size
        assert sliced["model.layers.0.self_attn.q_proj.weight"] == cfg.q_size // 2 * cfg.hidden_size
        kv_rows = cfg.kv_size // 2 if cfg.num_kv_heads >= 2 else cfg.kv_size
        assert sliced["model.layers.0.self_attn.k_proj.weight"] == kv_rows * cfg.hidden_size
        vocab_rows = 151 if rank == 0 else 150  # ceil(301 / 2) rows each, the last rank's padded
        assert sliced["model.embed_tokens.weight"] == vocab_rows * cfg.hidden_size
        # and the shard is exactly that slice of the unsplit model
        attn, full_attn = shard.layers[1].self_attn, full.layers[1].self_attn
        q, kv = cfg.q_size // 2, kv_rows
        kv0 = tp.kv_head_start(cfg) * cfg.head_dim
        ref_qkv = torch.cat([full_attn.qkv_weight[rank * q:(rank + 1) * q],
                             full_attn.qkv_weight[cfg.q_size + kv0:cfg.q_size + kv0 + kv],
                             full_attn.qkv_weight[cfg.q_size + cfg.kv_size + kv0:cfg.q_size + cfg.kv_size + kv0 + kv]])
        torch.testing.assert_close(attn.qkv_weight, ref_qkv, atol=0, rtol=0)
        torch.testing.assert_close(attn.o_weight, full_attn.o_weight[:, rank * q:(rank + 1) * q], atol=0, rtol=0)
        i = cfg.intermediate_size // 2
        torch.testing.assert_close(shard.layers[0].mlp.down_weight,
                                   full_params["layers.0.mlp.down_weight"][:, rank * i:(rank + 1) * i], atol=0, rtol=0)
        emb = shard.embed_tokens
        assert emb.shape[0] == 151
        torch.testing.assert_close(emb[:vocab_rows], full.embed_tokens[rank * 151:rank * 151 + vocab_rows],
                                   atol=0, rtol=0)
        assert not emb[vocab_rows:].any()  # padding rows are zero


def test_dummy_weights_are_the_same_model_whatever_the_split(tmp_path):
    path = make_tiny_checkpoint("qwen3", tmp_path, tokenizer=False, vocab_size=256)
    cfg = load_decoder_config(path)
    whole = build_random_model(cfg, seed=5)
    half = build_random_model(cfg, seed=5, tp=TensorParallel(1, 2))
    q = cfg.q_size // 2
    torch.testing.assert_close(half.layers[0].self_attn.qkv_weight[:q], whole.layers[0].self_attn.qkv_weight[q:2 * q],
                               atol=0, rtol=0)
    torch.testing.assert_close(half.layers[1].self_attn.q_norm, whole.layers[1].self_attn.q_norm, atol=0, rtol=0)
    assert whole.layers[0].self_attn.qkv_weight.std() > 0.01
    # load_format="dummy" needs no weight files, only config.json
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    dummy = load_model(path, "float32", "cpu", load_format="dummy")
    torch.testing.assert_close(dummy.norm, build_random_model(cfg).norm, atol=0, rtol=0)
    with pytest.raises(ValueError, match="load_format='npz'"):
        load_model(path, "float32", "cpu", load_format="npz")


def test_models_that_cannot_be_split_say_why(tmp_path):
    cfg = load_decoder_config(make_tiny_checkpoint("llama", tmp_path, tokenizer=False, vocab_size=256))
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(ValueError, match="intermediate_size=128 is not divisible"):
        check_tensor_parallel(cfg, 256)
    check_tensor_parallel(cfg, 4)  # 4 heads, 2 KV heads: each KV head replicated on two ranks
    assert TensorParallel(3, 4).kv_head_start(cfg) == 1 and TensorParallel(1, 4).kv_head_start(cfg) == 0
