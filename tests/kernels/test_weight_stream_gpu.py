"""The pinned-buffer weight streamer on a GPU (``models/weight_stream.py``), load_model's default there: pinned
buffers, one CUDA stream per worker. GPU only: conftest.py leaves this file out of CPU runs (the CPU suite runs the
same streamer with plain buffers, tests/models/test_loader.py)."""
from __future__ import annotations

import torch

from _tiny_models import make_tiny_checkpoint
from strataserve.models import loader
from strataserve.models.weight_stream import WeightStreamer


def test_streamed_load_on_a_gpu_matches_the_cpu_load(tmp_path, monkeypatch):
    ckpt = make_tiny_checkpoint("qwen2", tmp_path, tokenizer=False, vocab_size=256, max_shard_size="40KB")
    want = {n: p.detach().clone() for n, p in loader.load_model(ckpt, "float32", "cpu").named_parameters()}
    copied = []

    class Recording(WeightStreamer):
        def finish(self):
            copied.append(super().finish())
            return copied[-1]
    # small chunks, so tensors are cut across the four workers and each buffer is reused many times
    monkeypatch.setattr(loader, "_streamer_for", lambda dev: Recording(dev, threads=4, chunk_bytes=1 << 12))
    model = loader.load_model(ckpt, "float32", "cuda")
    assert len(copied) > 1 and all(n > 0 for n in copied)
    for name, p in model.named_parameters():
        assert torch.equal(p.cpu(), want[name]), name
