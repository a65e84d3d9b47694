"""Throughput of nano-vllm's workload (Qwen3-0.6B shape, 256 requests, prompts and outputs of 100-1,024 tokens,
``ignore_eos``) under the sampling settings users actually send, in one process: greedy (the control), nano-vllm's
temperature 0.6, temperature 0.8 with top-p 0.95 (with and without per-request seeds), greedy with logprobs, and
repetition + frequency penalties. Each is warmed up on other prompts first. These are the requests that used to
stall async scheduling (host syncs in the sampler, or requests kept synchronous), so run it against an older tree
to see what that cost: ``PYTHONPATH=OLD_TREE:... python benchmarks/sampling_throughput.py MODEL``.

    python benchmarks/sampling_throughput.py MODEL_DIR [--workloads greedy,t06,...] [--label NAME]
One JSON line per workload.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WORKLOADS = {
    "greedy": dict(temperature=0.0),
    "t06": dict(temperature=0.6),
    "topp": dict(temperature=0.8, top_p=0.95),
    "topp_seeded": dict(temperature=0.8, top_p=0.95, seeded=True),
    "topk_minp": dict(temperature=0.8, top_k=50, min_p=0.05),
    "logprobs": dict(temperature=0.0, logprobs=1),
    "logprobs5": dict(temperature=0.0, logprobs=5),
    "penalties": dict(temperature=0.6, repetition_penalty=1.1, frequency_penalty=0.2),
}


def params_for(spec: dict, outs: list[int], seed: int):
    from strataserve import SamplingParams

    spec = dict(spec)
    seeded = spec.pop("seeded", False)
    return [SamplingParams(ignore_eos=True, max_tokens=n, **spec, **({"seed": seed + i} if seeded else {}))
            for i, n in enumerate(outs)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--label", default="")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import torch

    import strataserve
    from gpu_bench import nano_warmup, nano_workload
    from strataserve import LLM

    llm = LLM(args.model, max_model_len=4096)
    prompts, outs = nano_workload(n=args.num_requests, seed=args.seed)
    wp, wo = nano_warmup(64)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for name in args.workloads.split(","):
        spec = WORKLOADS[name]
        llm.generate(prompt_token_ids=wp, sampling_params=params_for(spec, wo, args.seed + 10_000), use_tqdm=False)
        sync()
        t0 = time.perf_counter()
        res = llm.generate(prompt_token_ids=prompts, sampling_params=params_for(spec, outs, args.seed),
                           use_tqdm=False)
        sync()
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in res)
        if n != sum(outs):
            raise RuntimeError(f"{name}: {n} tokens generated, expected {sum(outs)}")
        print(json.dumps({"bench": "sampling_throughput", "label": args.label, "workload": name,
                          "tok_per_s": round(n / dt, 1), "time_s": round(dt, 3), "output_tokens": n,
                          "strataserve": str(Path(strataserve.__file__).parent), "torch": torch.__version__}),
              flush=True)


if __name__ == "__main__":
    main()
