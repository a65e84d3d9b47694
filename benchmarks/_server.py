"""A `strata serve` subprocess for the benchmarks: started on a free loopback port, waited for, stopped."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``env``/``cwd``: the server's environment and working directory (default: this process's);
    ``poll_s``: how often /health is asked while starting."""

    def __init__(self, args: list[str], log: Path, timeout_s: float = 600, env: dict | None = None,
                 cwd: Path | None = None, poll_s: float = 0.3) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log)
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "strataserve", "serve", *args, "--host", "127.0.0.1",
                                      "--port", str(self.port), "--disable-uvicorn-access-log",
                                      "--uvicorn-log-level", "warning"], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, cwd=cwd)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit("server did not start")
            time.sleep(poll_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        self.log.close()
