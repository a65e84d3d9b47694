"""Qwen3-TTS with and without the talker's batch-1 tuning (run 16: GEMVs and GEMV prologues chosen at load), two
engines side by side in one process, rounds alternating which runs first.

``tts_bench.py``'s random talkers in the released shapes, greedy, no eos, FRAMES frames per clip, at batch 1 and
8. ``tuned`` is ``load_tts_model``'s default; ``untuned`` is ``STRATA_GEMV_TUNE=0``, the code before run 16 (every
matmul through cuBLAS, every norm its own launch); ``run16`` tunes over run 16's candidates with the K loop not
pipelined (the code before run 17); ``run17`` is ``tuned`` with run 18's switches off (``STRATA_PDL=0``,
``STRATA_DECODE_ROPE_IN_ATTENTION=0``: no programmatic dependent launch, rotary + KV store before attention);
``pdl1`` is ``tuned`` with PDL for batch-1 launches only (``STRATA_PDL_MAX_ROWS=1``, run 18's limit; run 19 raised
it to 64 rows). One JSON line per (shape, round, batch, variant):

    FRAMES=64 python benchmarks/tts_tuning_ab.py --shapes 0.6B,1.7B --rounds 4 [--variants tuned,run16]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tts_bench as tb  # noqa: E402
from strataserve import envs  # noqa: E402
from strataserve.engine.tts_engine import build_core  # noqa: E402
from strataserve.kernels import _common  # noqa: E402
from strataserve.runner import gemv_tuning  # noqa: E402
from decode_prologue_ab import CANDIDATES_R16  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="0.6B,1.7B")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--variants", default="tuned,untuned", help="two of tuned, untuned, run16, run17, pdl1")
    args = p.parse_args()
    first, second = args.variants.split(",")
    final = gemv_tuning.CANDIDATES
    batches = [int(b) for b in args.batches.split(",")]
    for name in args.shapes.split(","):
        raw, codec_raw = tb.shape(name)
        vocab = raw["talker_config"]["text_vocab_size"]
        gen = torch.Generator().manual_seed(0)
        texts = [torch.randint(0, min(vocab, 150000) - 8, (tb.TEXT_LEN,), generator=gen).tolist()
                 for _ in range(max(batches))]
        engines = {}
        for variant in (first, second):
            envs.STRATA_GEMV_TUNE = variant != "untuned"  # read by tune_talker while the model is built
            envs.STRATA_PDL = variant != "run17"  # read at every kernel launch: set again before each timed run
            _common.PDL_MAX_ROWS = 1 if variant == "pdl1" else envs.STRATA_PDL_MAX_ROWS
            envs.STRATA_DECODE_ROPE_IN_ATTENTION = variant != "run17"
            gemv_tuning.CANDIDATES = CANDIDATES_R16 if variant == "run16" else final
            model = tb.our_model(raw, codec_raw)
            core, runner = build_core(model, max_num_seqs=max(batches), max_num_batched_tokens=4096,
                                      kv_cache_memory_gib=4.0)
            for b in dict.fromkeys([2, *batches]):  # warm-up: kernels, allocator, each batch size's graphs
                tb.run_ours(core, runner, model, texts[:b], f"warm{variant}{b}")
            engines[variant] = (core, runner, model)
        for rnd in range(args.rounds):
            for variant in ((first, second) if rnd % 2 == 0 else (second, first)):
                core, runner, model = engines[variant]
                envs.STRATA_PDL = variant != "run17"
                _common.PDL_MAX_ROWS = 1 if variant == "pdl1" else envs.STRATA_PDL_MAX_ROWS
                for b in batches:
                    n, dt = tb.run_ours(core, runner, model, texts[:b], f"r{rnd}{variant}{b}")
                    print(json.dumps({"bench": "tts_tuning_ab", "shape": name, "round": rnd, "batch": b,
                                      "variant": variant, "frames": n, "s": round(dt, 4), "fps": round(n / dt, 1)}),
                          flush=True)
        for core, _, _ in engines.values():
            core.shutdown()
        del engines
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
