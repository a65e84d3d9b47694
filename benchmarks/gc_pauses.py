"""The garbage collector's pauses in a served `strata serve` (API process and engine core), with the start-up heap
frozen (the default, ``startup.freeze_startup_heap``) and without (``STRATA_GC_FREEZE=0``), alternating rounds.

A ``sitecustomize`` put first on the server's PYTHONPATH times every collection (``gc.callbacks``) in each process
and writes them out when the process exits; those that started while the load ran are counted. The load is `strata bench serve` (tiny random Llama on CPU, 144-token
prompts and outputs, concurrency 64). One line per (round, variant):

    variant=... round=... tok_s=... itl_p99_ms=... api_gc_ms=... api_gc_max_ms=... api_full=... api_cpu_s=...
    engine_gc_ms=... engine_gc_max_ms=...

    python benchmarks/gc_pauses.py [--rounds 3] [--requests 768]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from _server import Server  # noqa: E402
from _tiny_checkpoint import write_random_llama  # noqa: E402
from http_path_ab import cpu_s  # noqa: E402

PROBE = '''
import atexit, gc, json, os, sys, time
_out = os.environ.get("GC_PROBE_DIR")
if _out:
    _t, _pauses = [0.0], []
    def _cb(phase, info):
        if phase == "start":
            _t[0] = time.time()
        else:
            _pauses.append((info["generation"], _t[0], time.time() - _t[0]))
    gc.callbacks.append(_cb)
    def _dump():
        with open(os.path.join(_out, f"{os.getpid()}.json"), "w") as f:
            json.dump({"argv": sys.argv[:2], "pauses": _pauses}, f)
    atexit.register(_dump)
'''


def summary(pauses: list, window: tuple[float, float]) -> dict:
    """Collections that started while the load ran (start-up's, and the freeze's own, are not counted)."""
    inside = [(g, d) for g, t, d in pauses if window[0] <= t <= window[1]]
    ms = [1e3 * d for _, d in inside]
    return {"gc_ms": round(sum(ms), 1), "gc_max_ms": round(max(ms, default=0.0), 2),
            "full": sum(1 for g, _ in inside if g == 2)}


def run(variant: str, env_extra: dict, model: str, args: argparse.Namespace, tmp: Path) -> dict:
    probe_dir = Path(tempfile.mkdtemp(dir=tmp))
    site = tmp / "site"
    env = {**os.environ, **env_extra, "GC_PROBE_DIR": str(probe_dir),
           "PYTHONPATH": os.pathsep.join([str(site), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    srv = Server([model, "--dtype", "float32", "--device", "cpu", "--max-num-batched-tokens", "2048",
                  "--kv-cache-memory-gib", "2"], tmp / "server.log", env=env)
    out = tmp / "bench.json"
    try:
        c0, t0 = cpu_s(srv.proc.pid), time.time()
        subprocess.run([sys.executable, "-m", "strataserve", "bench", "serve", "--base-url", srv.url, "--tokenizer",
                        model, "--dataset-name", "random", "--random-input-len", "144", "--random-output-len", "144",
                        "--random-range-ratio", "0", "--num-prompts", str(args.requests), "--max-concurrency", "64",
                        "--ignore-eos", "--num-warmups", "8", "--disable-tqdm", "--seed", "0",
                        "--save-result", str(out)], check=True, stdout=subprocess.DEVNULL)
        api_cpu, window = cpu_s(srv.proc.pid) - c0, (t0, time.time())
        api_pid = srv.proc.pid
    finally:
        srv.stop()
    res = json.loads(out.read_text())
    per_proc = {int(p.stem): json.loads(p.read_text()) for p in probe_dir.glob("*.json")}
    api = summary(per_proc.pop(api_pid, {"pauses": []})["pauses"], window)
    engine = summary(max(per_proc.values(), key=lambda d: len(d["pauses"]), default={"pauses": []})["pauses"],
                     window)
    return {"variant": variant, "tok_s": round(res["output_throughput"], 1),
            "itl_p99_ms": round(res.get("p99_itl_ms", float("nan")), 2),
            **{f"api_{k}": v for k, v in api.items()}, "api_cpu_s": round(api_cpu, 2),
            **{f"engine_{k}": v for k, v in engine.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=768)
    args = p.parse_args()
    variants = [("freeze", {}), ("no_freeze", {"STRATA_GC_FREEZE": "0"})]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "site").mkdir()
        (tmp / "site" / "sitecustomize.py").write_text(PROBE)
        model = str(write_random_llama(tmp / "tiny-llama"))
        for r in range(args.rounds):
            for name, env in (variants if r % 2 == 0 else variants[::-1]):
                line = {**run(name, env, model, args, tmp), "round": r}
                print(" ".join(f"{k}={v}" for k, v in line.items()), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
