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


# ----------------------------------------------------------------------------- streamed loading (run 21)
def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _streamed(monkeypatch, device="cpu", threads=3, chunk=777):
    """load_model's streamer, forced on for ``device`` with tiny chunks (so tensors are cut across workers);
    returns the list of bytes each ``finish`` copied."""
    from strataserve.models import loader, weight_stream

    copied = []

    class Recording(weight_stream.WeightStreamer):
        def finish(self):
            copied.append(super().finish())
            return copied[-1]
    monkeypatch.setattr(loader, "_streamer_for", lambda dev: Recording(torch.device(device), threads, chunk))
    return copied


@pytest.mark.parametrize("stored, dtype, streamed", [("float32", "float32", True), ("bfloat16", "bfloat16", True),
                                                     ("float32", "bfloat16", False)])  # a cast: safetensors reads
def test_streamed_load_matches_the_safetensors_path(tmp_path, monkeypatch, stored, dtype, streamed):
    path = make_tiny_checkpoint("qwen3", tmp_path, tokenizer=False, vocab_size=256, max_shard_size="40KB")
    if stored != "float32":
        for f in path.glob("*.safetensors"):
            save_file({k: v.to(getattr(torch, stored)) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    want = _params(load_model(path, dtype, "cpu"))
    copied = _streamed(monkeypatch)
    got = _params(load_model(path, dtype, "cpu"))
    assert len(copied) == len(list(path.glob("*.safetensors")))  # one streamer pass per shard
    assert (sum(copied) > 0) == streamed
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_streamed_load_mixes_streamed_and_cast_tensors(tmp_path, monkeypatch):
    """A checkpoint whose norms are float32 beside bfloat16 matrices, into a bfloat16 model: the matrices stream,
    the norms are cast by the safetensors path, and both land where they belong."""
    path = make_tiny_checkpoint("llama", tmp_path, tokenizer=False, vocab_size=256)
    f = path / "model.safetensors"
    save_file({k: v if v.dim() == 1 else v.to(torch.bfloat16) for k, v in load_file(f).items()}, f,
              metadata={"format": "pt"})
    want = _params(load_model(path, "bfloat16", "cpu"))
    copied = _streamed(monkeypatch, threads=2, chunk=4096)
    got = _params(load_model(path, "bfloat16", "cpu"))
    matrices = sum(v.numel() * 2 for v in load_file(f).values() if v.dim() == 2)
    assert copied == [matrices]
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_safetensors_header_is_read_as_the_library_reads_it(ckpt):
    from safetensors import safe_open

    from strataserve.models.weight_stream import read_header

    f = ckpt / "model.safetensors"
    header = read_header(f)
    raw = f.read_bytes()
    with safe_open(str(f), framework="pt") as st:
        assert set(header) == set(st.keys())
        for name, stored in header.items():
            t = st.get_tensor(name)
            assert (stored.dtype, stored.shape) == (t.dtype, tuple(t.shape))
            assert stored.nbytes == t.numel() * t.element_size()
            data = raw[stored.offset:stored.offset + stored.nbytes]
            assert data == t.contiguous().view(torch.uint8).numpy().tobytes()


def test_bad_safetensors_files_are_refused_clearly(ckpt, tmp_path):
    from strataserve.models.weight_stream import WeightStreamer, read_header

    raw = (ckpt / "model.safetensors").read_bytes()
    bad = tmp_path / "bad.safetensors"
    for content, match in [(b"\x01", "shorter than its 8-byte header"),
                           ((10 ** 9).to_bytes(8, "little") + b"{}", "exceeds the file"),
                           ((4).to_bytes(8, "little") + b"{nop", "unreadable safetensors header"),
                           (raw[: len(raw) - 16], "lies outside the file")]:
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=match):
            read_header(bad)
    # a file cut short after its header was read: the read says where
    bad.write_bytes(raw)
    name, stored = max(read_header(bad).items(), key=lambda kv: kv[1].nbytes)
    s = WeightStreamer(torch.device("cpu"), threads=2, chunk_bytes=64)
    s.add(bad, stored, torch.empty(stored.shape, dtype=stored.dtype))
    bad.write_bytes(raw[: stored.offset + 10])
    with pytest.raises(OSError, match="ended .* bytes early"):
        s.finish()
    with pytest.raises(ValueError, match="cannot stream"):
        s.add(bad, stored, torch.empty(stored.shape, dtype=torch.float64))
