"""The offline LLM's generate loop with the start-up heap set aside from the collector (``startup.heap_set_aside``,
the default) against ``STRATA_GC_FREEZE=0``, on the CPU: a tiny random Qwen3 checkpoint, 64 prompts, 200 greedy
tokens each, with logprobs 0 (none), 1 and 5. Each (setting, round) is a fresh process; the order alternates.
One JSON line per run, then a summary line of the ratios per round.

    python benchmarks/offline_heap_ab.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import json, random, sys, time
sys.path[:0] = [{root!r}, {tests!r}]
from strataserve import LLM, SamplingParams
llm = LLM({ckpt!r}, max_model_len=512)
rng = random.Random(0)
prompts = [[rng.randint(3, 400) for _ in range(rng.randint(8, 32))] for _ in range(64)]
for n in (None, 1, 5):
    ps = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=200, logprobs=n)
    llm.generate(prompt_token_ids=prompts[:8], sampling_params=ps, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    out = llm.generate(prompt_token_ids=prompts, sampling_params=ps, use_tqdm=False)
    dt = time.perf_counter() - t
    print(json.dumps({{"logprobs": n, "tok_per_s": round(sum(len(o.outputs[0].token_ids) for o in out) / dt, 1)}}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from _tiny_models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_checkpoint("qwen3", tmp)
        code = CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"), ckpt=tmp)
        rows = {}
        for r in range(args.rounds):
            for setting in (("aside", "off") if r % 2 == 0 else ("off", "aside")):
                env = dict(os.environ, STRATA_GC_FREEZE="0" if setting == "off" else "1")
                out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
                for line in out.stdout.splitlines():
                    row = dict(json.loads(line), setting=setting, round=r)
                    rows[(r, setting, row["logprobs"])] = row["tok_per_s"]
                    print(json.dumps(row), flush=True)
        ratios = {str(n): [round(rows[(r, "aside", n)] / rows[(r, "off", n)], 3) for r in range(args.rounds)]
                  for n in (None, 1, 5)}
        print(json.dumps({"bench": "offline_heap_ab", "aside_over_off": ratios}))


if __name__ == "__main__":
    main()
