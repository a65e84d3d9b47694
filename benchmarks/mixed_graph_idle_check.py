"""Mixed-step CUDA graphs captured while the engine is idle (runner/mixed_graph.py, issue 12), 8B shape, H200.

Builds the engine core as `strata serve` does (random bf16 weights, hybrid runner), then calls ``idle_work()``
as the idle core process would until it reports nothing left, and prints one JSON line: buckets captured, seconds,
GPU memory reserved before/after, then whether mixed steps of several sizes replay without a further capture.

    python benchmarks/mixed_graph_idle_check.py --model DIR    # DIR: 8B config.json (+ tokenizer); written if missing
"""
from __future__ import annotations

import argparse
import json
import os
import random
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    args = ap.parse_args()
    if not (Path(args.model) / "config.json").exists():
        write_8b_config(Path(args.model))
    cfg = EngineConfig(model=ModelConfig(model=args.model, dtype="bfloat16", device="cuda", max_model_len=4096,
                                         load_format="dummy", skip_tokenizer_init=True),
                       cache=CacheConfig(num_blocks=4096),
                       scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens))
    core = EngineCore(cfg)
    mixed = core.runner.mixed  # type: ignore[attr-defined]
    reserved0 = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    pieces = 1
    while core.idle_work():
        pieces += 1
    dt = time.perf_counter() - t0
    row = {"bench": "mixed_graph_idle_capture", "buckets": len(mixed.graphs), "of": len(mixed.sizes),
           "pieces": pieces, "seconds": round(dt, 2), "reserved_gib_before": round(reserved0 / 2**30, 2),
           "reserved_gib_after": round(torch.cuda.memory_reserved() / 2**30, 2), "disabled": mixed.disabled}
    rng = random.Random(0)
    for i, n in enumerate((40, 300, 1000, 3000)):  # prompts of several sizes beside running decodes
        core.add_request(EngineCoreRequest(request_id=f"p{i}", prompt_token_ids=[rng.randrange(10, 120000)
                                                                                  for _ in range(n)],
                                           sampling_params=SamplingParams(max_tokens=8, ignore_eos=True,
                                                                          temperature=0.0)))
    before = mixed.capture_seconds
    outs = 0
    while core.has_unfinished_requests():
        outs += sum(len(o.new_token_ids) for o in core.step().outputs)
    row.update(tokens=outs, capture_seconds_while_serving=round(mixed.capture_seconds - before, 3))
    print(json.dumps(row), flush=True)
    with (OUT / "mixed_graph_idle_check.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    core.shutdown()


if __name__ == "__main__":
    main()
