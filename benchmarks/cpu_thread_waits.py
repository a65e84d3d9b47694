"""How long a CPU engine's threads wait for a core (the thread governor's signal), in the situations it must tell
apart: the offline engine alone, next to N processes spinning on a core each, and behind ``strata serve`` under a
closed loop of 64 clients (the API process and the load generator share the cores).

The engine runs with ``STRATA_CPU_THREADS`` as given (default ``fixed``: two threads throughout, so the waits are
those two threads would see). After a warm-up it reads every engine thread's run and run-queue wait times
(``/proc/PID/task/TID/schedstat``) over a window and prints one line per case:

    case=offline busy=1 threads=fixed max_wait=0.41 waits=0.41,0.38 runs=0.52,0.50 tok_per_s=2046.4

``max_wait`` is the governor's measure (``runner/cpu_threads.py``: the largest wait fraction among busy threads).

    python benchmarks/cpu_thread_waits.py --cases offline:0,offline:1,served
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
sys.path.insert(0, str(HERE))
from _server import Server  # noqa: E402
from _tiny_checkpoint import write_random_llama  # noqa: E402
from http_path_ab import children  # noqa: E402

from strataserve.runner.cpu_threads import busy_fractions, read_thread_times  # noqa: E402


def waits(pid: int, window_s: float) -> tuple[list[float], list[float]]:
    """Run and wait fractions of ``pid``'s busy threads over ``window_s`` (as the governor counts them)."""
    t0, a = time.monotonic(), read_thread_times(pid)
    time.sleep(window_s)
    rows = sorted(busy_fractions(a, read_thread_times(pid), time.monotonic() - t0), reverse=True)
    return [round(r, 2) for r, _ in rows], [round(w, 2) for _, w in rows]


def offline(model: str, busy: int, env: dict, args: argparse.Namespace) -> dict:
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        proc = subprocess.Popen([sys.executable, str(HERE / "offline_throughput.py"), "--model", model,
                                 "--num-requests", str(args.num_requests)], env=env, stdout=subprocess.PIPE, text=True)
        time.sleep(args.warmup_s)
        runs, w = waits(proc.pid, args.window_s)
        line = proc.communicate()[0].strip().splitlines()[-1]
    finally:
        for s in spinners:
            s.kill()
    return {"runs": runs, "waits": w, "tok_per_s": dict(kv.split("=", 1) for kv in line.split())["tok_per_s"]}


def served(model: str, env: dict, args: argparse.Namespace, tmp: Path) -> dict:
    srv = Server([model, "--dtype", "float32", "--device", "cpu", "--max-num-batched-tokens", "2048",
                  "--kv-cache-memory-gib", "2"], tmp / "server.log", env=env)
    out = tmp / "bench.json"
    try:
        engine = max(children(srv.proc.pid), key=lambda p: len(os.listdir(f"/proc/{p}/task")))
        bench = subprocess.Popen([sys.executable, "-m", "strataserve", "bench", "serve", "--base-url", srv.url,
                                  "--tokenizer", model, "--dataset-name", "random", "--random-input-len", "144",
                                  "--random-output-len", "144", "--random-range-ratio", f"{112 / 144:.4f}",
                                  "--num-prompts", str(args.num_requests), "--max-concurrency", "64", "--ignore-eos",
                                  "--disable-tqdm", "--save-result", str(out)], env=env, stdout=subprocess.DEVNULL)
        time.sleep(args.warmup_s)
        runs, w = waits(engine, args.window_s)
        bench.wait()
    finally:
        srv.stop()
    return {"runs": runs, "waits": w, "tok_per_s": round(json.loads(out.read_text())["output_throughput"], 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="offline:0,offline:1,served", help="offline:N (N spinners) and/or served")
    p.add_argument("--threads", default="fixed", help="STRATA_CPU_THREADS for the engine")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--warmup-s", type=float, default=8.0)
    p.add_argument("--window-s", type=float, default=3.0)
    args = p.parse_args()
    env = {**os.environ, "STRATA_CPU_THREADS": args.threads, "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = str(write_random_llama(tmp / "tiny-llama"))
        for case in args.cases.split(","):
            kind, _, n = case.partition(":")
            busy = int(n or 0)
            res = offline(model, busy, env, args) if kind == "offline" else served(model, env, args, tmp)
            w = res["waits"]
            print(f"case={kind} busy={busy} threads={args.threads} max_wait={max(w, default=0.0)} "
                  f"waits={','.join(map(str, w))} runs={','.join(map(str, res['runs']))} "
                  f"tok_per_s={res['tok_per_s']}", flush=True)


if __name__ == "__main__":
    main()
