"""One `strata serve --model-repository` subprocess (KServe HTTP + gRPC on free ports) for a test, stopped after.

It is up once `/v2/health/live` answers: the repository's models are loaded before the HTTP server serves, and
readiness is what some tests check, so it cannot be the start-up signal."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from _ports import start_serve


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


@contextlib.contextmanager
def kserve_server(repo: Path, log: Path, *flags: str, timeout_s: float = 90) -> Iterator[Launched]:
    log.write_text("")
    served = start_serve(["--model-repository", str(repo), "--uvicorn-log-level", "warning",
                          "--disable-uvicorn-access-log", *flags], log, ready_path="/v2/health/live", grpc=True,
                         timeout_s=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield Launched(f"127.0.0.1:{served.port}", f"127.0.0.1:{served.grpc_port}", log)
    finally:
        served.stop(timeout_s=15)
