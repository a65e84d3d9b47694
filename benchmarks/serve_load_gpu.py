"""Issue 12 item 3, under load: `strata serve` with the Llama-3.1-8B shape (random bf16 weights through
``--load-format dummy``), greedy, ``ignore_eos``, prompt 1024 / output 128, driven by `strata bench serve`:

- ``closed``: closed loop at concurrency 64 (goal >= 3,950 out tok/s);
- ``poisson``: Poisson arrivals at 16 req/s (goal TTFT P50 <= 50 ms, ITL P99 <= 30 ms).

    python benchmarks/serve_load_gpu.py --model DIR --variant "NAME=TREE [serve flags]" ... [--rounds 3]

Every variant's server starts once, all side by side on the one GPU (each with its own fixed KV pool, so none
sizes its pool from memory another holds); round r runs the variants in the given order when r is odd, reversed
when even, each variant both workloads. The client is this tree's `strata bench serve` for every variant.
One JSON line per (round, variant, workload) to stdout and $OUT/serve_load.jsonl: the client's figures, the CPU
time of the API process and of its children (the engine core) over the run as % of one core, and -- when the
variant's engine writes a step log (``STRATA_STEP_LOG``, set for every variant; older trees ignore it) -- the
steps of the run: decode-only vs with prefill, their device ms (P50 / P99) and prefill tokens per step.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _server import Server  # noqa: E402
from serve_startup import write_8b_config  # noqa: E402

OUT = Path(os.environ.get("OUT", ".")).resolve()
LOGS = Path(os.environ.get("LOGS", OUT)).resolve()
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, in seconds (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def step_breakdown(log: Path, t0: float, t1: float) -> dict:
    """Figures of the engine steps logged between wall times t0 and t1."""
    if not log.exists():
        return {}
    rows = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4 and t0 <= float(parts[0]) <= t1:
            rows.append((int(parts[1]), int(parts[2]), float(parts[3])))
    if not rows:
        return {}
    a = np.array(rows, dtype=np.float64)
    dec, mixed = a[a[:, 1] == 0], a[a[:, 1] > 0]

    def pct(x: np.ndarray, q: float) -> float:
        return round(float(np.percentile(x, q)), 2) if len(x) else 0.0
    return {"steps": len(a), "steps_with_prefill": len(mixed), "busy_s": round(float(a[:, 2].sum()) / 1e3, 2),
            "decode_ms_p50": pct(dec[:, 2], 50), "decode_ms_p99": pct(dec[:, 2], 99),
            "decodes_per_step_p50": pct(a[:, 0], 50),
            "prefill_step_ms_p50": pct(mixed[:, 2], 50), "prefill_step_ms_p99": pct(mixed[:, 2], 99),
            "prefill_step_ms_max": round(float(mixed[:, 2].max()), 2) if len(mixed) else 0.0,
            "prefill_tokens_p50": pct(mixed[:, 1], 50),
            "prefill_tokens_max": int(mixed[:, 1].max()) if len(mixed) else 0,
            "decodes_in_prefill_steps_p50": pct(mixed[:, 0], 50)}


def bench(server: Server, workload: str, args: argparse.Namespace, seed: int, result: Path) -> dict:
    n = args.closed_prompts if workload == "closed" else args.poisson_prompts
    cmd = [sys.executable, "-m", "strataserve", "bench", "serve", "--base-url", server.url, "--model", "llama8b",
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--random-range-ratio", "0", "--random-vocab-size", str(args.vocab), "--ignore-eos",
           "--num-prompts", str(n), "--num-warmups", str(args.warmups), "--seed", str(seed), "--disable-tqdm",
           "--save-result", str(result)]
    cmd += (["--max-concurrency", str(args.concurrency), "--request-rate", "inf"] if workload == "closed"
            else ["--request-rate", str(args.rate)])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    api = server.proc.pid
    kids = children(api)
    c0 = cpu_seconds(api), sum(cpu_seconds(k) for k in kids)
    t0 = time.time()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.bench_timeout)
    t1 = time.time()
    c1 = cpu_seconds(api), sum(cpu_seconds(k) for k in kids)
    if done.returncode != 0:
        raise RuntimeError(f"bench failed ({done.returncode}): {(done.stdout + done.stderr)[-1500:]}")
    r = json.loads(result.read_text())
    wall = t1 - t0
    keys = ("completed", "failed", "duration", "output_throughput", "request_throughput", "median_ttft_ms",
            "p99_ttft_ms", "mean_ttft_ms", "median_itl_ms", "p99_itl_ms", "mean_itl_ms", "median_tpot_ms",
            "p99_tpot_ms")
    row = {k: (round(r[k], 3) if isinstance(r.get(k), float) else r.get(k)) for k in keys}
    row.update(api_cpu_pct=round(100 * (c1[0] - c0[0]) / wall, 1),
               engine_cpu_pct=round(100 * (c1[1] - c0[1]) / wall, 1), client_wall_s=round(wall, 1),
               t0=round(t0, 3), t1=round(t1, 3))  # wall clock: other probes' records fall in this window
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="folder for the 8B config + tokenizer (written if missing)")
    ap.add_argument("--variant", action="append", required=True,
                    help='"NAME=TREE [ENV=VALUE ...] [extra strata serve flags]"; TREE is a code tree (PYTHONPATH '
                         'for its server); ENV=VALUE items (upper-case names) go to its environment')
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default="closed,poisson")
    ap.add_argument("--closed-prompts", type=int, default=256)
    ap.add_argument("--poisson-prompts", type=int, default=240)
    ap.add_argument("--warmups", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=8192, help="KV blocks per server (16 tokens each)")
    ap.add_argument("--bench-timeout", type=float, default=240)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64, help="closed loop: requests in flight")
    ap.add_argument("--rate", type=float, default=16.0, help="poisson: mean arrivals per second")
    ap.add_argument("--vocab", type=int, default=128000, help="prompt token ids are drawn below this")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--settle-s", type=float, default=15.0,
                    help="idle seconds after every server is ready, before round 1: each captures its mixed-step "
                         "graphs while idle, and side by side that capture slowed the first run (run 10)")
    args = ap.parse_args()
    if not (Path(args.model) / "config.json").exists():
        write_8b_config(Path(args.model))
    variants = []
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        tree, *extra = shlex.split(rest)
        variants.append((name, Path(tree).resolve(), extra))
    is_env = re.compile(r"[A-Z_][A-Z0-9_]*=").match
    envs = {name: dict(a.split("=", 1) for a in extra if is_env(a)) for name, _, extra in variants}
    variants = [(name, tree, [a for a in extra if not is_env(a)]) for name, tree, extra in variants]
    servers: dict[str, Server] = {}
    errors: dict[str, str] = {}

    def start(name: str, tree: Path, extra: list[str]) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
                   PYTHONUNBUFFERED="1", STRATA_STEP_LOG=str(LOGS / f"steps_{name}.log"), **envs[name])
        flags = [args.model, "--load-format", "dummy", "--dtype", args.dtype, "--served-model-name", "llama8b",
                 "--grpc-port", "0", "--num-gpu-blocks-override", str(args.blocks), "--max-model-len",
                 str(args.max_model_len), *extra]
        t0 = time.perf_counter()
        try:
            servers[name] = Server(flags, LOGS / f"server_{name}.log", 400, env=env, cwd=tree)
            ready = round(time.perf_counter() - t0, 1)
            print(json.dumps({"bench": "serve_load_start", "variant": name, "ready_s": ready, "flags": extra}),
                  flush=True)
        except BaseException as exc:  # noqa: BLE001 - report it, run the others
            errors[name] = repr(exc)[-1500:]

    threads = [threading.Thread(target=start, args=v) for v in variants]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, err in errors.items():
        print(json.dumps({"bench": "serve_load_start", "variant": name, "error": err}), flush=True)
    time.sleep(args.settle_s)
    try:
        for r in range(1, args.rounds + 1):
            order = variants if r % 2 else variants[::-1]
            for name, _tree, extra in order:
                if name not in servers:
                    continue
                for workload in args.workloads.split(","):
                    row = {"bench": "serve_load", "round": r, "variant": name, "workload": workload, "flags": extra}
                    t0 = time.time()
                    try:
                        row.update(bench(servers[name], workload, args, r, LOGS / f"bench_{name}_{workload}_{r}.json"))
                    except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
                        row["error"] = repr(exc)[-1500:]
                    row.update(step_breakdown(LOGS / f"steps_{name}.log", t0, time.time()))
                    line = json.dumps(row)
                    print(line, flush=True)
                    with (OUT / "serve_load.jsonl").open("a") as f:
                        f.write(line + "\n")
    finally:
        for s in servers.values():
            s.stop()


if __name__ == "__main__":
    main()
