"""Host (CPU) cost per engine step of the GPU throughput workload, without a GPU.

Replays nano-vllm's workload shape (256 sequences, prompt and output lengths uniform in [100, 1024], greedy,
block size 16) through the real ``Scheduler``, the runner's input building and the ``OutputProcessor``, with a
null "model" that returns a fixed token; prints the mean milliseconds per step of each part over the
decode-heavy steps (>= 200 running requests). What the GPU run overlaps or serialises is exactly this work.

    PYTHONPATH=. python benchmarks/gpu_host_profile.py [--steps 300] [--profile FILE]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from strataserve.config import SchedulerConfig  # noqa: E402
from strataserve.engine.output_processor import OutputProcessor  # noqa: E402
from strataserve.types.outputs import ModelRunnerOutput  # noqa: E402
from strataserve.types.protocol import EngineCoreOutputs  # noqa: E402
from strataserve.engine.request import Request  # noqa: E402
from strataserve.types.sampling import SamplingParams  # noqa: E402
from strataserve.engine.scheduler import Scheduler  # noqa: E402
from strataserve.runner import input_batch as ib  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--profile", default=None)
    args = p.parse_args(argv)
    bs, n = 16, 256
    sched = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=16384), num_blocks=40000,
                      block_size=bs, max_model_len=2048)
    outp = OutputProcessor(None)
    rng = random.Random(0)
    for i in range(n):
        prompt = [rng.randint(3, 151000) for _ in range(rng.randint(100, 1024))]
        sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(100, 1024), ignore_eos=True)
        for cr in outp.add_request(str(i), None, prompt, sp):
            sched.add_request(Request.from_core_request(cr, max_model_len=2048,
                                                        max_pool_tokens=sched.max_pool_tokens, seq=i))
    rows = ib.BlockTableRows(256, 2048 // bs) if hasattr(ib, "BlockTableRows") else None
    cpu = torch.device("cpu")
    t = {"schedule": 0.0, "build_input_batch": 0.0, "update_from_output": 0.0, "process_outputs": 0.0}
    counted = 0
    prof = None
    for step in range(args.steps + 40):
        if step == 40 and args.profile:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        if rows is None:  # the pre-persistent-rows signature (A/B against older commits)
            batch = ib.build_input_batch(so.chunks, bs, cpu, torch.bfloat16, False)
        else:
            batch = ib.build_input_batch(so.chunks, bs, cpu, torch.bfloat16, False, rows)
        t2 = time.perf_counter()
        chunks = so.chunks
        ids = [chunks[i].req_id for i in batch.sample_chunk_ids]
        res = ModelRunnerOutput(ids, [7] * len(ids), [None] * len(ids))
        t3 = time.perf_counter()
        outs = sched.update_from_output(so, res)
        t4 = time.perf_counter()
        outp.process_outputs(EngineCoreOutputs(outputs=outs))
        t5 = time.perf_counter()
        if step >= 40 and len(sched.running) >= 200:
            counted += 1
            for k, dt in zip(t, (t1 - t0, t2 - t1, t4 - t3, t5 - t4)):
                t[k] += dt
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
    res = {k: round(v / max(counted, 1) * 1e3, 3) for k, v in t.items()}
    res["total_ms"] = round(sum(res.values()), 3)
    res["steps"] = counted
    print(" ".join(f"{k}={v}" for k, v in res.items()), flush=True)
    return res


if __name__ == "__main__":
    main()
