"""The mixed-step graph's padded forward (runner/mixed_graph.py) against the eager forward, on CPU under Triton's
interpreter without capturing: the same static buffers, padding rows, decode rows and tile map as a replay. Steps
are built by the runner's own batch builder; hidden states and the KV caches must match the PyTorch model's."""
from __future__ import annotations

import pytest
import torch

from strataserve.models.loader import build_random_model
from strataserve.runner.attention import TorchAttention, allocate_kv_cache
from strataserve.runner.input_batch import build_input_batch
from strataserve.runner.mixed_graph import MixedStepGraphs, mixed_graph_sizes
from strataserve.runner.ops import TorchOps
from strataserve.runner.triton_ops import TritonAttention, TritonOps
from strataserve.types.outputs import ScheduledChunk

from ._helpers import assert_close
from .test_triton_ops import _cfg

BS = 8


def test_mixed_graph_sizes():
    assert mixed_graph_sizes(80) == [32, 64, 80]
    s = mixed_graph_sizes(8192)
    assert s[:3] == [32, 64, 96] and s[-1] == 8192 and 1056 in s and 2048 in s and 2112 in s and 4224 in s
    assert all(b - a <= (32 if b <= 2048 else 64 if b <= 4096 else 128) for a, b in zip(s, s[1:]))
    assert mixed_graph_sizes(20) == [20]
    with pytest.raises(ValueError):
        mixed_graph_sizes(0)


# padding rows past the decode rows get no attention output (the kernels write only rows they own), so what they
# compute from its uninitialised memory may overflow; they are row-wise apart from the real rows, which must match
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("qk_norm,split_target", [(False, 0), (True, 6)], ids=["llama", "qwen3-adaptive-splits"])
def test_padded_mixed_forward_matches_eager(device, qk_norm, split_target):
    """split_target 6: the padded decode rows take the in-kernel split choice (``decode_rows_padded``)."""
    cfg = _cfg(num_kv_heads=1, qk_norm=True, head_dim=32) if qk_norm else _cfg()
    dt = torch.float32
    models, caches = {}, {}
    for name, ops in (("torch", TorchOps(TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))),
                      ("triton", TritonOps(TritonAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                           num_sms=1, split_target=split_target)))):
        models[name] = build_random_model(cfg, dt, device, ops=ops, seed=5)
        caches[name] = allocate_kv_cache(cfg.num_layers, 24, BS, cfg.num_kv_heads, cfg.head_dim, dt, device)
        ops.attention.bind_kv_cache(caches[name])
    graphs = MixedStepGraphs(models["triton"], max_tokens=80, max_decodes=4, max_prefills=3, max_blocks_per_seq=8,
                             hidden_size=cfg.hidden_size, dtype=dt, device=torch.device(device),
                             use_graphs=device == "cuda")  # on the GPU: captured and replayed
    if device == "cuda" and split_target:  # every bucket captured up front, as the idle engine does (largest
        while graphs.capture_next():          # first, one pool), then replayed in any order; the other case
            pass                              # captures each bucket when a step first needs it
        assert set(graphs.graphs) == set(graphs.sizes)
    tables = {"a": [7, 2, 9, 4, 13, 20], "b": [0, 11, 5, 3], "c": [1, 6, 8, 10, 12, 14]}
    g = torch.Generator().manual_seed(1)

    def chunk(rid, start, n, sample=True):
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
        return ScheduledChunk(rid, ids, start, tables[rid], sample)

    steps = [
        [chunk("a", 0, 13), chunk("b", 0, 6)],                          # two prompts: 19 tokens, bucket 32
        [chunk("b", 6, 1), chunk("a", 13, 9), chunk("c", 0, 5, False)],  # a decode, a chunk after its prefix, a
                                                                         # fresh chunk: 15 tokens (stale rows 15-18)
        [chunk("a", 22, 1), chunk("b", 7, 1), chunk("c", 5, 1)],        # decodes only: 3 tokens
        [chunk("b", 8, 1), chunk("c", 6, 38)],                          # 39 tokens: bucket 64, 40 tiles' worth
        [chunk("a", 23, 1)],                                             # one decode (stale decode rows 1-3)
    ]
    used = set()
    for chunks in steps:
        batches = {n: build_input_batch(chunks, BS, torch.device(device), dt, torch_views=n == "torch",
                                        tile_map=n == "triton")
                   for n in models}
        t = batches["triton"].input_ids.shape[0]
        meta = batches["triton"].attn_meta
        assert graphs.can_run(meta, t)
        used.add(graphs.bucket(t))
        with torch.inference_mode():
            ref = models["torch"](batches["torch"].input_ids, batches["torch"].positions, batches["torch"].attn_meta)
            got = graphs.run(batches["triton"].input_ids, batches["triton"].positions, meta)
        assert got is not None and got.shape == ref.shape
        assert_close(got, ref, 1e-4, f"hidden of step {[(c.req_id, c.start_pos, len(c.token_ids)) for c in chunks]}")
    assert used == {32, 64}
    for (kt, vt), (kr, vr) in zip(caches["triton"], caches["torch"]):
        assert_close(kt, kr, 1e-5, "k cache")  # padding rows stored nothing, every real row its own K/V
        assert_close(vt, vr, 1e-5, "v cache")


def test_can_run_limits(device):
    cfg = _cfg()
    model = build_random_model(cfg, torch.float32, device, ops=TritonOps(TritonAttention(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, num_sms=1)), seed=5)
    graphs = MixedStepGraphs(model, max_tokens=64, max_decodes=4, max_prefills=2, max_blocks_per_seq=4,
                             hidden_size=cfg.hidden_size, dtype=torch.float32, device=torch.device(device),
                             use_graphs=False)

    def meta(chunks):
        b = build_input_batch(chunks, BS, torch.device(device), torch.float32, torch_views=False, tile_map=True)
        return b.attn_meta, b.input_ids.shape[0]

    assert graphs.capture_next() is False  # nothing to capture without graphs (CPU): the idle hook stops at once
    table = list(range(8))
    assert graphs.can_run(*meta([ScheduledChunk("a", [1] * 20, 0, table, True)]))
    no_map = build_input_batch([ScheduledChunk("a", [1] * 20, 0, table, True)], BS, torch.device(device),
                               torch.float32, torch_views=False)
    assert no_map.attn_meta.prefill_tiles is None and not graphs.can_run(no_map.attn_meta, 20)  # no tile map
    assert not graphs.can_run(*meta([ScheduledChunk(r, [1] * 3, 0, table, True) for r in "abc"]))  # 3 prefills
    assert not graphs.can_run(*meta([ScheduledChunk("a", [1] * 65, 0, table + [9], True)]))  # > 64 tokens
    assert not graphs.can_run(*meta([ScheduledChunk("a", [1] * 8, 30, table, True)]))  # 5 blocks > 4
