"""Launching a real ``strata serve`` subprocess (tiny random Llama checkpoint, CPU) for the tests in tests/api.

``launch()`` backs the shared session server (conftest.py) and the tests that need a server of their own (to kill
its engine or SIGTERM it). A uniquely named module, so imports never pick up another folder's conftest.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL = "tiny"

# A Hermes-style template that renders the tools, assistant tool calls and tool results.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'tool' %}<tool_response>"
    "{{ m['tool_call_id'] }}:{{ m['content'] }}</tool_response>{% else %}{{ m['content'] or '' }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path
    api_key: str | None = API_KEY

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def launch(ckpt: Path, log: Path, *extra: str, api_key: str | None = API_KEY, wait: bool = True,
           new_session: bool = False) -> Server:
    """``new_session``: the server leads a process group of its own (so a test can signal the whole group, as
    systemd does, without signalling itself)."""
    port = free_port()
    cmd = [sys.executable, "-m", "strataserve", "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--dtype", "float32", "--served-model-name", MODEL, "--kv-cache-memory-gib", "0.01",
           "--max-model-len", "512", "--uvicorn-log-level", "warning", *extra]
    if api_key:
        cmd += ["--api-key", api_key]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=new_session)
    server = Server(proc, port, log, api_key)
    if wait:
        wait_ready(server)
    return server


def wait_ready(server: Server) -> Server:
    """Block until ``server`` answers /health (a launch(..., wait=False) server); stops it on failure."""
    proc = server.proc
    deadline = time.monotonic() + 300  # generous: a shared, busy CI box can be slow to import torch
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready after 300 s:\n{server.log_tail()}")
            time.sleep(0.2)
    except BaseException:
        server.stop()
        raise
