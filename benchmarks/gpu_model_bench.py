"""Model-level GPU benchmarks with random weights in real shapes (no checkpoint): decode steps and start-up.

``decode_bench``: B sequences whose 512-token prompts are already in the KV cache (random KV: decode time does not
depend on its values), then 128 greedy decode steps, each token fed back; tokens/s and the fraction of the HBM
roofline, where a step must read every weight except the input embedding table plus the KV cache so far.
``startup_bench``: model build + KV allocation + CUDA-graph capture for every bucket, to ready.

The runner-mode wiring (which OpSet, graphs or not) is the one ``runner/model_runner.py`` uses; these functions
drive ``DecoderModel`` directly so the figure is the model step without scheduler or sampler overhead.
"""
from __future__ import annotations

import gc
import os
import time

import torch

from strataserve import envs
from strataserve.kernels.argmax import greedy_tokens
from strataserve.models.hf_config import DecoderConfig, RopeScaling
from strataserve.models.loader import build_random_model
from strataserve.runner.attention import TorchAttention, allocate_kv_cache
from strataserve.runner.cuda_graph import CudaGraphDecoder, decode_metadata
from strataserve.runner.gemm_tuning import apply_gemm_tuning, plan_rows
from strataserve.runner.gemv_tuning import apply_tuning
from strataserve.runner.ops import TorchOps
from strataserve.runner.triton_ops import TritonAttention, TritonOps

MODES = ("eager", "triton", "graph", "hybrid")
# cpu (with TRITON_INTERPRET=1 and a tiny config) only to smoke-test this script's logic before a GPU run
DEV = os.environ.get("STRATA_BENCH_DEVICE", "cuda")
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32


def llama31_8b() -> DecoderConfig:
    return DecoderConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
        tie_word_embeddings=False, qkv_bias=False, qk_norm=False, bos_token_id=128000, eos_token_ids=(128001,),
        torch_dtype="bfloat16")


def qwen3_06b() -> DecoderConfig:
    return DecoderConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=RopeScaling(), max_position_embeddings=40960, tie_word_embeddings=True, qkv_bias=False,
        qk_norm=True, bos_token_id=None, eos_token_ids=(151645,), torch_dtype="bfloat16")


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _empty_cache() -> None:
    gc.collect()  # a captured graph's runner refers back to its setup (a cycle): free the 16 GB model now
    if DEV == "cuda":
        torch.cuda.empty_cache()


def make_ops(mode: str, cfg: DecoderConfig):
    """Like runner/model_runner.select_ops, plus "hybrid-gemv": hybrid with the default GEMV kernel on every
    batch-1 matmul (run 2 of docs/gpu_notes.md), and "hybrid-r5": hybrid as of run 5 (rotary, q/k norm and KV
    store as separate kernels, run 5's decode-attention launch, cuBLAS for every matmul: the "before" of run 6). "hybrid" itself tunes the GEMV
    choice per shape in ``_Setup``, as the runner does at start-up."""
    if mode in ("triton", "hybrid-gemv") or is_hybrid(mode):
        r5 = mode == "hybrid-r5"
        return TritonOps(TritonAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, long_first=not r5,
                                         split_target=split_target(mode)),
                         use_gemv=mode == "hybrid-gemv", fused_rope_kv=not r5)
    return TorchOps(TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))


def is_hybrid(mode: str) -> bool:
    """"hybrid" and its variants that tune the GEMV: "-r5"/"-r6" (run 5's / run 6's path), "-tN" (adaptive decode
    splits aiming at N programs per SM)."""
    return mode in ("hybrid", "hybrid-r5", "hybrid-r6") or mode.startswith("hybrid-t")


def split_target(mode: str) -> int:
    """The decode-attention ``split_target`` of a mode (run 8): 0 for run 5's and run 6's paths, N for "-tN"."""
    if mode in ("hybrid-r5", "hybrid-r6"):
        return 0
    if mode.startswith("hybrid-t"):
        return int(mode.removeprefix("hybrid-t"))
    return envs.STRATA_DECODE_SPLIT_TARGET


