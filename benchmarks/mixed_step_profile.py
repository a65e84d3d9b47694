"""Where a mixed prefill + decode step's time goes, Llama-3.1-8B shape (random bf16 weights), hybrid runner.

32 requests decode at ~1,100 tokens of context; one more request's prompt (or a chunk of it, after a cached
context) joins a step. For each prefill size: the host time of ``runner.launch`` (the Python forward that queues
the kernels), the step's whole time (launch -> tokens on the host), each the median of 5 steps, from an idle
device. Then cProfile of one launch of a 256-token chunk after a 768-token context, top functions by own time.

    python benchmarks/mixed_step_profile.py --model DIR    # DIR: 8B config.json (+ tokenizer); written if missing
One JSON line per case to stdout and $OUT/mixed_step_profile.jsonl, the profile to $OUT/mixed_step_profile.txt.
With ``--kernels N``: instead, torch.profiler over 5 steps of N fresh prompt tokens beside the decodes, kernels by
total CUDA time (per step) to stdout and $OUT/mixed_step_kernels.txt (graph replays included: CUPTI sees their
kernels).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_startup import write_8b_config  # noqa: E402

from strataserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from strataserve.engine.engine_core import EngineCore  # noqa: E402
from strataserve.types.protocol import EngineCoreRequest  # noqa: E402
from strataserve.types.sampling import SamplingParams  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
rng = random.Random(0)
VOCAB = 120000


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def req(rid: str, n: int, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[rng.randrange(10, VOCAB) for _ in range(n)],
                             sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of each decoding request")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=120000)
    ap.add_argument("--kernels", type=int, default=0, help="profile kernels of steps with this many prompt tokens")
    args = ap.parse_args()
    if not (Path(args.model) / "config.json").exists():
        write_8b_config(Path(args.model))
    global VOCAB
    VOCAB = args.vocab
    cfg = EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device,
                                         max_model_len=args.max_model_len,
                                         load_format="dummy", skip_tokenizer_init=True),
                       cache=CacheConfig(num_blocks=6144),
                       scheduler=SchedulerConfig(max_num_batched_tokens=8192, target_step_ms=0))
    core = EngineCore(cfg)
    sched, runner = core.scheduler, core.runner
    for i in range(args.decodes):
        core.add_request(req(f"d{i}", args.context, 4000))

    def step(so):
        return sched.update_from_output(so, runner.execute(so))
    for _ in range(40):  # every decode prefilled, then some decode steps (graphs warm)
        step(sched.schedule())
    if args.kernels:
        kernel_table(core, args.kernels, args.decodes)
        core.shutdown()
        return
    rows = []
    out = OUT / "mixed_step_profile.jsonl"
    cases = [("decode only", 0, 0), ("fresh", 64, 0), ("fresh", 256, 0), ("fresh", 512, 0), ("fresh", 1024, 0),
             ("fresh", 2048, 0), ("chunk after context", 256, 768), ("chunk after context", 512, 512)]
    for n_case, (kind, p, ctx) in enumerate(cases):
        host, total = [], []
        for rep in range(6):
            rid = f"x{n_case}_{rep}"
            if p:
                core.add_request(req(rid, ctx + p, 2))
                if ctx:  # compute the context first, in a step of its own
                    sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=args.decodes + ctx)
                    step(sched.schedule())
                sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=args.decodes + p)
            so = sched.schedule()
            sync()
            t0 = time.perf_counter()
            h = runner.launch(so)
            t1 = time.perf_counter()
            res = h.result()
            t2 = time.perf_counter()
            sched.update_from_output(so, res)
            sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=8192)
            if p:
                sched.finish_requests([rid])
            if rep:  # the first of each case warms its shapes
                host.append((t1 - t0) * 1e3)
                total.append((t2 - t0) * 1e3)
        row = {"bench": "mixed_step_profile", "case": kind, "prefill": p, "context": ctx, "decodes": args.decodes,
               "host_launch_ms": round(statistics.median(host), 2), "step_ms": round(statistics.median(total), 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
    # cProfile one mixed launch (256 after 768 of context)
    core.add_request(req("prof", 1024, 2))
    sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=args.decodes + 768)
    step(sched.schedule())
    sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=args.decodes + 256)
    so = sched.schedule()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    h = runner.launch(so)
    prof.disable()
    h.result()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    buf.write("\n\n")
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
    (OUT / "mixed_step_profile.txt").write_text(buf.getvalue())
    print(buf.getvalue()[:6000])
    core.shutdown()


def kernel_table(core: EngineCore, prefill: int, decodes: int, reps: int = 5) -> None:
    from torch.profiler import ProfilerActivity, profile

    sched, runner = core.scheduler, core.runner

    def one(i: int) -> float:
        core.add_request(req(f"k{i}", prefill, 2))
        sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=decodes + prefill)
        so = sched.schedule()
        sync()
        t0 = time.perf_counter()
        sched.update_from_output(so, runner.execute(so))
        sync()
        sched.finish_requests([f"k{i}"])
        return (time.perf_counter() - t0) * 1e3

    for i in range(3):  # warm the bucket
        one(i)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        times = [one(10 + i) for i in range(reps)]
    head = f"{reps} steps of {prefill} prompt tokens + {decodes} decodes: {statistics.median(times):.2f} ms median"
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    print(head + "\n" + table)
    (OUT / "mixed_step_kernels.txt").write_text(head + "\n" + table)


if __name__ == "__main__":
    main()
