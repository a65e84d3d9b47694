"""HTTP path vs offline on a small CPU box (issue 16 item 5): server variants in alternating rounds.

Each round runs the offline engine on the workload (all requests at once, the first variant's tree), then, for
every variant (order alternating per round), ``strata serve`` driven by ``strata bench serve --max-concurrency 64
--ignore-eos``. Per-process CPU per output token is read from /proc (API process, engine core, load generator:
the latter includes its start-up) to show where the cores go. A variant is ``NAME=TREE[:SERVER ARGS]``: the source
tree put first on PYTHONPATH and extra ``strata serve`` flags (``NAME=VALUE`` items: the server's environment).
One line per (round, variant):

    variant=... round=... offline_tok_s=... http_tok_s=... ratio=... api_us=... engine_us=... client_us=...

    python benchmarks/http_path_ab.py --variant main=. --variant si4=.:"--stream-interval 4" --rounds 3

``--marginal N`` serves N requests too (after the usual run, same variant) and adds each process's CPU per output
token between the two runs: start-up, warm-up and drain cancel out, so ``marginal_api_us`` / ``marginal_engine_us``
/ ``marginal_client_us`` are the steady-state costs that share the cores.

``--busy-first S`` spins one core from this process for the first S seconds of each served run (another job that
comes and goes while the server is under load: does the engine get its threads back once it has left?).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _server import Server  # noqa: E402
from _tiny_checkpoint import write_random_llama  # noqa: E402

TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    s = open(f"/proc/{pid}/stat").read()
    f = s[s.rindex(")") + 2:].split()
    return (int(f[11]) + int(f[12])) / TCK


def children(pid: int) -> list[int]:
    out: list[int] = []
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
        except OSError:
            pass
    return out


def offline(tree: str, model: str, args: argparse.Namespace) -> tuple[float, float]:
    """Output tok/s of the offline engine and its CPU per output token (µs, all its threads)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(HERE / "offline_throughput.py"), "--model", model, "--num-requests",
           str(args.num_requests), "--input-len", "32", "256", "--output-len", "32", "256",
           "--max-num-batched-tokens", "2048", "--kv-cache-memory-gib", "2"]
    line = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    res = dict(kv.split("=", 1) for kv in line.split())
    return float(res["tok_per_s"]), round(1e6 * float(res["cpu_s"]) / float(res["output_tokens"]), 1)


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def served(tree: str, extra: list[str], model: str, args: argparse.Namespace, tmp: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])}
    env.update(kv.split("=", 1) for kv in extra if "=" in kv and kv[:1].isupper())  # NAME=VALUE: the server's env
    extra = [a for a in extra if not ("=" in a and a[:1].isupper())]
    srv = Server([model, "--dtype", "float32", "--device", "cpu", "--max-num-batched-tokens", "2048",
                  "--kv-cache-memory-gib", "2", *extra], tmp / "server.log", env=env)
    try:
        api = srv.proc.pid
        procs = [api, *children(api)]
        c0 = {p: cpu_s(p) for p in procs}
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = tmp / "bench.json"
        if args.busy_first > 0:
            threading.Thread(target=_spin, args=(args.busy_first,), daemon=True).start()
        subprocess.run([sys.executable, "-m", "strataserve", "bench", "serve", "--base-url", srv.url, "--tokenizer",
                        model, "--dataset-name", "random", "--random-input-len", "144", "--random-output-len", "144",
                        "--random-range-ratio", f"{112 / 144:.4f}", "--num-prompts", str(args.num_requests),
                        "--max-concurrency", "64", "--ignore-eos", "--num-warmups", "16", "--disable-tqdm",
                        "--save-result", str(out)], env=env, check=True, stdout=subprocess.DEVNULL)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        c1 = {p: cpu_s(p) for p in procs}
    finally:
        srv.stop()
    res = json.loads(out.read_text())
    tok = res["output_throughput"] * res["duration"]
    client = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime  # includes the client's start-up
    cpu = {"api": c1[api] - c0[api], "engine": sum(c1[p] - c0[p] for p in procs[1:]), "client": client}
    return {"http_tok_s": round(res["output_throughput"], 1), "failed": res["failed"], "tokens": tok,
            "duration_s": res["duration"], "cpu_s": cpu, "api_us": round(1e6 * cpu["api"] / tok, 1),
            "engine_us": round(1e6 * cpu["engine"] / tok, 1),
            "engine_cores": round(cpu["engine"] / res["duration"], 2), "client_us": round(1e6 * client / tok, 1),
            "ttft_p50_ms": round(res["median_ttft_ms"], 1), "itl_p50_ms": round(res["median_itl_ms"], 1)}


def marginal(short: dict, long: dict) -> dict:
    """CPU per output token of each process between a short and a long served run: start-up, warm-up and drain
    cancel out, so these are the steady-state costs."""
    dt = long["tokens"] - short["tokens"]
    us = {f"marginal_{k}_us": round(1e6 * (long["cpu_s"][k] - short["cpu_s"][k]) / dt, 1) for k in short["cpu_s"]}
    return {**us, "marginal_tok_s": round(dt / (long["duration_s"] - short["duration_s"]), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=True, help="NAME=TREE[:SERVER ARGS] (repeat)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--busy-first", type=float, default=0.0, help="spin one core for the first S seconds of each "
                   "served run")
    p.add_argument("--marginal", type=int, default=0, metavar="N",
                   help="also serve N requests per variant and round, and report each process's CPU per token "
                   "between the two runs (marginal_*_us)")
    args = p.parse_args()
    variants = []
    for v in args.variant:
        name, _, rest = v.partition("=")
        tree, _, extra = rest.partition(":")
        variants.append((name, os.path.abspath(tree), extra.split()))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = str(write_random_llama(tmp / "tiny-llama"))
        for r in range(args.rounds):
            off, off_us = (None, None) if args.skip_offline else offline(variants[0][1], model, args)
            for name, tree, extra in (variants if r % 2 == 0 else variants[::-1]):
                res = served(tree, extra, model, args, tmp)
                if args.marginal:
                    longer = argparse.Namespace(**{**vars(args), "num_requests": args.marginal})
                    res.update(marginal(res, served(tree, extra, model, longer, tmp)))
                for key in ("tokens", "duration_s", "cpu_s"):
                    res.pop(key)
                ratio = round(res["http_tok_s"] / off, 3) if off else None
                line = {"variant": name, "round": r, "offline_tok_s": off, "offline_engine_us": off_us, **res,
                        "ratio": ratio,
                        "load": round(os.getloadavg()[0], 2)}
                print(" ".join(f"{k}={v}" for k, v in line.items()), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
