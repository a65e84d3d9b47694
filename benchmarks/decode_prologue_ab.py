"""Batch-1 decode with and without the GEMV prologues (run 16), the pipelined K loop and the argmax kernel (run 17),
in one process, alternating which goes first.

``gpu_model_bench.decode_bench`` in hybrid mode (CUDA graphs, start-up tuning as the runner does it): 512-token
prompt, 128 greedy steps. ``prologue`` (the default) lets the tuning fuse the RMSNorm (+ add) / SiLU-mul into the
following GEMV where that measured faster; ``separate`` is ``STRATA_GEMV_PROLOGUE=0``; ``before`` is the code
before run 16 (no prologues, run 15's GEMV candidates: no evict-first loads, no 32-row blocks); ``run16`` is the
code before run 17 (prologues, run 16's candidates, the K loop not pipelined, torch's argmax). The greedy token is
taken inside the replayed step by the runner's ``greedy_tokens`` (run 17's argmax kernel); ``torch-argmax`` takes
it there with ``torch.argmax`` (the runner before run 17), ``eager-argmax`` after the step from float32 logits (this
benchmark before run 17). Run 18's switches: ``nopdl`` is the default path with ``STRATA_PDL=0`` (every kernel
launched only after the previous one has finished; since 18f this also keeps the rotary out of attention),
``noprefetch`` with ``STRATA_PDL_PREFETCH=0`` (PDL without the
L2 prefetches before the wait: the GEMV's weights, decode attention's first key tile), ``ropesep`` with
``STRATA_DECODE_ROPE_IN_ATTENTION=0`` (the rotary + KV-store launch before decode attention), and ``run17`` all three
off (the code before run 18). Run 19's (for batch > 1): ``run18`` is ``STRATA_GEMM_TUNE=0`` with PDL for batch 1
only (cuBLAS for every multi-row matmul: the code before run 19), ``pdl1`` the default with PDL for batch 1 only,
``pdlall`` the default with PDL for launches of every row count. Run 20's: ``nosilu`` is ``STRATA_GEMM_SILU=0``
(gate_up's SiLU-and-mul in its own launch: the code before run 20), ``gemmall`` the default with every 2-64-row
matmul on its fastest Triton configuration even where cuBLAS timed up to 10% faster alone (qkv and o at the 8B
shape: does PDL's overlap pay inside the step?). Run 21's: ``ropein`` is the default with the rotary + KV store
inside decode attention up to 64 rows (``STRATA_DECODE_ROPE_MAX_ROWS=64``), ``attnBxWxS`` the default with decode
attention launched at block_n B, W warps, S stages in every regime (``triton_ops.DECODE_CONFIGS``),
``ropein-attnBxWxS`` both.
One JSON line per
(shape, round, variant) with ms/step, the roofline fraction and the tuning's choices:

    python benchmarks/decode_prologue_ab.py --shapes 8b,0.6b --rounds 3
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
import gpu_kernels_bench as kb  # noqa: E402
import gpu_model_bench as mb  # noqa: E402
from strataserve import envs  # noqa: E402
from strataserve.kernels.gemv import GemvConfig  # noqa: E402
from strataserve.runner import gemm_tuning, gemv_tuning, triton_ops  # noqa: E402
import skinny_chain_ab  # noqa: E402

CONFIGS = {"8b": mb.llama31_8b, "0.6b": mb.qwen3_06b,
           # the Qwen3-0.6B shape without the q/k norm (run 18: is the norm what the fused decode kernel pays for?)
           "0.6b-nonorm": lambda: dataclasses.replace(mb.qwen3_06b(), qk_norm=False)}
# run 15's candidates (the "before" variant): no evict-first loads, no 32-row blocks. Before run 17 the kernel's K
# loop was never pipelined whatever num_stages said, so these and run 16's (the "run16" variant) run unpipelined.
CANDIDATES_R15 = tuple(GemvConfig(*c, num_stages=1) for c in ((16, 512, 1, 4), (16, 512, 2, 4), (4, 512, 1, 4),
                                                             (16, 1024, 2, 8), (8, 1024, 1, 8), (16, 512, 3, 4)))
CANDIDATES_R16 = tuple(GemvConfig(*c, num_stages=1, evict_first=True) for c in (
    (16, 512, 1, 4), (16, 512, 2, 4), (4, 512, 1, 4), (16, 1024, 2, 8), (8, 1024, 1, 8), (16, 512, 3, 4),
    (32, 512, 1, 4), (32, 512, 2, 4)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8b,0.6b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--variants", default="prologue,separate,before")
    args = p.parse_args()
    bw = kb.copy_bandwidth()
    final = gemv_tuning.CANDIDATES  # (read once: the variants below rebind it)
    tune_gemm, cache = gemm_tuning.tune_gemm, envs.STRATA_KERNEL_CACHE
    rope_rows, decode_configs = envs.STRATA_DECODE_ROPE_MAX_ROWS, triton_ops.DECODE_CONFIGS
    for shape in args.shapes.split(","):
        cfg = CONFIGS[shape]()
        for rnd in range(args.rounds):
            order = args.variants.split(",")
            for variant in (order if rnd % 2 == 0 else order[::-1]):
                # read by apply_tuning / tune_gemv when the model is set up
                envs.STRATA_GEMV_PROLOGUE = variant not in ("separate", "before")
                # read at every kernel launch (so at graph capture) / when the ops are built
                envs.STRATA_PDL = variant not in ("nopdl", "run17")
                envs.STRATA_PDL_PREFETCH = variant not in ("noprefetch", "run17")
                envs.STRATA_DECODE_ROPE_IN_ATTENTION = variant not in ("ropesep", "run17")
                envs.STRATA_DECODE_ROPE_MAX_ROWS = 64 if variant.startswith("ropein") else rope_rows
                attn = variant.rpartition("attn")[2] if "attn" in variant else ""
                triton_ops.DECODE_CONFIGS = dict.fromkeys(decode_configs, tuple(int(x) for x in attn.split("x"))) \
                    if attn else decode_configs
                gemv_tuning.CANDIDATES = {"before": CANDIDATES_R15, "run16": CANDIDATES_R16}.get(variant, final)
                envs.STRATA_GEMM_TUNE = variant != "run18"
                envs.STRATA_GEMM_SILU = variant not in ("nosilu", "run18")
                # gemmall: its own tuning record (the margin is not part of the record's key)
                gemm_tuning.tune_gemm = functools.partial(tune_gemm, min_gain=-0.1) if variant == "gemmall" \
                    else tune_gemm
                envs.STRATA_KERNEL_CACHE = cache + ("-gemmall" if variant == "gemmall" else "")
                skinny_chain_ab.set_pdl(True if variant.startswith("pdlall") else False if variant in ("run18", "pdl1")
                                        else None, envs.STRATA_PDL_PREFETCH)
                argmax = {"torch-argmax": "graph-torch", "run16": "graph-torch", "eager-argmax": "eager"}.get(variant,
                                                                                                      "graph")
                r = mb.decode_bench(cfg, "hybrid", args.batch, bw, argmax=argmax)
                print(json.dumps({"bench": "decode_prologue_ab", "shape": shape, "round": rnd, "variant": variant,
                                  "copy_TBps": round(bw / 1e12, 3), **r}), flush=True)


if __name__ == "__main__":
    main()
