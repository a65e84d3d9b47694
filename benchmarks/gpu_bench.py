"""H200 benchmark run: ceilings, kernels vs PyTorch, 8B decode (batch 1 and 64), start-up, offline throughput.

Every figure in every runner mode; each one JSON line appended to ``$OUT/h200.jsonl`` as soon as it is measured
(``bench``, ``model``, ``batch``, ``mode``, ``tok_per_s``, ``roofline_fraction``, ``date``, ``torch``, ``triton``,
``gpu`` plus details), each benchmark in its own try/except, a short table printed last. Fixed seeds, warm-ups.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/gpu_bench.py [--budget-s 420] [--only decode,kernel,...]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402

import gpu_kernels_bench as kb  # noqa: E402
import gpu_model_bench as mb  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
RESULTS = OUT / "h200.jsonl"
ROWS: list[dict] = []
BASE: dict = {}


def emit(bench: str, **fields) -> dict:
    row = {"bench": bench, "model": None, "batch": None, "mode": None, "tok_per_s": None,
           "roofline_fraction": None, **fields, **BASE}
    ROWS.append(row)
    with RESULTS.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


def guarded(name: str, fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception as exc:  # one failure must not lose the other figures
        traceback.print_exc()
        emit("error", what=name, error=repr(exc)[:400])
        torch.cuda.empty_cache()
        return None


def bench_ceilings() -> float:
    bw = kb.copy_bandwidth()
    tf = kb.gemm_tflops()
    emit("anchor", copy_TBps=round(bw / 1e12, 3), bf16_gemm_TFLOPs=round(tf, 1))
    return bw


def bench_kernels(bw: float) -> None:
    for row in kb.run_kernel_benches(bw):
        emit("kernel", **row)


def bench_decode(bw: float, batch: int, modes) -> None:
    cfg = mb.llama31_8b()
    for mode in modes:
        r = guarded(f"decode b{batch} {mode}", mb.decode_bench, cfg, mode, batch, bw)
        if r:
            emit("decode", model="llama-3.1-8b-shape", prompt=512, new_tokens=128, **r)


def bench_startup(modes) -> None:
    cfg = mb.llama31_8b()
    for mode in modes:
        r = guarded(f"startup {mode}", mb.startup_bench, cfg, mode)
        if r:
            emit("startup", model="llama-3.1-8b-shape", **r)


def write_random_qwen3(path: Path) -> Path:
    """A random Qwen3-0.6B-shaped bf16 checkpoint + a word-level tokenizer, written on the GPU machine."""
    from _tiny_checkpoint import write_word_tokenizer
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                      tie_word_embeddings=True, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m.save_pretrained(path)
    del m
    write_word_tokenizer(path, cfg.vocab_size)
    return path


_CKPT: dict = {}  # the random Qwen3-0.6B checkpoint, written once per run


def nano_workload(n: int = 256, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's workload: ``n`` token-id prompts of 100-1,024 tokens and output lengths of 100-1,024 (seed 0 is
    the one every throughput figure times)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(3, 151000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    return prompts, [rng.randint(100, 1024) for _ in range(n)]


def nano_warmup(n: int = 256) -> tuple[list[list[int]], list[int]]:
    """The warm-up before a timed pass: other prompts (so the timed pass gets no prefix-cache hits from it) over
    the same shapes, with outputs of 8-64 tokens."""
    rng = random.Random(1)
    prompts = [[rng.randint(3, 151000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    return prompts, [rng.randint(8, 64) for _ in range(n)]


def bench_throughput(modes, n: int = 256, profile: bool = False, label: str = "throughput") -> None:
    """nano-vllm's workload: 256 sequences, input and output lengths uniform in [100, 1024], greedy, ignore_eos,
    through the real engine (scheduler, runner, sampler). Start-up (weights + KV + graphs) is timed too."""
    from gpu_engine import generate, make_engine

    if "qwen3" not in _CKPT:
        _CKPT["tmp"] = tempfile.TemporaryDirectory()
        _CKPT["qwen3"] = write_random_qwen3(Path(_CKPT["tmp"].name) / "qwen3-0.6b")
    path = _CKPT["qwen3"]
    prompts, outs = nano_workload(n)
    warm_prompts, warm_outs = nano_warmup(n)
    for mode in modes:
        def one(mode=mode):
            # "<mode>-sync": the same runner mode with async scheduling off (host and device work serialised);
            # "<mode>-r5": the run-6 GPU switches off (separate rotary/norm/store kernels, no GEMV tuning, no
            # in-graph argmax), i.e. the code path of run 5: the "before" of run 6 in the same process
            # "<mode>-fp8" / "<mode>-int8": a quantised KV cache
            kv = next((k for k in ("fp8", "int8") if mode.endswith("-" + k)), "auto")
            sync = mode.endswith("-sync")
            variant = mode.removesuffix("-" + kv).removesuffix("-sync")
            base = variant.removesuffix("-r5").removesuffix("-r6")
            with run6_features(not variant.endswith("-r5")), split_target(mb.split_target(variant)):
                eng, t_ready = make_engine(str(path), base, "bfloat16", max_num_seqs=256,
                                           max_num_batched_tokens=16384, max_model_len=2048,
                                           async_scheduling=False if sync else None, kv_cache_dtype=kv)
            # Warm-up over the same shapes (256 other prompts, short outputs): Triton compiles each kernel variant
            # a mixed prefill/decode step needs on first use, which cost run 3's first timed pass ~3 s.
            generate(eng, warm_prompts, warm_outs)
            torch.cuda.synchronize()
            prof = None
            if profile:  # where the host time goes (cProfile slows Python, so its tok/s is not the figure)
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            t0 = time.perf_counter()
            res = generate(eng, prompts, outs)
            dt = time.perf_counter() - t0
            if prof is not None:
                prof.disable()
                _write_profile(prof, OUT / "throughput_profile.txt")
            n_out = sum(len(r) for r in res)
            eng.shutdown()
            del eng
            torch.cuda.empty_cache()
            if n_out != sum(outs):
                raise RuntimeError(f"engine produced {n_out} tokens, expected {sum(outs)}")
            return {"tok_per_s": round(n_out / dt, 1), "output_tokens": n_out, "time_s": round(dt, 2),
                    "startup_s": round(t_ready, 2)}
        r = guarded(f"throughput {mode}", one)
        if r:
            emit("throughput_profiled" if profile else label, model="qwen3-0.6b-shape", batch=n, mode=mode, **r)


@contextlib.contextmanager
def run6_features(on: bool):
    """Turn the run-6 switches of ``strataserve.envs`` on or off for engines built inside the block."""
    from strataserve import envs
    names = ("STRATA_FUSED_ROPE_KV", "STRATA_GEMV_TUNE", "STRATA_GRAPH_ARGMAX", "STRATA_DECODE_LONG_FIRST")
    saved = {n: getattr(envs, n) for n in names}
    for n in names:
        setattr(envs, n, on)
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(envs, n, v)


@contextlib.contextmanager
def split_target(target: int):
    """``STRATA_DECODE_SPLIT_TARGET`` for engines built inside the block (run 8; 0: run 6's decode launch)."""
    from strataserve import envs
    saved = envs.STRATA_DECODE_SPLIT_TARGET
    envs.STRATA_DECODE_SPLIT_TARGET = target
    try:
        yield
    finally:
        envs.STRATA_DECODE_SPLIT_TARGET = saved


def profile_throughput(n: int = 256) -> None:
    """Kernel tables of engine-step windows of the throughput workload (hybrid, run-6 features on)."""
    from gpu_engine import make_engine
    from gpu_profile import profile_engine_windows

    bench_throughput([], n)  # writes the checkpoint only
    prompts, outs = nano_workload(n)
    eng, _ = make_engine(str(_CKPT["qwen3"]), "hybrid", "bfloat16", max_num_seqs=256,
                         max_num_batched_tokens=16384, max_model_len=2048)
    text = profile_engine_windows(eng, prompts, outs, ((2, 8), (60, 80), (400, 420), (800, 820)))
    eng.shutdown()
    del eng
    torch.cuda.empty_cache()
    (OUT / "profile_throughput.txt").write_text(text)
    print(text, flush=True)


def sweeps6(bw: float) -> list[dict]:
    import gpu_sweeps6 as sw
    return sw.small_kernel_sweep() + sw.decode_mixed_sweep(bw) + sw.gemv_sweep6(bw)


def profile_decodes() -> None:
    from gpu_profile import profile_decode
    texts = [profile_decode(mb.llama31_8b(), m, 1, 512) for m in ("hybrid-r5", "hybrid")]
    texts += [profile_decode(mb.qwen3_06b(), m, b, 800) for m in ("hybrid-r5", "hybrid") for b in (256,)]
    text = "\n\n".join(texts)
    (OUT / "profile_decode.txt").write_text(text)
    print(text, flush=True)


def _write_profile(prof, path: Path) -> None:
    import io
    import pstats
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(30)
    path.write_text(buf.getvalue())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=420.0, help="start nothing new after this many seconds")
    p.add_argument("--only", default="", help="comma-separated item names to run (default: all, in plan order)")
    p.add_argument("--run", type=int, default=None, help="run number recorded in every JSON line")
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    BASE.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name(0))
    if args.run is not None:
        BASE["run"] = args.run
    t_start = time.perf_counter()
    bw = guarded("ceilings", bench_ceilings) or 4.28e12
    cfg = mb.llama31_8b()
    # most important first: the CUDA default (hybrid) for every headline figure, then the other modes
    plan = [("decode1-hybrid", lambda: bench_decode(bw, 1, ["hybrid"])),
            ("decode64-hybrid", lambda: bench_decode(bw, 64, ["hybrid"])),
            ("throughput-hybrid", lambda: bench_throughput(["hybrid"])),
            ("startup-hybrid", lambda: bench_startup(["hybrid"])),
            ("kernel", lambda: bench_kernels(bw)),
            ("matmul-only1", lambda: _matmul_only(cfg, 1, bw)),
            ("matmul-only64", lambda: _matmul_only(cfg, 64, bw)),
            ("decode1-others", lambda: bench_decode(bw, 1, ["eager", "triton", "graph"])),
            ("decode64-others", lambda: bench_decode(bw, 64, ["eager", "triton", "graph"])),
            ("startup-graph", lambda: bench_startup(["graph"])),
            ("throughput-triton", lambda: bench_throughput(["triton"])),
            ("throughput-graph", lambda: bench_throughput(["graph"])),
            ("throughput-eager", lambda: bench_throughput(["eager"])),
            # run 2: the batch-1 GEMV kernel against cuBLAS, launch-config sweeps, a profile of the throughput run
            ("decode1-hybrid-gemv", lambda: bench_decode(bw, 1, ["hybrid-gemv"])),
            ("gemv-sweep", lambda: [emit("kernel_sweep", **r) for r in kb.gemv_sweep(bw)]),
            ("attention-sweep", lambda: [emit("kernel_sweep", **r) for r in kb.attention_sweep(bw)]),
            ("throughput-hybrid-profile", lambda: bench_throughput(["hybrid"], profile=True)),
            # run 3: async scheduling (default on CUDA) against the synchronous loop, same host-side code
            ("throughput-hybrid-sync", lambda: bench_throughput(["hybrid-sync"])),
            # run 6: per-kernel profiles; before (-r5: the run-5 code path) / after, alternating
            ("profile-decode", profile_decodes),
            ("profile-throughput", profile_throughput),
            ("decode1-ab", lambda: bench_decode(bw, 1, ["hybrid-r5", "hybrid"])),
            ("decode1-ba", lambda: bench_decode(bw, 1, ["hybrid", "hybrid-r5"])),
            ("decode64-ab", lambda: bench_decode(bw, 64, ["hybrid-r5", "hybrid"])),
            ("decode64-ba", lambda: bench_decode(bw, 64, ["hybrid", "hybrid-r5"])),
            ("throughput-ab", lambda: bench_throughput(["hybrid-r5", "hybrid"])),
            ("throughput-ba", lambda: bench_throughput(["hybrid", "hybrid-r5"])),
            # the first engine of a process runs its timed pass slow (runs 6a/6b: ~19k whichever mode came
            # first), so each mode gets a discarded engine first, then three rounds in alternating order
            ("throughput-rounds", lambda: (bench_throughput(["hybrid-r5", "hybrid"], label="throughput_warmup"),
                                           bench_throughput(["hybrid-r5", "hybrid", "hybrid", "hybrid-r5",
                                                             "hybrid-r5", "hybrid"]))),
            ("decode1-rounds", lambda: bench_decode(bw, 1, ["hybrid-r5", "hybrid", "hybrid", "hybrid-r5",
                                                            "hybrid-r5", "hybrid"])),
            ("decode64-rounds", lambda: bench_decode(bw, 64, ["hybrid-r5", "hybrid", "hybrid", "hybrid-r5",
                                                              "hybrid-r5", "hybrid"])),
            ("sweeps6", lambda: [emit("kernel_sweep", **r) for r in sweeps6(bw)]),
            # run 8: adaptive per-row decode splits; r5 / r6 / new (hybrid) in the same process, rotating order
            ("sweeps8", lambda: [emit("kernel_sweep", **r) for r in _sweeps8(bw)]),
            ("decode1-r8", lambda: bench_decode(bw, 1, R8_ORDER)),
            ("decode64-r8", lambda: bench_decode(bw, 64, R8_ORDER)),
            ("decode64-targets", lambda: bench_decode(bw, 64, ["hybrid-t1", "hybrid-t2", "hybrid-t4", "hybrid-t8"])),
            ("throughput-r8", lambda: (bench_throughput(["hybrid-r5", "hybrid-r6", "hybrid"],
                                                        label="throughput_warmup"),
                                       bench_throughput(R8_ORDER))),
            # 8b: run 6's path (the default before) against the new one only, three rounds alternating
            ("decode1-r8b", lambda: bench_decode(bw, 1, ["hybrid-r6", "hybrid", "hybrid", "hybrid-r6"])),
            ("throughput-r8b", lambda: (bench_throughput(["hybrid-r6"], label="throughput_warmup"),
                                        bench_throughput(["hybrid-r6", "hybrid", "hybrid", "hybrid-r6", "hybrid-r6",
                                                          "hybrid"]))),
            # run 10: the default (hybrid) alone, after one discarded engine, three rounds
            ("throughput-r10", lambda: (bench_throughput(["hybrid"], label="throughput_warmup"),
                                        bench_throughput(["hybrid", "hybrid", "hybrid"]))),
            # run 11: the quantised caches' decode path; bf16, fp8, int8 alternating
            ("throughput-kv", lambda: (bench_throughput(["hybrid-fp8", "hybrid", "hybrid-int8"],
                                                        label="throughput_warmup"),
                                       bench_throughput(["hybrid", "hybrid-fp8", "hybrid-int8", "hybrid-fp8",
                                                         "hybrid", "hybrid", "hybrid-fp8", "hybrid-int8"])))]
    only = list(filter(None, args.only.split(",")))
    if only:  # in the order given
        unknown = set(only) - {name for name, _ in plan}
        if unknown:
            raise SystemExit(f"unknown items: {sorted(unknown)}")
        plan = sorted((x for x in plan if x[0] in only), key=lambda x: only.index(x[0]))
    for name, fn in plan:
        if time.perf_counter() - t_start > args.budget_s:
            emit("skipped", what=name, reason=f"time budget {args.budget_s}s spent")
            continue
        t0 = time.perf_counter()
        guarded(name, fn)
        print(f"--- {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    print("\n=== summary ===")
    for r in ROWS:
        keys = ("bench", "model", "batch", "mode", "tok_per_s", "roofline_fraction", "ms_per_step", "startup_s",
                "graph_capture_s", "kernel", "triton_frac_copy_bw", "torch_frac_copy_bw", "triton_TFLOPs",
                "torch_TFLOPs", "what", "error", "copy_TBps", "bf16_gemm_TFLOPs")
        print(" ".join(f"{k}={r[k]}" for k in keys if r.get(k) is not None))


# three rounds, each mode first once: r5 = run 5's path, r6 = run 6's (the default before run 8), hybrid = now
R8_ORDER = ["hybrid-r5", "hybrid-r6", "hybrid", "hybrid", "hybrid-r5", "hybrid-r6", "hybrid-r6", "hybrid",
            "hybrid-r5"]


def _sweeps8(bw: float) -> list[dict]:
    import gpu_sweeps8
    return gpu_sweeps8.decode_sweep8(bw)


def _matmul_only(cfg, batch: int, bw: float) -> None:
    r = mb.matmul_only_bench(cfg, batch, bw)
    emit("decode_matmul_only", model="llama-3.1-8b-shape", **r)


if __name__ == "__main__":
    main()
