"""Issue 15's replica figure: output throughput of 2 replicas vs 1 behind the router, goal >= 1.9x.

Self-contained: writes a random Qwen3-0.6B-shaped checkpoint (``--tiny``: a tiny random Llama on the CPU), starts
a local Ray cluster with ``ray.init()``, starts the replicas as Ray actors exactly as ``strata serve --config``
does for ``replicas: 2, placement: ray`` (``router/local_replicas.start_replicas``), and runs nano-vllm's
workload (256 sequences, input and output lengths uniform in [100, 1024], greedy, ignore_eos, all submitted at
once) through the router's replicated engine -- the object the OpenAI routes call, with its replica choice,
its per-replica ``AsyncLLM`` fronts and their detokenisation -- once over one replica and once over both.
The replicas are started once; "1 replica" routes over the first only. Rounds alternate the order; each run
has its own prompt tokens (same lengths), so no run gets prefix-cache hits from another.

Prints one line per run, then the summary line:
``replicas_bench replicas=2 ratio_min=... ratios=... tok_s_1=... tok_s_2=... goal=1.9 met=...``.

    python benchmarks/replicas_bench.py                      # 2 GPUs: Qwen3-0.6B shape, 3 rounds
    python benchmarks/replicas_bench.py --placement local    # the same without Ray: 2 engine processes
    python benchmarks/replicas_bench.py --tiny               # CPU: tiny model, tiny workload (a smoke test)

``--placement local`` (``placement: local`` in the config: one engine process per GPU on this host, same zmq
wire, same router path) measures the same replication where Ray is not installed.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def write_checkpoint(tmp: Path, tiny: bool) -> tuple[Path, int]:
    """The checkpoint and its vocabulary size."""
    if tiny:
        from _tiny_checkpoint import TINY_LLAMA, write_random_llama

        return write_random_llama(tmp / "tiny-llama"), TINY_LLAMA["vocab_size"]
    from gpu_bench import write_random_qwen3

    return write_random_qwen3(tmp / "qwen3-0.6b"), 151936


def engine_config(path: Path, tiny: bool, max_num_seqs: int, skip_tokenizer: bool):
    from strataserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    if tiny:
        return EngineConfig(model=ModelConfig(model=str(path), dtype="float32", device="cpu", max_model_len=512,
                                              skip_tokenizer_init=skip_tokenizer),
                            cache=CacheConfig(kv_cache_memory_gib=0.05),
                            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048))
    from strataserve.config import RunnerConfig

    return EngineConfig(model=ModelConfig(model=str(path), dtype="bfloat16", device="cuda", max_model_len=2048,
                                          skip_tokenizer_init=skip_tokenizer),
                        cache=CacheConfig(gpu_memory_utilization=0.85),
                        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=16384),
                        runner=RunnerConfig(cuda_graph_max_bs=max_num_seqs))


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's workload shape: lengths from seed 0 (the same in every run), tokens from ``seed``."""
    lrng, trng = random.Random(0), random.Random(seed)
    lens = [(lrng.randint(lo, hi), lrng.randint(lo, hi)) for _ in range(n)]
    return [[trng.randint(3, vocab - 1) for _ in range(p)] for p, _ in lens], [o for _, o in lens]


async def run(engine, prompts: list[list[int]], outs: list[int], tag: str) -> tuple[int, float]:
    from strataserve.types.sampling import SamplingParams

    async def one(i: int) -> int:
        # the server's kind: deltas
        params = SamplingParams(temperature=0.0, max_tokens=outs[i], ignore_eos=True, output_kind="delta")
        n = 0
        async for out in engine.generate(prompts[i], params, f"{tag}-{i}"):
            n += sum(len(c.token_ids) for c in out.outputs)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    dt = time.perf_counter() - t0
    if sum(counts) != sum(outs):
        raise RuntimeError(f"{tag}: {sum(counts)} output tokens, expected {sum(outs)}")
    return sum(counts), dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU: tiny random Llama, tiny workload")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--placement", choices=("ray", "local"), default="ray")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=None, help="default 256 (--tiny: 16)")
    ap.add_argument("--skip-tokenizer-init", action="store_true",
                    help="no detokenisation in the front (isolates the engines' scaling from the front's cost)")
    ap.add_argument("--goal", type=float, default=1.9)
    ap.add_argument("--out", type=Path, default=None, help="append the summary as a JSON line to this file")
    args = ap.parse_args()
    n = args.num_prompts or (16 if args.tiny else 256)
    lo, hi = (16, 64) if args.tiny else (100, 1024)
    max_num_seqs = 16 if args.tiny else 256

    import torch

    from strataserve.router.local_replicas import ReplicatedEngine, start_replicas

    ray_version = None
    if args.placement == "ray":
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # one host: every Ray address on loopback
        import ray

        # The object store carries nothing but actor calls (outputs stream over zmq): keep it small.
        ray.init(num_cpus=2 if args.tiny else None, include_dashboard=False, log_to_driver=False,
                 object_store_memory=(100 if args.tiny else 1024) * 2**20)
        ray_version = ray.__version__
    tmp = tempfile.TemporaryDirectory()
    path, vocab = write_checkpoint(Path(tmp.name), args.tiny)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the checkpoint was written on GPU 0, where a replica is about to load
    cfg = engine_config(path, args.tiny, max_num_seqs, args.skip_tokenizer_init)
    t0 = time.perf_counter()
    both = start_replicas("bench", cfg, count=args.replicas, placement=args.placement)
    startup = time.perf_counter() - t0
    views = {1: ReplicatedEngine("bench", both.engines[:1]), args.replicas: both}
    rows: list[dict] = []

    async def bench() -> None:
        # warm-up: every replica sees the same shapes once (kernel compiles, graphs), short outputs
        wp, wo = workload(n, lo, hi, vocab, seed=999)
        await run(both, wp, [min(o, 32) for o in wo], "warm")
        for rnd in range(args.rounds):
            order = [1, args.replicas] if rnd % 2 == 0 else [args.replicas, 1]
            for k in order:
                prompts, outs = workload(n, lo, hi, vocab, seed=100 * rnd + k)
                tokens, dt = await run(views[k], prompts, outs, f"r{rnd}-{k}")
                row = {"round": rnd, "replicas": k, "output_tokens": tokens, "time_s": round(dt, 3),
                       "tok_per_s": round(tokens / dt, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)

    asyncio.run(bench())
    both.shutdown()
    if ray_version is not None:
        ray.shutdown()
    per = {k: [r["tok_per_s"] for r in rows if r["replicas"] == k] for k in (1, args.replicas)}
    ratios = [round(b / a, 3) for a, b in zip(per[1], per[args.replicas])]
    summary = {"bench": "replicas", "replicas": args.replicas, "placement": args.placement, "ratio_min": min(ratios), "ratios": ratios,
               "tok_s_1": per[1], f"tok_s_{args.replicas}": per[args.replicas], "goal": args.goal,
               "met": all(r >= args.goal for r in ratios), "model": "tiny-llama" if args.tiny else "qwen3-0.6b-shape",
               "num_prompts": n, "lengths": [lo, hi], "skip_tokenizer_init": args.skip_tokenizer_init,
               "startup_s": round(startup, 1), "device": torch.cuda.get_device_name(0) if not args.tiny else "cpu",
               "torch": torch.__version__, "ray": ray_version, "date": datetime.date.today().isoformat()}
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(json.dumps(summary) + "\n")
    print("replicas_bench " + " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in summary.items()
                                       if k != "bench"))


if __name__ == "__main__":
    main()
