"""One `strata serve --model-repository` subprocess (KServe HTTP + gRPC on free ports) for a test, stopped after.

It is up once `/v2/health/live` answers: the repository's models are loaded before the HTTP server serves, and
readiness is what some tests check, so it cannot be the start-up signal."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).parent.parent


@dataclass
class Launched:
    http: str  # "127.0.0.1:PORT", the form tritonclient wants
    grpc: str
    log: Path

    @property
    def base(self) -> str:
        return f"http://{self.http}"

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def kserve_server(repo: Path, log: Path, *flags: str, timeout_s: float = 90) -> Iterator[Launched]:
    http_port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "strataserve", "serve", "--model-repository", str(repo), "--host", "127.0.0.1",
           "--port", str(http_port), "--grpc-port", str(grpc_port), "--uvicorn-log-level", "warning",
           "--disable-uvicorn-access-log", *flags]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    server = Launched(f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if httpx.get(f"{server.base}/v2/health/live", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not live after {timeout_s} s:\n{server.log_tail()}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
