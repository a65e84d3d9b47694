"""CPU path settings (OpenMP / torch threads, the C layer ops): the offline benchmark under each, rotating order.

Each setting runs ``offline_throughput.py`` in a fresh interpreter (libgomp reads its variables once, at load) with
``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` cleared first and then the setting's own variables applied. ``--busy N``
starts N background processes spinning on a core each for the whole run (a shared machine: the API process, a
client, another job). Prints one line per run: ``round=1 setting=default busy=0 tok_per_s=... cpu_s=...``.

    python benchmarks/cpu_thread_settings.py --rounds 3 --num-requests 128
    python benchmarks/cpu_thread_settings.py --rounds 3 --busy 1 --settings default,passive,active
    python benchmarks/cpu_thread_settings.py --rounds 3 --busy 1 --settings default,before,threads1 --before OLD_TREE

``before`` is the default setting run from another source tree (``--before``, put first on PYTHONPATH).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},  # strataserve's defaults: the work-sharing pool (runner/cpu_pool.py), torch held at one thread
    # torch's own OpenMP threads instead of the pool (the default before 2026-12-03: GOMP_SPINCOUNT=10000 and the
    # thread governor); the OpenMP settings below all run without the pool, or they would change nothing
    "no_pool": {"STRATA_CPU_POOL": "0"},
    "passive": {"STRATA_CPU_POOL": "0", "OMP_WAIT_POLICY": "PASSIVE", "STRATA_CPU_THREADS": "fixed"},
    "spin10k": {"STRATA_CPU_POOL": "0", "GOMP_SPINCOUNT": "10000", "STRATA_CPU_THREADS": "fixed"},
    "spin100k": {"STRATA_CPU_POOL": "0", "GOMP_SPINCOUNT": "100000", "STRATA_CPU_THREADS": "fixed"},
    "gomp_default": {"STRATA_CPU_POOL": "0", "GOMP_SPINCOUNT": "300000", "STRATA_CPU_THREADS": "fixed"},
    "active": {"STRATA_CPU_POOL": "0", "OMP_WAIT_POLICY": "ACTIVE", "STRATA_CPU_THREADS": "fixed"},
    "threads1": {"STRATA_CPU_THREADS": "fixed", "STRATA_BENCH_THREADS": "1"},
    "torch_ops": {"STRATA_CPU_LAYER_OPS": "0"},  # the layer's elementwise ops as PyTorch ops, not runner/cpu_ops.py's C
    "before": {},  # the defaults of the tree given by --before
}


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="default,passive,spin100k,threads1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--busy", type=int, default=0, help="background processes spinning during the runs")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--before", default=None, help="source tree for the 'before' setting")
    args, extra = p.parse_known_args(argv)
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; choose from {sorted(SETTINGS)}")
    if "before" in names and not args.before:
        raise SystemExit("the 'before' setting needs --before TREE")
    tmp = tempfile.TemporaryDirectory()
    from _tiny_checkpoint import write_random_llama

    model = str(write_random_llama(Path(tmp.name) / "tiny-llama"))
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    rows = []
    try:
        for r in range(1, args.rounds + 1):
            k = (r - 1) % len(names)
            for name in names[k:] + names[:k]:  # rotate who goes first
                env = {key: v for key, v in os.environ.items()
                       if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "STRATA_CPU_THREADS", "STRATA_CPU_LAYER_OPS")}
                env.update(SETTINGS[name])
                if name == "before":
                    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(args.before), env.get("PYTHONPATH", "")])
                threads = env.pop("STRATA_BENCH_THREADS", "0")
                cmd = [sys.executable, str(HERE / "offline_throughput.py"), "--model", model, "--num-requests",
                       str(args.num_requests), "--threads", threads, *extra]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("output_tokens=")]
                if proc.returncode != 0 or not line:
                    raise SystemExit(f"{name} failed:\n{proc.stderr[-2000:]}")
                got = dict(kv.split("=", 1) for kv in line[-1].split())
                row = {"round": r, "setting": name, "busy": args.busy, "tok_per_s": got["tok_per_s"],
                       "cpu_s": got["cpu_s"], "threads": got["threads"]}
                print(" ".join(f"{a}={b}" for a, b in row.items()), flush=True)
                rows.append(row)
    finally:
        stop.set()
        for s in spinners:
            s.join()
        tmp.cleanup()
    return rows


if __name__ == "__main__":
    main()
