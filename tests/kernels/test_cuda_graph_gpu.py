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


NB = 40  # KV blocks in the pool (block NB is the spare one the torch backend's padding rows write)


def _decoder(backend: str, max_bs: int):
    """A small random model over a random paged cache, and its step's graph decoder (nothing captured yet)."""
    cfg = _cfg()
    dev = torch.device("cuda")
    att = (TritonAttention if backend == "triton" else TorchAttention)(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    ops = TritonOps(att) if backend == "triton" else TorchOps(att)
    model = build_random_model(cfg, torch.float32, dev, ops=ops, seed=1)
    kv = allocate_kv_cache(cfg.num_layers, NB + 1, BS, cfg.num_kv_heads, cfg.head_dim, torch.float32, dev)
    for k, v in kv:
        k.normal_()
        v.normal_()
    att.bind_kv_cache(kv)

    def step(ids, pos, slots, tables, lens):
        return model(ids, pos, decode_metadata(slots, tables, lens, BS))
    graphs = CudaGraphDecoder(step, max_bs, 4, dev, pad_slot=-1 if backend == "triton" else NB * BS)
    return cfg, kv, step, graphs


def _batch(n: int, vocab: int, min_len: int = 1):
    """(ids, positions, slots, block tables, lengths) of n decode rows over distinct random blocks."""
    dev = torch.device("cuda")
    tables = torch.randperm(NB, device=dev)[: n * 4].view(n, 4).to(torch.int32)
    lens = torch.randint(min_len, 4 * BS, (n,), device=dev, dtype=torch.int32)
    pos = (lens - 1).long()
    slots = tables.gather(1, (pos // BS).view(-1, 1).to(torch.int64)).view(-1).long() * BS + pos % BS
    return torch.randint(0, vocab, (n,), device=dev), pos, slots, tables, lens


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("n", [1, 3, 7])
def test_graph_replay_matches_eager(backend, n):
    cfg, _, step, graphs = _decoder(backend, 8)
    graphs.capture()
    ids, pos, slots, tables, lens = _batch(n, cfg.vocab_size)
    with torch.inference_mode():
        got = graphs.run(ids, pos, slots, tables, lens).clone()
        want = step(ids, pos, slots, tables, lens)
    assert graphs.bucket(n) >= n
    assert_close(got, want, 1e-4, f"graph replay n={n}")
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_deferred_buckets_run_in_a_larger_one_then_are_captured_without_touching_the_cache(backend):
    """Run 21 (``strata serve``'s deferred capture): buckets left out at start-up run in the next larger captured
    one; ``capture_next`` adds them later, after real steps have filled the buffers with live slots, and its
    warm-up must not write those slots (the KV of running or cached sequences)."""
    cfg, kv, step, graphs = _decoder(backend, 16)
    nb = NB
    graphs.capture([1, 4])
    assert sorted(graphs.graphs) == [1, 4, 16] and graphs.missing() == [2, 8]
    assert (graphs.bucket(3), graphs.bucket(5), graphs.bucket(2)) == (4, 16, 4)
    n = 5
    ids, pos, slots, tables, lens = _batch(n, cfg.vocab_size, min_len=2)
    with torch.inference_mode():
        before = [(k.clone(), v.clone()) for k, v in kv]
        got16 = graphs.run(ids, pos, slots, tables, lens).clone()  # in the 16 bucket
        after_run = [(k.clone(), v.clone()) for k, v in kv]
        for (k, v), (k0, v0) in zip(kv, before):  # back to where the run started: the 8 bucket's run compares
            k.copy_(k0)
            v.copy_(v0)
        assert graphs.capture_next() and graphs.missing() == [2]  # the 8 bucket; the buffers held live slots
        # (the spare block past the pool, block nb, takes the torch backend's padding rows: not compared)
        for (k, v), (k0, v0) in zip(kv, before):
            assert torch.equal(k[:nb], k0[:nb]) and torch.equal(v[:nb], v0[:nb]), "an idle capture wrote the cache"
        got8 = graphs.run(ids, pos, slots, tables, lens).clone()
        for (k, v), (k1, v1) in zip(kv, after_run):  # the same new K/V (another bucket: not always bit-equal)
            assert_close(k[:nb], k1[:nb], 1e-4, "k cache")
            assert_close(v[:nb], v1[:nb], 1e-4, "v cache")
        want = step(ids, pos, slots, tables, lens)
    assert graphs.bucket(n) == 8
    assert_close(got16, want, 1e-4, "run in a larger bucket")
    assert_close(got8, want, 1e-4, "run in its own bucket, captured later")
    assert not graphs.capture_next() and graphs.missing() == []
