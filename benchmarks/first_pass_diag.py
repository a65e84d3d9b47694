"""Why the first engine of a process runs the nano-vllm workload ~1.5-2 s slower than the next one (H200).

In a fresh process: start the engine, run gpu_bench's warm-up (other prompts, short outputs), then the timed
workload twice (``pass1``, ``pass2``: new prompts each, so no prefix-cache hits). For each phase it reports the
wall time, the steps' wall time by kind (``throughput_accounting.step_buckets``), every Triton compile (kernel,
seconds, from Triton's JIT hooks) and the mixed-step CUDA graphs captured; ``--cprofile`` also writes the host
profile of pass 1 to ``$OUT/first_pass_cprofile.txt``.

    PYTHONPATH=.:benchmarks python benchmarks/first_pass_diag.py [--kv auto] [--cprofile]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

COMPILES: list[dict] = []
ARGS: dict = {}
_START: dict = {}


def install_hooks() -> bool:
    try:
        from triton import knobs
    except ImportError:
        return False

    def cache_hook(*args, **kw):
        _START[str(kw.get("key"))] = time.perf_counter()
        return None  # never skip the compile

    def post_hook(*args, **kw):
        t1 = time.perf_counter()
        t0 = _START.pop(str(kw.get("key")), t1)
        rep = str(kw.get("repr", "?"))
        COMPILES.append({"kernel": rep.split("[", 1)[0], "s": round(t1 - t0, 3), "repr": rep})
        return None
    knobs.runtime.jit_cache_hook = cache_hook
    knobs.runtime.jit_post_compile_hook = post_hook
    return True


def phase(name: str, fn, runner) -> dict:
    n0 = len(COMPILES)
    g0 = set(runner.mixed.graphs) if getattr(runner, "mixed", None) is not None else set()
    c0 = runner.mixed.capture_seconds if getattr(runner, "mixed", None) is not None else 0.0
    t0 = time.perf_counter()
    extra = fn() or {}
    wall = time.perf_counter() - t0
    new = COMPILES[n0:]
    row = {"bench": "first_pass", "phase": name, "kv": ARGS.get("kv"), "wall_s": round(wall, 3), "compiles": len(new),
           "compile_s": round(sum(c["s"] for c in new), 3),
           "compiled": [{k: c[k] for k in ("kernel", "s")} for c in new[:40]], **extra}
    with (Path(os.environ.get("OUT", ".")) / "compiles.jsonl").open("a") as f:  # full signatures, to diff variants
        for c in new:
            f.write(json.dumps({"phase": name, "kv": ARGS.get("kv"), **c}) + "\n")
    if getattr(runner, "mixed", None) is not None:
        row["new_mixed_graphs"] = sorted(set(runner.mixed.graphs) - g0)
        row["mixed_capture_s"] = round(runner.mixed.capture_seconds - c0, 3)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    from gpu_bench import nano_warmup, nano_workload, write_random_qwen3
    from gpu_engine import generate, make_engine
    from throughput_accounting import run_steps, step_buckets

    p = argparse.ArgumentParser()
    p.add_argument("--kv", default="auto")
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--ckpt", default="", help="checkpoint folder, written once and reused across processes")
    args = p.parse_args()
    ARGS["kv"] = args.kv
    print(json.dumps({"bench": "first_pass_env", "hooks": install_hooks(), "torch": torch.__version__,
                      "triton_cache": os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache")}), flush=True)
    tmp = tempfile.TemporaryDirectory()
    path = Path(args.ckpt) if args.ckpt else Path(tmp.name) / "qwen3-0.6b"
    if not (path / "config.json").exists():
        write_random_qwen3(path)
    holder: dict = {}

    def start():
        holder["eng"], t = make_engine(str(path), "hybrid", "bfloat16", max_num_seqs=256,
                                       max_num_batched_tokens=16384, max_model_len=2048, kv_cache_dtype=args.kv)
        return {"ready_s": round(t, 2)}
    n0 = len(COMPILES)
    t0 = time.perf_counter()
    start()
    eng = holder["eng"]
    runner = eng.core.runner
    with (Path(os.environ.get("OUT", ".")) / "compiles.jsonl").open("a") as f:
        for c in COMPILES[n0:]:
            f.write(json.dumps({"phase": "start", "kv": args.kv, **c}) + "\n")
    print(json.dumps({"bench": "first_pass", "phase": "start", "kv": args.kv,
                      "wall_s": round(time.perf_counter() - t0, 2),
                      "compiles": len(COMPILES) - n0, "compile_s": round(sum(c["s"] for c in COMPILES[n0:]), 3)}),
          flush=True)
    phase("warmup", lambda: generate(eng, *nano_warmup()) and None, runner)
    for name, seed in (("pass1", 0), ("pass2", 2)):
        prompts, outs = nano_workload(seed=seed)
        rec: list = []
        prof = None
        if name == "pass1" and args.cprofile:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()

        def go(prompts=prompts, outs=outs, rec=rec):
            w = run_steps(eng, prompts, outs, rec)
            return {"tok_per_s": round(sum(outs) / w, 1), "buckets": step_buckets(rec),
                    "slowest_steps_ms": sorted((round(dt * 1e3, 1), tok) for dt, tok, _ in rec)[-12:]}
        phase(name, go, runner)
        if prof is not None:
            prof.disable()
            import io
            import pstats
            buf = io.StringIO()
            st = pstats.Stats(prof, stream=buf)
            st.sort_stats("cumulative").print_stats(60)
            st.sort_stats("tottime").print_stats(30)
            (Path(os.environ.get("OUT", ".")) / "first_pass_cprofile.txt").write_text(buf.getvalue())
    eng.shutdown()


if __name__ == "__main__":
    main()
