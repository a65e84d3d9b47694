"""fp8 / int8 KV cache on the GPU: decode throughput at long context (KV reads dominate) and accuracy on the
trained demo model.

    python benchmarks/kv_quant_bench.py [--only decode,accuracy] [--batch 32] [--ctx 8192] [--rounds 3]
    STRATA_BENCH_DEVICE=cpu python benchmarks/kv_quant_bench.py --only accuracy --prompts 8 --new-tokens 128 \
        --chunk 16 --perturb-dtype bfloat16        # the CPU figures (float32 model)

decode: Llama-3.1-8B shape, random weights, hybrid mode (Triton kernels in CUDA graphs), ``batch`` sequences whose
``ctx``-token contexts are already cached (random KV), 64 greedy steps; auto (bf16) vs fp8 vs int8 caches held side
by side, one graph set each, timed in alternating order per round. Floor = bytes a step must read (weights except
the embedding + the KV cache) / 4.27 TB/s (run 6's copy bandwidth).
accuracy: the demo model in bf16, 64 prompts x 512 greedy tokens with a bf16 cache (the reference), then per
quantised cache (a) free-running greedy agreement with the reference and (b) teacher-forced agreement: the
reference sequences fed as prompts, the greedy (top-1) token compared at every position (prompt logprobs).
One JSON line per figure to stdout and $OUT/h200.jsonl.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
OUT = Path(os.environ.get("OUT", "."))
BW = 4.27e12
BASE = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "run": 11}
DEV = os.environ.get("STRATA_BENCH_DEVICE", "cuda")
KV = {"auto": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def emit(bench: str, **fields) -> None:
    row = {"bench": bench, **fields, **BASE}
    with (OUT / "h200.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


@torch.inference_mode()
def bench_decode(batch: int, ctx: int, rounds: int, steps: int = 64) -> None:
    from gpu_model_bench import llama31_8b, make_ops

    from strataserve.kernels.kv_quant import quantize_ref
    from strataserve.models.loader import build_random_model
    from strataserve.runner.attention import allocate_kv_cache
    from strataserve.runner.cuda_graph import CudaGraphDecoder, decode_metadata

    cfg, dev, bs = llama31_8b(), torch.device("cuda"), 16
    model = build_random_model(cfg, torch.bfloat16, dev, ops=make_ops("hybrid", cfg), seed=0,
                               max_positions=ctx + steps + 64)
    att = model.ops.attention
    bps = -(-(ctx + steps) // bs)
    nblocks = batch * bps + 1
    tables = torch.randperm(nblocks - 1, device=dev)[: batch * bps].view(batch, bps).to(torch.int32)
    setups = {}
    for name, dt in KV.items():
        caches = allocate_kv_cache(cfg.num_layers, nblocks, bs, cfg.num_kv_heads, cfg.head_dim, dt, dev)
        scales = None
        if name != "auto":
            scales = torch.full((cfg.num_layers, 2, cfg.num_kv_heads), 4.0 / 448, device=dev)
        for layer, (kc, vc) in enumerate(caches):
            for c, which in ((kc, 0), (vc, 1)):
                x = torch.randn(c.shape, device=dev)
                c.copy_(x if scales is None else quantize_ref(x, scales[layer, which], dt))
        att.bind_kv_cache(caches, scales)

        def step(ids, pos, slots, tabs, lens):
            return model.compute_logits(model(ids, pos, decode_metadata(slots, tabs, lens, bs, torch_views=False)))

        graphs = CudaGraphDecoder(step, batch, bps, dev, pad_slot=-1)
        graphs.capture()
        setups[name] = (caches, scales, graphs)
    weights = sum(p.numel() for n, p in model.named_parameters() if n != "embed_tokens") * 2

    def run(name: str) -> float:
        graphs = setups[name][2]
        ids = torch.randint(0, cfg.vocab_size, (batch,), device=dev)
        plan = []
        for i in range(steps):
            pos = torch.full((batch,), ctx + i, dtype=torch.long, device=dev)
            blk = tables[:, (ctx + i) // bs].long()
            plan.append((pos, blk * bs + (ctx + i) % bs, (pos + 1).to(torch.int32)))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for pos, slots, lens in plan:
            ids = graphs.run(ids, pos, slots, tables, lens).argmax(-1)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for name in KV:
        run(name)  # warm-up
    order = list(KV)
    for r in range(1, rounds + 1):
        for name in (order if r % 2 else order[::-1]):
            t = run(name)
            kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * KV[name].itemsize * batch * (
                ctx + steps / 2)
            floor_ms = (weights + kv_bytes) / BW * 1e3
            ms = t / steps * 1e3
            emit("kv_decode_long_ctx", model="llama-3.1-8b-shape", mode="hybrid", kv_cache_dtype=name, batch=batch,
                 ctx=ctx, round=r, ms_per_step=round(ms, 3), tok_per_s=round(batch * steps / t, 1),
                 floor_ms=round(floor_ms, 3), roofline_fraction=round(floor_ms / ms, 3),
                 kv_gb_per_step=round(kv_bytes / 1e9, 2))
    att.bind_kv_cache([], None)
    setups.clear()
    del model
    torch.cuda.empty_cache()


PROMPT_STARTS = ["The weather today is", "Once upon a time, there was a", "My favourite food is",
                 "The best way to learn is", "In the morning I like to", "A good friend is someone who",
                 "The old house at the end of the street", "She opened the door and saw"]
PROMPT_ENDS = ["", " very", " a little", " the", " my", " our", " not", " always"]


def bench_accuracy(n_new: int = 512, n_prompts: int = 64, chunk: int = 4096, perturb: str | None = None) -> None:
    """``chunk``: prefill chunk size of the teacher-forced pass (on the CPU's torch path a first chunk attends over
    its own unquantised K/V, so small chunks are needed there to read the cache); ``perturb``: also compare a
    float-cache engine whose whole model runs in this dtype (how much any perturbation moves the greedy text)."""
    from strataserve import LLM, SamplingParams
    from strataserve.assets import DEMO_MODEL_DIR

    prompts = [a + b for a in PROMPT_STARTS for b in PROMPT_ENDS][:n_prompts]

    model_dtype = "bfloat16" if DEV == "cuda" else "float32"

    def llm(kv: str, dtype: str = model_dtype) -> LLM:  # the pool sized from one memory budget: capacity per dtype
        return LLM(str(DEMO_MODEL_DIR), device=DEV, dtype=dtype, kv_cache_dtype=kv, gpu_memory_utilization=0.15,
                   kv_cache_memory_gib=0.05, enable_prefix_caching=False, max_num_batched_tokens=chunk)

    def free(engine: LLM) -> list[list[int]]:
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True),
                               use_tqdm=False)
        return [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]

    def forced(engine: LLM, seqs: list[list[int]]) -> list[list[int]]:
        outs = engine.generate([{"prompt_token_ids": s} for s in seqs],
                               SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        return [[next(t for t, lp in d.items() if lp.rank == 1) for d in o.prompt_logprobs[1:]] for o in outs]

    ref_engine = llm("auto")
    ref_blocks = ref_engine.llm_engine.core.num_blocks
    ref = free(ref_engine)
    ref_forced = forced(ref_engine, ref)
    ref_engine.llm_engine.shutdown()
    for kv, dtype in [("fp8", model_dtype), ("int8", model_dtype)] + ([("auto", perturb)] if perturb else []):
        engine = llm(kv, dtype)
        blocks = engine.llm_engine.core.num_blocks
        got = free(engine)
        got_forced = forced(engine, ref)
        engine.llm_engine.shutdown()
        n_prompt = [len(s) - n_new for s in ref]
        free_pos = sum(a == b for r, g, p in zip(ref, got, n_prompt) for a, b in zip(r[p:], g[p:])) / (
            len(ref) * n_new)
        prefix = [next((i for i, (a, b) in enumerate(zip(r[p:], g[p:])) if a != b), n_new)
                  for r, g, p in zip(ref, got, n_prompt)]
        total = sum(len(r) for r in ref_forced)
        tf = sum(a == b for r, g in zip(ref_forced, got_forced) for a, b in zip(r, g)) / total
        emit("kv_accuracy", model="demo_llama", dtype=dtype, reference_dtype=model_dtype, kv_cache_dtype=kv,
             sequences=len(prompts), new_tokens=n_new, chunk=chunk, teacher_forced_agreement=round(tf, 4),
             positions=total,
             free_running_agreement=round(free_pos, 4), identical_sequences=sum(p == n_new for p in prefix),
             mean_first_divergence=round(sum(prefix) / len(prefix), 1), kv_blocks=blocks,
             kv_blocks_reference=ref_blocks, capacity_ratio=round((blocks + 1) / (ref_blocks + 1), 3))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="decode,accuracy")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk of the teacher-forced pass")
    ap.add_argument("--perturb-dtype", default=None, help="also compare a whole model in this dtype")
    args = ap.parse_args()
    only = args.only.split(",")
    if "accuracy" in only:
        bench_accuracy(args.new_tokens, args.prompts, args.chunk, args.perturb_dtype)
    if "decode" in only:
        bench_decode(args.batch, args.ctx, args.rounds)


if __name__ == "__main__":
    main()
