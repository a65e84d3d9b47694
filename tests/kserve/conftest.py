"""One `strata serve --model-repository` subprocess (KServe HTTP + gRPC) shared by every test in tests/kserve
(package scope: it stops when the last test of this folder is done)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from _model_repos import add_onnx_mlp, build_standard_repo

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


@dataclass
class KServeServer:
    http: str  # "127.0.0.1:PORT", the form tritonclient wants
    grpc: str
    repo: Path
    refs: dict
    proc: subprocess.Popen
    log: Path

    @property
    def base(self) -> str:
        return f"http://{self.http}"

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="package")  # torn down when tests/kserve is done
def kserve(tmp_path_factory) -> KServeServer:
    tmp = tmp_path_factory.mktemp("kserve")
    repo = tmp / "repo"
    refs = build_standard_repo(repo)
    refs["spare_weights"] = add_onnx_mlp(repo, name="onnx_spare", seed=10)  # for load/unload tests
    # a generous batching window so the batching test sees merged batches on a busy 2-core machine
    refs["batch_weights"] = add_onnx_mlp(repo, name="onnx_batch", max_batch_size=32, max_queue_delay_us=50_000, seed=20)
    # a model that cannot load (its version folder has no model.onnx): listed UNAVAILABLE with the reason,
    # answered 503 / UNAVAILABLE
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "onnxruntime"\nmax_batch_size: 2\n')
    http_port, grpc_port = _free_port(), _free_port()
    cmd = [
        sys.executable, "-m", "strataserve", "serve", "--model-repository", str(repo),
        "--model-control-mode", "explicit", "--load-model", "*",
        "--host", "127.0.0.1", "--port", str(http_port), "--grpc-port", str(grpc_port),
        "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
    ]
    log = tmp / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    server = KServeServer(f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", repo, refs, proc, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"KServe server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if httpx.get(f"{server.base}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"KServe server not ready after 90 s:\n{server.log_tail()}")
            time.sleep(0.3)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
