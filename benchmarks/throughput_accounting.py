"""Where the whole nano-vllm throughput run spends its time (Qwen3-0.6B shape, H200), per KV cache dtype.

Two passes per dtype after a warm-up (same engine):
1. timed, unprofiled: wall seconds per engine step with the step's scheduled tokens and running requests, summed
   into buckets (steps with prompt tokens; decode-only steps by batch size);
2. the same workload under ``torch.profiler`` (CUDA activity only): device time per kernel category over the whole
   run, and the GPU's busy time (union of kernel intervals) against the pass's wall time, so that the time the GPU
   waits on the host shows as ``idle_s``.

    PYTHONPATH=.:benchmarks python benchmarks/throughput_accounting.py [--kv auto,fp8,int8] [--no-profile]
One JSON line per dtype and pass (``{"bench": "tput_steps" | "tput_kernels", ...}``), tables on stderr.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

# first matching pattern names the category (lower-cased kernel names)
CATEGORIES = (("decode_attn", r"paged_decode|decode_att"),
              ("prefill_attn", r"prefill"),
              ("gemm_cublas", r"nvjet|gemm|cutlass|xmma|gemv2|splitk"),
              ("gemv_triton", r"gemv"),
              ("norm", r"rms|norm"),
              ("rotary_kv", r"rotary|rope|kv_store|store_kv|reshape_and_cache"),
              ("activation", r"silu|act_mul|gelu"),
              ("argmax_sample", r"argmax|argmin|sample|topk|softmax|max_"),
              ("copy_index", r"memcpy|memset|copy|index|gather|scatter|fill|cat"),
              ("elementwise", r"elementwise|vectorized|unrolled|reduce_kernel"))


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, pat in CATEGORIES if re.search(pat, low)), "other")


def run_steps(eng, prompts, outs, record: list | None) -> float:
    """Submit all, step to the end; ``record`` gets (seconds, scheduled tokens, running) per step."""
    from strataserve.types.sampling import SamplingParams

    sched = eng.core.scheduler
    orig = sched.schedule
    last = {}

    def spy(*a, **kw):
        out = orig(*a, **kw)
        last["tokens"], last["chunks"] = out.total_num_scheduled_tokens, len(out.chunks)
        return out
    sched.schedule = spy
    try:
        for i, (p, n) in enumerate(zip(prompts, outs)):
            eng.add_request(f"r{i}", list(p), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        torch.cuda.synchronize()
        t0 = prev = time.perf_counter()
        while eng.has_unfinished_requests():
            last.clear()
            eng.step()
            now = time.perf_counter()
            if record is not None:
                record.append((now - prev, last.get("tokens", 0), last.get("chunks", 0)))
            prev = now
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    finally:
        sched.schedule = orig


def step_buckets(record) -> dict:
    """Seconds by step kind: steps with prompt tokens (tokens > chunks) and decode-only steps by batch size."""
    b: dict[str, list[float]] = {}
    for dt, tokens, chunks in record:
        if tokens > chunks:
            key = "prompt"
        elif chunks == 0:
            key = "empty"
        else:
            key = "decode_" + next(f"le{x}" for x in (16, 32, 64, 128, 192, 256, 10**9) if chunks <= x)
        b.setdefault(key, []).append(dt)
    return {k: {"steps": len(v), "s": round(sum(v), 3), "ms_per_step": round(1e3 * sum(v) / len(v), 3)}
            for k, v in sorted(b.items())}


def kernel_accounting(prof, wall: float) -> dict:
    cats: dict[str, float] = {}
    names: dict[str, list] = {}
    spans = []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = evt.device_time  # us
        cats[category(evt.name)] = cats.get(category(evt.name), 0.0) + t
        rec = names.setdefault(evt.name[:80], [0, 0.0])
        rec[0] += 1
        rec[1] += t
        spans.append((evt.time_range.start, evt.time_range.end))
    spans.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:30]
    return {"wall_s": round(wall, 3), "busy_s": round(busy / 1e6, 3), "idle_s": round(wall - busy / 1e6, 3),
            "kernel_s": round(sum(cats.values()) / 1e6, 3),
            "by_category_s": {k: round(v / 1e6, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top_kernels": [[n, c, round(t / 1e6, 4)] for n, (c, t) in top]}


def main() -> None:
    from gpu_bench import nano_warmup, nano_workload, write_random_qwen3
    from gpu_engine import generate, make_engine
    from torch.profiler import ProfilerActivity, profile

    p = argparse.ArgumentParser()
    p.add_argument("--kv", default="auto,fp8,int8")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--mode", default="hybrid")
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory()
    path = write_random_qwen3(Path(tmp.name) / "qwen3-0.6b")
    prompts, outs = nano_workload()
    for kv in args.kv.split(","):
        eng, t_ready = make_engine(str(path), args.mode, "bfloat16", max_num_seqs=256, max_num_batched_tokens=16384,
                                   max_model_len=2048, kv_cache_dtype=kv)
        generate(eng, *nano_warmup())
        rec: list = []
        wall = run_steps(eng, prompts, outs, rec)
        eng.reset_prefix_cache()
        row = {"bench": "tput_steps", "kv": kv, "mode": args.mode, "wall_s": round(wall, 3),
               "tok_per_s": round(sum(outs) / wall, 1), "steps": len(rec), "buckets": step_buckets(rec),
               "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
        print(json.dumps(row), flush=True)
        if not args.no_profile:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                pwall = run_steps(eng, prompts, outs, None)
            t0 = time.perf_counter()
            acc = kernel_accounting(prof, pwall)
            print(json.dumps({"bench": "tput_kernels", "kv": kv, "mode": args.mode,
                              "parse_s": round(time.perf_counter() - t0, 1), **acc}), flush=True)
            del prof
        eng.shutdown()
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
