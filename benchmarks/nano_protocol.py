"""The nano-vllm throughput workload timed the way nano-vllm's own ``bench.py`` times it, through the public ``LLM``
class with its defaults: one short warm-up prompt, then 256 requests (token-id prompts of 100-1,024 tokens, outputs
of 100-1,024 tokens, ``ignore_eos``) in one ``generate`` call. Greedy, as issue 12 measures (nano-vllm samples at
temperature 0.6: ``--temperature 0.6``). Meant for a fresh process, so the figure includes whatever a first run pays.

    PYTHONPATH=. python benchmarks/nano_protocol.py MODEL_DIR [--kv-cache-dtype fp8] [--max-num-batched-tokens N]
        [--max-model-len 4096] [--gpu-memory-utilization F] [--target-step-ms 0|auto|MS] [--warmup nano|bench]
        [--gc default|freeze|relaxed] [--log]
The line also gives the timed generate's Python GC collections per generation: [count, total ms, longest ms].
One JSON line.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


class GcPauses:
    """A ``gc.callbacks`` entry: per generation, the collections, their total and their longest pause (to see
    whether the host's collector stalls the GPU)."""

    def __init__(self) -> None:
        self.by_gen = {g: [0, 0.0, 0.0] for g in range(3)}
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        d = time.perf_counter() - self._start
        s = self.by_gen[info["generation"]]
        s[0], s[1], s[2] = s[0] + 1, s[1] + d, max(s[2], d)

    def summary(self) -> dict[str, list]:
        return {f"gen{g}": [n, round(1e3 * t, 1), round(1e3 * m, 2)] for g, (n, t, m) in self.by_gen.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the LLM class's")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    # where this protocol differs from gpu_bench's (docs/performance.md, run 12): each can be set to the other's
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="default: the LLM class's")
    p.add_argument("--target-step-ms", default="0", help="step pacing: 0 = off (the LLM default), auto, or ms")
    p.add_argument("--gc", choices=("default", "freeze", "relaxed"), default="default",
                   help="Python GC after init: as is; gc.freeze() of the start-up heap; freeze + gen0 threshold 50,000")
    p.add_argument("--warmup", choices=("nano", "bench"), default="nano",
                   help="nano: one short prompt (bench.py); bench: gpu_bench's 256 prompts of 8-64 outputs")
    p.add_argument("--log", action="store_true", help="strataserve's INFO logs to stderr (the start-up tunings' choices)")
    args = p.parse_args()
    if args.log:
        import logging

        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("strataserve").setLevel(logging.INFO)
    import torch

    from gpu_bench import nano_warmup, nano_workload
    from strataserve import LLM, SamplingParams

    extra = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    if args.gpu_memory_utilization is not None:
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    pacing = None if args.target_step_ms == "auto" else float(args.target_step_ms)
    t0 = time.perf_counter()
    llm = LLM(args.model, max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype,
              target_step_ms=pacing, **extra)
    t_init = time.perf_counter() - t0
    prompts, outs = nano_workload(seed=args.seed)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in outs]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    if args.gc != "default":
        gc.collect()
        gc.freeze()
        if args.gc == "relaxed":
            gc.set_threshold(50_000, 10, 10)
    if args.warmup == "nano":
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # nano-vllm's warm-up
    else:
        wp, wo = nano_warmup()
        llm.generate(prompt_token_ids=wp, use_tqdm=False,
                     sampling_params=[SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in wo])
    sync()
    gc_pauses = GcPauses()
    gc.callbacks.append(gc_pauses)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    sync()
    dt = time.perf_counter() - t0
    gc.callbacks.remove(gc_pauses)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    if n != sum(sp.max_tokens for sp in params):
        raise RuntimeError(f"{n} tokens generated, expected {sum(sp.max_tokens for sp in params)}")
    print(json.dumps({"bench": "nano_protocol", "kv_cache_dtype": args.kv_cache_dtype, "tok_per_s": round(n / dt, 1),
                      "time_s": round(dt, 3), "output_tokens": n, "init_s": round(t_init, 2),
                      "max_num_batched_tokens": llm.config.scheduler.max_num_batched_tokens,
                      "max_model_len": args.max_model_len,
                      "gpu_memory_utilization": llm.config.cache.gpu_memory_utilization,
                      "target_step_ms": args.target_step_ms, "warmup": args.warmup, "gc": args.gc,
                      "gc_count_ms_max": gc_pauses.summary(),
                      "temperature": args.temperature, "torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}), flush=True)


if __name__ == "__main__":
    main()
