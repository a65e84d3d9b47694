"""Issue 16's recovery times, measured from outside on one ``strata serve`` (tiny random Llama + a repository
with an isolated Python model), CPU by default:

- engine: SIGKILL the engine-core process, then time until ``/health`` is 200 again and until a completion
  succeeds (goal: within the engine's own start-up time, measured here too: launch to first 200 on ``/health``
  is an upper bound of it, since it also imports the server);
- python: SIGKILL the isolated model's process, then time until an inference succeeds again (goal: <= 5 s).

Each round kills both once, ``--gap-s`` apart; rounds alternate which is killed first. Prints one line per
round and a summary:
``engine_restart_s_max=... python_restart_s_max=... startup_s=...``.

    python benchmarks/restart_bench.py                 # 3 rounds
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _tiny_checkpoint import write_random_llama  # noqa: E402
from router_bench import Server  # noqa: E402

MODEL_PY = """
    import os
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))])
                    for _ in requests]
"""
CONFIG = """backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT64 dims: [1] } ]
output [ { name: "PID" data_type: TYPE_INT64 dims: [1] } ]
parameters { key: "EXECUTION_ISOLATION" value: { string_value: "process" } }
"""
BODY = {"inputs": [{"name": "X", "datatype": "INT64", "shape": [1], "data": [1]}]}


def _engine_pid(server_pid: int, python_pid: int) -> int:
    """The server's spawned child that is not the Python model's process."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            pid = int(stat.parent.name)
            if int(fields[1]) == server_pid and pid != python_pid and \
                    b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                return pid
        except (OSError, IndexError):
            continue
    raise SystemExit("no engine process found")


def _python_pid(url: str) -> int:
    r = httpx.post(f"{url}/v2/models/iso/infer", json=BODY, timeout=30)
    r.raise_for_status()
    return r.json()["outputs"][0]["data"][0]


def kill_engine(url: str, server_pid: int) -> float:
    engine = _engine_pid(server_pid, _python_pid(url))
    t0 = time.perf_counter()
    os.kill(engine, signal.SIGKILL)
    while httpx.get(f"{url}/health", timeout=10).status_code == 200:  # until the death is noticed
        time.sleep(0.01)
    while httpx.get(f"{url}/health", timeout=10).status_code != 200:
        time.sleep(0.05)
    body = {"model": "chat", "prompt": "w5 w6 w7", "max_tokens": 4}
    httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
    took = time.perf_counter() - t0
    assert _engine_pid(server_pid, _python_pid(url)) != engine
    return took


def kill_python(url: str) -> float:
    pid = _python_pid(url)
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.05)  # let the parent see the death first (else this request is the in-flight one and fails)
    while True:
        try:
            new = _python_pid(url)
            break
        except httpx.HTTPStatusError:
            time.sleep(0.02)
    assert new != pid
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gap-s", type=float, default=32.0,
                   help="wait after each kill; kills of the same process are two gaps apart, beyond the supervisors' "
                        "60 s / 30 s crash-loop windows, so each is timed as a lone crash (no back-off)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="restart-bench-") as tmp:
        ckpt = write_random_llama(Path(tmp) / "llama")
        repo = Path(tmp) / "repo" / "iso"
        (repo / "1").mkdir(parents=True)
        (repo / "1" / "model.py").write_text(textwrap.dedent(MODEL_PY))
        (repo / "config.pbtxt").write_text(CONFIG)
        t0 = time.perf_counter()
        server = Server([str(ckpt), "--served-model-name", "chat", "--device", "cpu", "--dtype", "float32",
                         "--max-model-len", "512", "--kv-cache-memory-gib", "0.05",
                         "--model-repository", str(Path(tmp) / "repo")], Path(tmp) / "server.log")
        startup = time.perf_counter() - t0
        engine_s, python_s = [], []
        try:
            for r in range(args.rounds):
                order = ("engine", "python") if r % 2 == 0 else ("python", "engine")
                for what in order:
                    if what == "engine":
                        engine_s.append(kill_engine(server.url, server.proc.pid))
                    else:
                        python_s.append(kill_python(server.url))
                    time.sleep(args.gap_s)
                print(f"round={r} order={','.join(order)} engine_restart_s={engine_s[-1]:.2f} "
                      f"python_restart_s={python_s[-1]:.2f}", flush=True)
        finally:
            server.stop()
    print(f"engine_restart_s_max={max(engine_s):.2f} engine_restart_s={','.join(f'{x:.2f}' for x in engine_s)} "
          f"python_restart_s_max={max(python_s):.2f} python_restart_s={','.join(f'{x:.2f}' for x in python_s)} "
          f"startup_s={startup:.2f} rounds={args.rounds}")


if __name__ == "__main__":
    main()
