"""TritonOps (kernels) against TorchOps (PyTorch) inside the real decoder: prefill, then a mixed step of a decode
and a prefill chunk over a cached prefix; hidden states and the KV caches must agree. Also the decode-graph
metadata and the bucket sizes of runner/cuda_graph.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from strataserve import envs
from strataserve.kernels import _common
from strataserve.kernels._common import PDL_MAX_ROWS
from strataserve.kernels.gemv import GemvConfig
from strataserve.kernels.skinny_gemm import GemmConfig
from strataserve.models.hf_config import DecoderConfig, RopeScaling
from strataserve.models.loader import build_random_model
from strataserve.runner.attention import AttentionMetadata, PrefillSegment, TorchAttention, allocate_kv_cache
from strataserve.runner.cuda_graph import decode_metadata, graph_batch_sizes
from strataserve.runner.gemv_tuning import one_row_weights
from strataserve.runner.ops import TorchOps
from strataserve.kernels.decode_attention import default_num_splits
from strataserve.runner import triton_ops as triton_ops_module
from strataserve.runner.triton_ops import ADAPTIVE_MIN_CAP, TritonAttention, TritonOps, decode_launch

from ._helpers import assert_close

BS = 8  # block size


def _cfg(**kw) -> DecoderConfig:
    base = DecoderConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=64, intermediate_size=96,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                         rope_theta=10000.0, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32),
                         max_position_embeddings=256, tie_word_embeddings=False, qkv_bias=False, qk_norm=False,
                         bos_token_id=1, eos_token_ids=(2,), torch_dtype="float32")
    return dataclasses.replace(base, **kw)


def _meta(decodes, prefills, tables, device):
    """decodes: [(seq, ctx_len)], prefills: [(seq, context_len, query_len)]; decode tokens first."""
    slots, pos = [], []
    for s, ctx in decodes:
        p = ctx - 1
        slots.append(tables[s][p // BS] * BS + p % BS)
        pos.append(p)
    segs, start = [], len(decodes)
    for s, ctx, q in prefills:
        total = ctx + q
        nblk = (total + BS - 1) // BS
        ids = torch.tensor(tables[s][:nblk], device=device)
        mask = torch.arange(total, device=device)[None, :] <= torch.arange(ctx, total, device=device)[:, None]
        segs.append(PrefillSegment(start, q, ctx, ids if ctx else None, mask if ctx else None))
        for p in range(ctx, total):
            slots.append(tables[s][p // BS] * BS + p % BS)
            pos.append(p)
        start += q
    i32 = dict(dtype=torch.int32, device=device)
    if decodes:
        d = decode_metadata(torch.tensor(slots[: len(decodes)], device=device),
                            torch.tensor([tables[s] for s, _ in decodes], **i32),
                            torch.tensor([c for _, c in decodes], **i32), BS)
        groups, dbt, dcl = d.decode_groups, d.decode_block_tables, d.decode_context_lens
    else:
        groups, dbt, dcl = [], torch.zeros(0, 1, **i32), torch.zeros(0, **i32)
    qsl = [len(decodes)]
    for _, _, q in prefills:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device), num_decode_tokens=len(decodes),
        decode_block_tables=dbt, decode_context_lens=dcl, prefill_query_start_loc=torch.tensor(qsl, **i32),
        prefill_context_lens=torch.tensor([c for _, c, _ in prefills], **i32),
        prefill_seq_lens=torch.tensor([c + q for _, c, q in prefills], **i32),
        prefill_block_tables=torch.tensor([tables[s] for s, _, _ in prefills], **i32).view(len(prefills), 4),
        decode_groups=groups, prefills=segs)
    return meta, torch.tensor(pos, device=device)


_SPLIT_K = GemvConfig(block_n=8, block_k=32, split_k=2)


@pytest.mark.parametrize("cfg,variant", [(_cfg(), "fused"), (_cfg(num_kv_heads=1, qk_norm=True, head_dim=32), "fused"),
                                         (_cfg(num_kv_heads=1, qk_norm=True, head_dim=32), "unfused"),
                                         (_cfg(), "adaptive")],
                         ids=["llama3", "qwen3", "qwen3-unfused-run5", "llama3-adaptive-splits"])
def test_triton_ops_match_torch_ops_in_decoder(device, cfg, variant, monkeypatch):
    """fused: (q/k norm +) rotary + KV store in one kernel, the batch-1 step's matmuls through a split-K GEMV plan
    (as the start-up tuning would install) and the default GEMV, the norms and SiLU-mul as GEMV prologues, the
    batch-1 step's rotary + store inside decode attention, the 2-64-row matmuls through the few-rows GEMM where a
    plan names them (split with the in-kernel combine, plain) and gate_up with its SiLU-and-mul epilogue; unfused:
    the run-5 sequence of kernels."""
    if device == "cpu":  # the interpreter has no PDL: let the batch-1 step take the rotary-in-attention path anyway
        monkeypatch.setattr(triton_ops_module, "pdl_enabled", lambda dev, rows: rows <= PDL_MAX_ROWS)
    dt = torch.float32
    models, caches = {}, {}
    qkv, h, i = (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), cfg.hidden_size, cfg.intermediate_size
    plan = {qkv: _SPLIT_K, (h, cfg.q_size): _SPLIT_K}
    # steps of 2 and 10 rows take the 16-row class's plan, the 19-token prompt step the 64-row one
    gemm = {(16, qkv): GemmConfig(16, 16, 32, split_k=2), (16, (h, i)): GemmConfig(32, 32, 32),
            (64, (2 * i, h)): GemmConfig(16, 32, 16), (64, (cfg.vocab_size, h)): GemmConfig(32, 16, 32, split_k=2)}
    silu = {(16, (2 * i, h)): GemmConfig(16, 16, 32)}  # gate_up + SiLU epilogue in the 2- and 10-row steps
    prologues = {("norm", qkv): _SPLIT_K, ("norm", (2 * i, h)): GemvConfig(block_n=16, block_k=32),
                 ("silu", (h, i)): _SPLIT_K}
    # num_sms=1 keeps the interpreter's program count small: 4 splits per decode row (fused), 1 (run-5 launch)
    # adaptive: 1 SM, so every decode step here (2-4 programs) takes the in-kernel split choice (decode_launch)
    fused = variant != "unfused"
    triton_ops = TritonOps(TritonAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, num_sms=1,
                                           long_first=fused, split_target=6 if variant == "adaptive" else 0),
                           use_gemv=True, gemv_plan=plan if fused else None, fused_rope_kv=fused,
                           prologue_plan=prologues if variant == "fused" else None,
                           gemm_plan=gemm if variant == "fused" else None,
                           silu_plan=silu if variant == "fused" else None)
    for name, ops in (("torch", TorchOps(TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))),
                      ("triton", triton_ops)):
        models[name] = build_random_model(cfg, dt, device, ops=ops, seed=3)
        caches[name] = allocate_kv_cache(cfg.num_layers, 12, BS, cfg.num_kv_heads, cfg.head_dim, dt, device)
        ops.attention.bind_kv_cache(caches[name])
    tables = [[7, 2, 9, 4], [0, 11, 5, 3]]  # shuffled blocks
    steps = [([], [(0, 0, 13), (1, 0, 6)]),        # two prompts
             ([(1, 7)], [(0, 13, 9)]),             # decode seq 1 + a chunk of seq 0 over its cached prefix
             ([(0, 23), (1, 8)], []),              # pure decode
             ([(0, 24)], [])]                      # batch 1: the GEMV path of TritonOps.linear
    for decodes, prefills in steps:
        meta, pos = _meta(decodes, prefills, tables, device)
        ids = torch.randint(0, cfg.vocab_size, pos.shape, device=device)
        with torch.inference_mode():
            h = {n: m(ids, pos, meta) for n, m in models.items()}
        assert_close(h["triton"], h["torch"], 1e-4, f"hidden after {decodes} {prefills}")
    for (kt, vt), (kr, vr) in zip(caches["triton"], caches["torch"]):
        assert_close(kt, kr, 1e-5, "k cache")
        assert_close(vt, vr, 1e-5, "v cache")


def test_decode_launch_policy():
    """Adaptive splits exactly for launches of one to four programs per SM, never fewer splits than run 6's launch
    allows (the grid is only the upper bound), and off when split_target is 0."""
    for rows in range(1, 300):
        fixed = default_num_splits(rows, 8, 132, programs_per_sm=16)
        splits, target = decode_launch(rows, 8, 132, 16, 6)
        adaptive = 132 <= rows * 8 <= 4 * 132
        assert target == (6 if adaptive else 0), rows
        assert splits == (max(fixed, ADAPTIVE_MIN_CAP) if adaptive else fixed), rows
        assert decode_launch(rows, 8, 132, 16, 0) == (fixed, 0)
        # a padded grid (mixed-step graph): always the in-kernel choice, unless splits are off altogether
        assert decode_launch(rows, 8, 132, 16, 6, padded=True) == (max(fixed, ADAPTIVE_MIN_CAP), 6)
        assert decode_launch(rows, 8, 132, 16, 0, padded=True) == (fixed, 0)


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_batch_sizes(36)[-2:] == [32, 36]
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_graph_decoder_buckets_and_oversize_batch(device):
    """Bucket choice and the clear error for a batch the graphs cannot hold (no capture needed for these); with
    buckets left for later (run 21's deferred capture) a batch replays the next larger captured one."""
    from strataserve.runner.cuda_graph import CudaGraphDecoder

    g = CudaGraphDecoder(lambda *a: a[0], max_bs=20, max_blocks_per_seq=3, device=torch.device(device))
    assert [g.bucket_of(n) for n in (1, 3, 5, 9, 17, 20)] == [1, 4, 8, 16, 20, 20]
    g.graphs = dict.fromkeys(g.sizes)  # as if all were captured
    assert [g.bucket(n) for n in (1, 3, 5, 9, 17, 20)] == [1, 4, 8, 16, 20, 20]
    g.graphs = dict.fromkeys([1, 4, 20])
    assert [g.bucket(n) for n in (1, 2, 3, 5, 9, 17, 20)] == [1, 4, 4, 20, 20, 20, 20]
    assert g.missing() == [2, 8, 16]
    g.graphs = {}
    assert g.can_run(20, 3) and not g.can_run(21, 3) and not g.can_run(4, 4) and not g.can_run(0, 1)
    z = torch.zeros(21, dtype=torch.long)
    with pytest.raises(ValueError, match="does not fit the captured graphs"):
        g.run(z, z, z, torch.zeros(21, 3, dtype=torch.int32), z.int())


def test_graph_decoder_captures_a_subset_largest_first_within_max_bs(monkeypatch):
    """``capture(sizes)`` (a server's start-up set) takes each size's bucket and the largest, largest first, and
    ignores sizes past ``max_bs`` (``STARTUP_SIZES`` under a small ``--max-num-seqs``); ``capture_next`` then adds
    the missing buckets largest first. Captures recorded, not run (no GPU here)."""
    from strataserve.runner.cuda_graph import STARTUP_SIZES, CudaGraphDecoder

    order = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    g = CudaGraphDecoder(lambda *a: a[0], max_bs=20, max_blocks_per_seq=3, device=torch.device("cpu"))
    monkeypatch.setattr(g, "_capture_one", lambda bs: (order.append(bs), g.graphs.__setitem__(bs, None)))
    g.capture(STARTUP_SIZES)
    assert order == [20, 16, 8, 4, 2, 1] and g.missing() == []  # 32-128 > max_bs: covered by the 20 bucket
    g = CudaGraphDecoder(lambda *a: a[0], max_bs=40, max_blocks_per_seq=3, device=torch.device("cpu"))
    monkeypatch.setattr(g, "_capture_one", lambda bs: (order.append(bs), g.graphs.__setitem__(bs, None)))
    order.clear()
    g.capture([3, 9])
    assert order == [40, 16, 4] and g.missing() == [1, 2, 8, 24, 32]
    order.clear()
    while g.capture_next():
        pass
    assert order == [32, 24, 8, 2, 1] and g.missing() == []


def test_one_row_weights_groups_every_matmul_by_shape(device):
    """What the start-up GEMV tuning times: each layer's four matmul weights and the (tied) lm_head, by shape."""
    cfg = _cfg(tie_word_embeddings=True, num_layers=3)
    model = build_random_model(cfg, torch.float32, device, seed=1)
    groups = one_row_weights(model)
    qkv, o = (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), (cfg.hidden_size, cfg.q_size)
    gate_up, down = (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)
    head = (cfg.vocab_size, cfg.hidden_size)
    assert {k: len(v) for k, v in groups.items()} == {qkv: 3, o: 3, gate_up: 3, down: 3, head: 1}
    assert groups[head][0] is model.embed_tokens  # tied: the lm_head is the embedding table
    assert groups[o][1] is model.layers[1].self_attn.o_weight


@pytest.mark.parametrize("qk_norm", [True, False])
def test_canvas_attend_triton_matches_torch(device, qk_norm):
    """OmniVoice's canvas path: TritonOps' one-launch (q/k norm +) rotary and GQA attention over two groups of
    different padded lengths (conditional rows, then shorter unconditional rows) equal TorchOps' separate ops."""
    from strataserve.runner.nar_attention import CanvasAttention, CanvasMeta, CanvasOps

    torch.manual_seed(0)
    att = CanvasAttention(4, 2, 16)
    n, length, t = 2, 12, 8
    rows = n * length + n * t
    qkv = torch.randn(rows, 8 * 16, device=device)
    pos = torch.cat([torch.arange(length).repeat(n), torch.arange(t).repeat(n)]).to(device)
    cos_sin = torch.randn(64, 16, device=device)
    qn, kn = (torch.rand(16, device=device) + 0.5, torch.rand(16, device=device) + 0.5) if qk_norm else (None, None)
    meta = CanvasMeta.from_lengths((torch.tensor([12, 7], device=device), length),
                                   (torch.tensor([8, 0], device=device), t))  # 0: a padding row
    outs = []
    for ops in (CanvasOps(TritonOps(att), att), CanvasOps(TorchOps(att), att)):
        q, k, v = qkv.clone().split([64, 32, 32], dim=1)
        outs.append(ops.attend(0, pos, q, k, v, 16, cos_sin, qn, kn, 1e-6, meta))
    assert outs[0].shape == (rows, 64)
    assert_close(outs[0], outs[1], 1e-5, "canvas attention output")


def test_rope_runs_inside_decode_attention_only_for_fixed_split_pdl_launches(monkeypatch):
    """Run 18: the rotary + KV store inside decode attention pays at batch 1 (fixed splits, PDL), not at batch 64
    (adaptive splits, where the separate kernel is faster: run 21), and never with a quantised cache or without PDL.
    ``STRATA_DECODE_ROPE_MAX_ROWS`` lets larger PDL steps take it (the benchmarks' switch)."""
    cuda = torch.device("cuda")
    att = TritonAttention(32, 8, 128, num_sms=132, split_target=6)
    assert not att.rope_in_kernel(1, torch.device("cpu"))  # no PDL off a GPU
    monkeypatch.setattr(envs, "STRATA_PDL", True)
    monkeypatch.setattr(_common, "_hopper_or_newer", lambda index: True)  # as on an H200
    assert att.rope_in_kernel(1, cuda)
    assert not att.rope_in_kernel(2, cuda)  # fixed splits and PDL too, but only batch 1 was measured to pay
    assert not att.rope_in_kernel(17, cuda) and not att.rope_in_kernel(64, cuda)  # adaptive splits
    assert not TritonAttention(160, 160, 128, num_sms=132, split_target=6).rope_in_kernel(1, cuda)  # adaptive
    monkeypatch.setattr(envs, "STRATA_DECODE_ROPE_MAX_ROWS", 64)
    assert att.rope_in_kernel(64, cuda) and att.rope_in_kernel(17, cuda)
    assert not att.rope_in_kernel(65, cuda)  # past PDL's 64 rows too
    monkeypatch.setattr(envs, "STRATA_DECODE_ROPE_MAX_ROWS", 1)
    monkeypatch.setattr(envs, "STRATA_PDL", False)
    assert not att.rope_in_kernel(1, cuda)
    monkeypatch.setattr(envs, "STRATA_PDL", True)
    att.bind_kv_cache([], torch.ones(1, 2, 8))
    assert not att.rope_in_kernel(1, cuda)


def test_decode_attention_launch_config_follows_the_split_regime(monkeypatch, device):
    """Run 21: decode attention's tile configuration follows the launch regime of ``decode_launch`` and the
    kernel's split-all rule (fewer than 2 programs per SM), and the runner launches with it."""
    cfg = triton_ops_module.DECODE_CONFIGS
    sms = 132
    assert triton_ops_module.decode_config(16, 8, sms) == cfg["small"]  # 128 programs: fixed splits
    assert triton_ops_module.decode_config(17, 8, sms) == cfg["split_all"]  # adaptive, every row may split
    assert triton_ops_module.decode_config(32, 8, sms) == cfg["split_all"]
    assert triton_ops_module.decode_config(33, 8, sms) == cfg["adaptive"]  # 264 programs: 2 per SM, not "few"
    assert triton_ops_module.decode_config(66, 8, sms) == cfg["adaptive"]  # 528 = 4 per SM, still adaptive
    assert decode_launch(66, 8, sms, 16, 6)[1] and not decode_launch(67, 8, sms, 16, 6)[1]
    assert triton_ops_module.decode_config(67, 8, sms) == cfg["large"]
    assert cfg["split_all"] != cfg["adaptive"]  # the two measured apart (else this test checks nothing)
    monkeypatch.setattr(envs, "STRATA_DECODE_ATTN_CONFIGS", False)
    assert {triton_ops_module.decode_config(r, 8, sms) for r in (1, 32, 64, 256)} == {(64, 4, 2)}
    monkeypatch.setattr(envs, "STRATA_DECODE_ATTN_CONFIGS", True)

    seen = []
    real = triton_ops_module.paged_decode_attention

    def spy(*args, **kw):
        seen.append((kw["block_n"], kw["num_warps"], kw["num_stages"]))
        return real(*args, **kw)
    monkeypatch.setattr(triton_ops_module, "paged_decode_attention", spy)
    monkeypatch.setattr(triton_ops_module, "DECODE_CONFIGS", {**cfg, "small": (16, 2, 1)})
    att = TritonAttention(4, 2, 16, num_sms=132, split_target=6)
    kv = allocate_kv_cache(1, 8, 4, 2, 16, torch.float32, torch.device(device))
    att.bind_kv_cache(kv)
    q, k, v = (torch.randn(3, n * 16, device=device) for n in (4, 2, 2))
    lens = torch.tensor([5, 9, 2], dtype=torch.int32, device=device)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 0, 0]], dtype=torch.int32, device=device)
    pos = (lens - 1).long()
    slots = tables.gather(1, (pos // 4).view(-1, 1).long()).view(-1).long() * 4 + pos % 4
    att.forward(0, q, k, v, decode_metadata(slots, tables, lens, 4))
    assert seen == [(16, 2, 1)]
