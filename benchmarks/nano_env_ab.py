"""nano-vllm's protocol (``nano_protocol.py``, a fresh process each) under several environments, in alternating
order per round, so that a switch in ``strataserve/envs.py`` can be compared with the first-process bias of the
device (the first process of a call tends to run fastest) spread over the variants. One JSON line per (round,
variant): nano_protocol's line plus ``variant``, ``round`` and the start-up GEMM tuning's log lines.

    python benchmarks/nano_env_ab.py MODEL_DIR --rounds 3 --variant base --variant wide \\
        --env wide:STRATA_GEMM_ROWS=16,64,128,256 --env wide:STRATA_PDL_MAX_ROWS=256
``--env NAME:VAR=VALUE`` sets VAR for variant NAME's processes (``serve_startup.py``'s convention); a variant with
none runs in this process's environment.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--variant", action="append", required=True, help="NAME (repeat)")
    p.add_argument("--env", action="append", default=[], help="NAME:VAR=VALUE for variant NAME (repeat)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=150)
    args, extra = p.parse_known_args()
    envs: dict[str, dict[str, str]] = {name: {} for name in args.variant}
    for spec in args.env:
        name, _, assign = spec.partition(":")
        var, _, value = assign.partition("=")
        if name not in envs or not var:
            raise SystemExit(f"--env {spec!r}: use NAME:VAR=VALUE with NAME one of the variants {args.variant}")
        envs[name][var] = value
    variants = list(envs.items())
    for r in range(args.rounds):
        for name, env in variants if r % 2 == 0 else variants[::-1]:
            out = subprocess.run([sys.executable, str(HERE / "nano_protocol.py"), args.model, "--log", *extra],
                                 env={**os.environ, **env}, capture_output=True, text=True, timeout=args.timeout)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if out.returncode == 0 and lines else {"error": out.stderr[-500:]}
            tuning = [line for line in out.stderr.splitlines() if "GEMM tuning" in line or "SiLU epilogue" in line]
            print(json.dumps({**row, "variant": name, "env": env, "round": r, "tuning_log": tuning}), flush=True)


if __name__ == "__main__":
    main()
