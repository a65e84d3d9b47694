"""Tensor parallelism on one host's GPUs (issue 15): agreement and speed of TP=2 vs TP=1 through the real engine.

    python benchmarks/tp_bench.py agree-tiny      # fp32 tiny Llama-3.1 checkpoint: TP=2 vs TP=1 vs HF tokens
    python benchmarks/tp_bench.py 8b [--rounds 3] # 8B shape bf16 dummy: greedy agreement, batch-1 step time
    python benchmarks/tp_bench.py 70b             # 70B shape TP=2 bf16 dummy: start-up, batch 1 and batch 64

Everything runs through ``LLM(..., load_format="dummy", skip_tokenizer_init=True)`` (random weights in the real
shapes; the same numbers at TP=1 and TP=2, see ``models/loader.py``), default runner mode (hybrid: Triton kernels
in CUDA graphs, the all-reduces inside them). Decode time per step is measured by difference: one greedy request of
``new_long`` tokens minus one of ``new_short`` (same prompt, prefix cache off), divided by the extra tokens; so
prefill, start-up and the first step drop out. Fixed seed, a warm-up generate first. One JSON line per figure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from strataserve import LLM, SamplingParams  # noqa: E402

HBM_BYTES_PER_S = 4.28e12  # H200 sustained copy bandwidth used for every roofline in docs/performance.md
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}


def emit(**fields) -> None:
    from strataserve import envs

    fields.update(allreduce=envs.STRATA_TP_ALLREDUCE, date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                  gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    line = json.dumps(fields)
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "tp_bench.jsonl"), "a") as f:
            f.write(line + "\n")


def shape_dir(name: str) -> str:
    """A folder with only the config.json of a Llama-3.1 shape (bf16, 128k vocab, llama3 rope scaling)."""
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, rms_norm_eps=1e-5,
               max_position_embeddings=131072, rope_theta=500000.0, torch_dtype="bfloat16", bos_token_id=128000,
               eos_token_id=128001, tie_word_embeddings=False,
               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192), **SHAPES[name])
    d = Path(tempfile.mkdtemp(prefix=f"tp_{name}_"))
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def weight_bytes(llm: LLM) -> int:
    """Bytes of weights one decode step reads on rank 0 (the embedding is a gather, not a read)."""
    model = llm.engine.core.runner.model
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed_tokens") + \
        (model.lm_head.numel() * model.lm_head.element_size() if model.lm_head is model.embed_tokens else 0)


def make(path: str, tp: int, max_bs: int, util: float, **kw) -> tuple[LLM, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm = LLM(path, dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=tp,
              max_model_len=4096, max_num_seqs=max_bs, cuda_graph_max_bs=max_bs, gpu_memory_utilization=util,
              enable_prefix_caching=False, **kw)
    torch.cuda.synchronize()
    return llm, time.perf_counter() - t0


def prompts(n: int, length: int, seed: int, vocab: int = 128256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def greedy(llm: LLM, ps: list[list[int]], new: int) -> tuple[list[list[int]], float]:
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - t0


def step_ms(llm: LLM, batch: int, prompt_len: int = 512, new_short: int = 16, new_long: int = 144) -> float:
    """Decode milliseconds per step at ``batch`` sequences (difference of two generates, see the docstring)."""
    ps = prompts(batch, prompt_len, seed=1)
    _, short = greedy(llm, ps, new_short)
    _, long = greedy(llm, ps, new_long)
    return (long - short) / (new_long - new_short) * 1e3


def agree_tiny() -> None:
    from _tiny_models import hf_greedy, make_tiny_checkpoint

    path = make_tiny_checkpoint("llama3", tempfile.mkdtemp(prefix="tp_tiny_"), tokenizer=False, vocab_size=509,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=16, hidden_size=128)
    ps = prompts(4, 40, seed=2, vocab=509)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for tp in (2, 1):
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=tp, max_model_len=512,
                  gpu_memory_utilization=0.3, max_num_seqs=8, cuda_graph_max_bs=8)
        graphs = llm.engine.core.runner.graphs
        outs[tp] = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        emit(bench="tp_graphs_tiny", tp=tp, mode=llm.engine.core.runner.plan.mode,
             graphs=0 if graphs is None else len(graphs.sizes))
        llm.shutdown()
    ref = hf_greedy(path, ps, 32)
    emit(bench="tp_agree_tiny_fp32", tp2_equals_tp1=outs[2] == outs[1], tp2_equals_hf=outs[2] == ref,
         tp1_equals_hf=outs[1] == ref, tokens=sum(map(len, ref)))


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    return dict(identical=a == b, first_divergence=first, token_match=round(same / sum(map(len, a)), 4))


def bench_8b(rounds: int) -> None:
    path = shape_dir("8b")
    tp1, s1 = make(path, 1, 8, 0.30)
    tp2, s2 = make(path, 2, 8, 0.70)  # rank 0 shares GPU 0 with the TP=1 engine (idle while the other runs)
    emit(bench="tp_startup_8b", tp1_s=round(s1, 2), tp2_s=round(s2, 2),
         tp2_graphs=len(tp2.engine.core.runner.graphs.sizes) if tp2.engine.core.runner.graphs else 0)
    ps = prompts(4, 64, seed=3)
    a, _ = greedy(tp1, ps, 48)
    b, _ = greedy(tp2, ps, 48)
    agree = agreement(a, b)
    # how close the top two candidates were at TP=1 (random weights give flat logits: bf16 rounding decides ties)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    lps = [o.outputs[0].logprobs for o in tp1.generate(ps, sp, use_tqdm=False)]
    gaps = [[sorted((v.logprob for v in step.values()), reverse=True)[:2] for step in seq] for seq in lps]
    gaps = [[g[0] - g[1] for g in seq] for seq in gaps]
    at_split = [round(seq[i], 4) for seq, i in zip(gaps, agree["first_divergence"]) if i < len(seq)]
    emit(bench="tp_agree_8b_bf16", **agree, top2_gap_median=round(sorted(sum(gaps, []))[len(sum(gaps, [])) // 2], 4),
         top2_gap_at_first_divergence=at_split)
    for llm in (tp1, tp2):
        step_ms(llm, 1, new_long=48)  # warm-up
    wb1, wb2 = weight_bytes(tp1), weight_bytes(tp2)
    for r in range(rounds):
        order = ((1, tp1), (2, tp2)) if r % 2 == 0 else ((2, tp2), (1, tp1))
        ms = {}
        for tp, llm in order:
            ms[tp] = step_ms(llm, 1)
        emit(bench="tp_decode_8b_b1", round=r + 1, order=[t for t, _ in order], tp1_ms=round(ms[1], 3),
             tp2_ms=round(ms[2], 3), ratio=round(ms[2] / ms[1], 3),
             tp1_roofline=round(wb1 / HBM_BYTES_PER_S * 1e3 / ms[1], 3),
             tp2_roofline=round(wb2 / HBM_BYTES_PER_S * 1e3 / ms[2], 3))
    tp2.shutdown()
    tp1.shutdown()


def bench_70b(rounds: int, batch64: bool = True) -> None:
    path = shape_dir("70b")
    llm, startup = make(path, 2, 64, 0.92)
    runner = llm.engine.core.runner
    emit(bench="tp_startup_70b", tp=2, startup_s=round(startup, 2), num_blocks=runner.num_blocks,
         graphs=len(runner.graphs.sizes) if runner.graphs else 0, mode=runner.plan.mode)
    step_ms(llm, 1, new_long=32)  # warm-up
    roof_ms = 141e9 / (2 * HBM_BYTES_PER_S) * 1e3
    for r in range(rounds):
        ms = step_ms(llm, 1)
        emit(bench="tp_decode_70b_b1", round=r + 1, ms_per_step=round(ms, 3), tok_per_s=round(1e3 / ms, 2),
             roofline_fraction=round(roof_ms / ms, 3), roofline_ms=round(roof_ms, 3),
             rank0_weight_gb=round(weight_bytes(llm) / 1e9, 2))
    if batch64:
        step_ms(llm, 64, prompt_len=256, new_short=8, new_long=16)  # warm-up: batch-64 prefill and steps
    for r in range(rounds if batch64 else 0):
        ms = step_ms(llm, 64, prompt_len=256, new_short=8, new_long=72)
        emit(bench="tp_decode_70b_b64", round=r + 1, ms_per_step=round(ms, 3), tok_per_s=round(64e3 / ms, 1))
    llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["agree-tiny", "8b", "70b"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-batch64", action="store_true", help="70b: batch 1 only")
    args = p.parse_args()
    torch.manual_seed(0)
    {"agree-tiny": lambda: agree_tiny(), "8b": lambda: bench_8b(args.rounds),
     "70b": lambda: bench_70b(args.rounds, not args.no_batch64)}[args.what]()


if __name__ == "__main__":
    main()