def step_bytes(cfg: DecoderConfig, model: torch.nn.Module, batch: int, mean_ctx: float) -> float:
    """Bytes one decode step must read: weights except the input embedding table, plus the KV cache."""
    elem = model.dtype.itemsize
    weights = sum(p.numel() for n, p in model.named_parameters() if n != "embed_tokens") * elem
    if cfg.tie_word_embeddings:  # lm_head is the embedding table: read once, as lm_head
        weights += model.embed_tokens.numel() * elem
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem * batch * mean_ctx
    return weights + kv


class _Setup:
    """A random model + KV cache holding ``batch`` sequences of ``prompt`` tokens (random KV)."""

    def __init__(self, cfg: DecoderConfig, mode: str, batch: int, prompt: int, new: int, block_size: int = 16,
                 max_bs_graph: int | None = None, argmax: str = "graph") -> None:
        """``argmax``: "graph", the greedy token inside the step (the runner's ``greedy_tokens``, from run 17);
        "graph-torch", the same with ``torch.argmax`` (the runner before run 17); "eager", float32 logits out of
        the step and ``torch.argmax`` after it (this benchmark before run 17)."""
        dev = torch.device(DEV)
        self.cfg, self.mode, self.batch, self.prompt, self.new = cfg, mode, batch, prompt, new
        self.argmax = argmax
        self.model = build_random_model(cfg, DTYPE, dev, ops=make_ops(mode, cfg), seed=0,
                                        max_positions=prompt + new + 64)
        self.bps = (prompt + new + block_size - 1) // block_size
        num_blocks = batch * self.bps + 1  # the last block is the padding rows' scratch (torch backend)
        self.kv = allocate_kv_cache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    DTYPE, dev)
        for kc, vc in self.kv:
            kc.normal_()
            vc.normal_()
        self.model.ops.attention.bind_kv_cache(self.kv)
        perm = torch.randperm(num_blocks - 1, device=dev)[: batch * self.bps]
        self.tables = perm.view(batch, self.bps).to(torch.int32)
        self.block_size = block_size
        self.graphs = None
        self.gemv_choices = []
        self.gemm_choices = []
        if is_hybrid(mode) and mode != "hybrid-r5" and DEV == "cuda":
            self.gemv_choices = apply_tuning(self.model, self.model.ops)  # the runner's: matmuls, then prologues
            if envs.STRATA_GEMM_TUNE:  # then the 2-64-row matmuls (run 19)
                self.gemm_choices = apply_gemm_tuning(self.model, self.model.ops)
        if mode in ("graph", "hybrid-gemv") or is_hybrid(mode):
            pad = -1 if mode.startswith("hybrid") else (num_blocks - 1) * block_size
            self.graphs = CudaGraphDecoder(self._step, max_bs_graph or batch, self.bps, dev, pad_slot=pad)

    def _step(self, ids, pos, slots, tables, lens):
        meta = decode_metadata(slots, tables, lens, self.block_size)
        hidden = self.model(ids, pos, meta)
        if self.argmax == "eager":
            return self.model.compute_logits(hidden)
        logits = self.model.logits(hidden)
        return greedy_tokens(logits) if self.argmax == "graph" else logits.argmax(-1)

    def inputs(self, i: int):
        """Step i's positions, slots, context lengths (all sequences at the same length)."""
        pos = torch.full((self.batch,), self.prompt + i, dtype=torch.long, device=DEV)
        blk = self.tables[:, (self.prompt + i) // self.block_size].long()
        slots = blk * self.block_size + (self.prompt + i) % self.block_size
        return pos, slots, (pos + 1).to(torch.int32)

    @torch.inference_mode()
    def run(self, steps: int) -> float:
        """Seconds for ``steps`` greedy decode steps."""
        plan = [self.inputs(i) for i in range(steps)]
        ids = torch.randint(0, self.cfg.vocab_size, (self.batch,), device=DEV)
        _sync()
        t0 = time.perf_counter()
        for pos, slots, lens in plan:
            if self.graphs is not None:
                logits = self.graphs.run(ids, pos, slots, self.tables, lens)
            else:
                logits = self._step(ids, pos, slots, self.tables, lens)
            ids = logits.argmax(-1) if self.argmax == "eager" else logits
        _sync()
        return time.perf_counter() - t0


def decode_bench(cfg: DecoderConfig, mode: str, batch: int, bw: float, prompt: int = 512, new: int = 128,
                 argmax: str = "graph") -> dict:
    s = _Setup(cfg, mode, batch, prompt, new, argmax=argmax)
    t_cap = s.graphs.capture() if s.graphs is not None else 0.0
    s.run(8)  # warm-up: compiles, cuBLAS heuristics, allocator
    t = s.run(new)
    ms = t / new * 1e3
    floor_ms = step_bytes(cfg, s.model, batch, prompt + new / 2) / bw * 1e3
    out = {"batch": batch, "mode": mode, "argmax": argmax, "tok_per_s": round(batch * new / t, 1), "ms_per_step": round(ms, 3),
           "floor_ms": round(floor_ms, 3), "roofline_fraction": round(floor_ms / ms, 3),
           "graph_capture_s": round(t_cap, 2),
           "gemv": {f"{c.prologue}{c.shape[0]}x{c.shape[1]}": [round(c.baseline_us, 1), round(c.best_us, 1),
                                                               str(c.config) if c.config else "baseline"]
                    for c in s.gemv_choices},
           "gemm": {f"{c.rows}:{'silu' if c.kind == 'silu' else ''}{c.shape[0]}x{c.shape[1]}":
                    [round(c.cublas_us, 1), round(c.best_us, 1), str(c.config) if c.config else "cuBLAS"]
                    for c in s.gemm_choices if c.rows == plan_rows(batch)}}
    del s
    _empty_cache()
    return out


def startup_bench(cfg: DecoderConfig, mode: str, max_bs: int = 256, max_model_len: int = 4096) -> dict:
    """Model build with random weights + KV for max_bs sequences of 1k tokens + graph capture, to ready."""
    _sync()
    t0 = time.perf_counter()
    s = _Setup(cfg, mode, batch=max_bs, prompt=1024 - 128, new=128, max_bs_graph=max_bs)
    _sync()
    t_build = time.perf_counter() - t0
    t_cap = s.graphs.capture() if s.graphs is not None else 0.0
    total = time.perf_counter() - t0
    n_graphs = len(s.graphs.sizes) if s.graphs is not None else 0
    del s
    _empty_cache()
    return {"mode": mode, "startup_s": round(total, 2), "build_s": round(t_build, 2),
            "graph_capture_s": round(t_cap, 2), "graphs": n_graphs, "max_bs": max_bs}


@torch.inference_mode()
def matmul_only_bench(cfg: DecoderConfig, batch: int, bw: float) -> dict:
    """Only the step's weight matmuls (cuBLAS, same weights) replayed in one CUDA graph: the GEMV ceiling that
    the full step is compared against (where the time goes)."""
    model = build_random_model(cfg, DTYPE, torch.device(DEV), ops=make_ops("eager", cfg), seed=0, max_positions=64)
    x = torch.randn(batch, cfg.hidden_size, dtype=DTYPE, device=DEV)
    xo = torch.randn(batch, cfg.q_size, dtype=DTYPE, device=DEV)
    xi = torch.randn(batch, cfg.intermediate_size, dtype=DTYPE, device=DEV)
    F = torch.nn.functional

    def step():
        for layer in model.layers:
            F.linear(x, layer.self_attn.qkv_weight)
            F.linear(xo, layer.self_attn.o_weight)
            F.linear(x, layer.mlp.gate_up_weight)
            F.linear(xi, layer.mlp.down_weight)
        F.linear(x, model.lm_head)
    for _ in range(3):
        step()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        g.replay()
    _sync()
    t0 = time.perf_counter()
    for _ in range(30):
        g.replay()
    _sync()
    ms = (time.perf_counter() - t0) / 30 * 1e3
    floor_ms = step_bytes(cfg, model, 0, 0) / bw * 1e3
    del model, g
    _empty_cache()
    return {"batch": batch, "mode": "cublas-graph", "ms_per_step": round(ms, 3), "floor_ms": round(floor_ms, 3),
            "roofline_fraction": round(floor_ms / ms, 3), "tok_per_s": round(batch / ms * 1e3, 1)}
