"""CUDA-graph decode replay equals the eager step, for padded buckets and both backends (GPU only: conftest.py
leaves this file out of CPU runs)."""
from __future__ import annotations

import pytest
import torch

from strataserve.models.loader import build_random_model
from strataserve.runner.attention import TorchAttention, allocate_kv_cache
from strataserve.runner.cuda_graph import CudaGraphDecoder, decode_metadata
from strataserve.runner.ops import TorchOps
from strataserve.runner.triton_ops import TritonAttention, TritonOps

from ._helpers import assert_close
from .test_triton_ops import _cfg

BS = 8


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("n", [1, 3, 7])
def test_graph_replay_matches_eager(backend, n):
    cfg = _cfg()
    dev = torch.device("cuda")
    att = (TritonAttention if backend == "triton" else TorchAttention)(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    ops = TritonOps(att) if backend == "triton" else TorchOps(att)
    model = build_random_model(cfg, torch.float32, dev, ops=ops, seed=1)
    nb = 40
    kv = allocate_kv_cache(cfg.num_layers, nb + 1, BS, cfg.num_kv_heads, cfg.head_dim, torch.float32, dev)
    for k, v in kv:
        k.normal_()
        v.normal_()
    att.bind_kv_cache(kv)

    def step(ids, pos, slots, tables, lens):
        return model(ids, pos, decode_metadata(slots, tables, lens, BS))

    pad = -1 if backend == "triton" else nb * BS
    graphs = CudaGraphDecoder(step, 8, 4, dev, pad_slot=pad)
    graphs.capture()
    tables = torch.randperm(nb, device=dev)[: n * 4].view(n, 4).to(torch.int32)
    lens = torch.randint(1, 4 * BS, (n,), device=dev, dtype=torch.int32)
    pos = (lens - 1).long()
    slots = tables.gather(1, (pos // BS).view(-1, 1).to(torch.int64)).view(-1).long() * BS + pos % BS
    ids = torch.randint(0, cfg.vocab_size, (n,), device=dev)
    with torch.inference_mode():
        got = graphs.run(ids, pos, slots, tables, lens).clone()
        want = step(ids, pos, slots, tables, lens)
    assert graphs.bucket(n) >= n
    assert_close(got, want, 1e-4, f"graph replay n={n}")
    assert torch.isfinite(got).all()
