"""Self-healing and graceful drain on a real `strata serve` (tiny Llama + a repository with an isolated Python
model): SIGKILL the engine core mid-stream and the isolated model's process mid-request; only the requests in
flight fail, /health reports degraded meanwhile, both are restarted without restarting the server, the restart
counters move; then SIGTERM drains: admitted requests finish, new ones get 503 + Retry-After, /health 503."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from _model_repos import write_python_model
from api_server import MODEL, launch
from test_lifecycle import _children

# X >= 100: sleeps X ms first; the answer is [pid, X + 1].
SLEEPY = """
    import os
    import time
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = int(pb_utils.get_input_tensor_by_name(r, "X").as_numpy()[0])
                if x >= 100:
                    time.sleep(x / 1000)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([os.getpid(), x + 1], np.int64))]))
            return out
"""
CONFIG = """backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT64 dims: [1] } ]
output [ { name: "Y" data_type: TYPE_INT64 dims: [2] } ]
parameters { key: "EXECUTION_ISOLATION" value: { string_value: "process" } }
"""


def _infer(url: str, x: int) -> httpx.Response:
    body = {"inputs": [{"name": "X", "datatype": "INT64", "shape": [1], "data": [x]}]}
    return httpx.post(f"{url}/v2/models/iso/infer", json=body, timeout=30)


def _y(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["outputs"][0]["data"]


def _metric(url: str, name: str, label: str) -> float | None:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _engine_pid(srv) -> int:
    """The server's spawned child that is not the isolated model's process (which answers with its pid)."""
    model = _y(_infer(srv.url, 1))[0]
    kids = []
    for kid in _children(srv.proc.pid):
        try:
            if kid != model and b"spawn_main" in Path(f"/proc/{kid}/cmdline").read_bytes():  # a zombie has none
                kids.append(kid)
        except OSError:
            continue
    assert len(kids) == 1, kids
    return kids[0]


def _wait_health(srv, status: int) -> None:
    deadline = time.monotonic() + 120
    while httpx.get(f"{srv.url}/health").status_code != status:
        assert time.monotonic() < deadline, srv.log_tail()
        assert srv.proc.poll() is None
        time.sleep(0.1)


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    return t, out


def test_engine_and_isolated_model_heal_then_sigterm_drains(tiny_ckpt, tmp_path):
    repo = tmp_path / "repo"
    write_python_model(repo, "iso", SLEEPY, CONFIG)
    srv = launch(tiny_ckpt, tmp_path / "server.log", "--model-repository", str(repo), "--grpc-port", "0",
                 "--shutdown-timeout", "60", api_key=None)
    url = srv.url
    greedy = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    try:
        before = httpx.post(f"{url}/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]
        # 1. The engine core dies mid-stream.
        engine = _engine_pid(srv)
        long = {**greedy, "max_tokens": 480, "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json=long) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            os.kill(engine, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and "engine_dead" in rest[-2] and "killed by SIGKILL" in rest[-2]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "degraded" and health.json()["models"][MODEL] in ("dead", "restarting")
        unavailable = f'model_name="{MODEL}",outcome="unavailable"'
        seen = _metric(url, "strata:router_requests_total", unavailable) or 0.0
        refused = httpx.post(f"{url}/v1/completions", json=greedy, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert _metric(url, "strata:router_requests_total", unavailable) == seen + 1  # outages show in the counts
        assert _y(_infer(url, 7))[1] == 8  # the repository model keeps serving meanwhile
        # KServe's probes agree with /health: the server is not ready while one of its models is not
        assert httpx.get(f"{url}/v2/health/ready").status_code == 503
        assert httpx.get(f"{url}/v2/models/{MODEL}/ready").status_code == 400
        assert httpx.get(f"{url}/v2/models/iso/ready").status_code == 200
        queries = _metric(url, "strata:prefix_cache_queries_total", f'model_name="{MODEL}"')
        _wait_health(srv, 200)
        assert _engine_pid(srv) != engine
        assert httpx.get(f"{url}/v2/health/ready").status_code == 200
        assert httpx.get(f"{url}/v2/models/{MODEL}/ready").json() == {"name": MODEL, "ready": True}
        # the new engine's pool shows before its first request; the old engine's counts stay counted
        assert _metric(url, "strata:kv_cache_total_blocks", f'model_name="{MODEL}"') > 0
        assert _metric(url, "strata:prefix_cache_queries_total", f'model_name="{MODEL}"') == queries > 0
        after = httpx.post(f"{url}/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]
        assert after == before  # same weights, greedy: the restarted engine answers as the first did
        assert _metric(url, "strata:engine_restarts_total", f'model_name="{MODEL}"') == 1.0
        # An idle engine's death is noticed too (no request is there to see it), and healed again.
        os.kill(_engine_pid(srv), signal.SIGKILL)
        _wait_health(srv, 503)
        _wait_health(srv, 200)
        assert httpx.post(f"{url}/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"] == before
        assert _metric(url, "strata:engine_restarts_total", f'model_name="{MODEL}"') == 2.0

        # 2. The isolated Python model's process dies with a request inside it.
        pid = _y(_infer(url, 1))[0]
        t, slow = _in_thread(lambda: _infer(url, 1500))
        time.sleep(0.6)
        os.kill(pid, signal.SIGKILL)
        t.join(30)
        failed = slow["r"]
        assert failed.status_code == 503 and "model 'iso'" in failed.json()["error"], failed.text
        new_pid, y = _y(_infer(url, 41))  # waits for the new process (benchmarks/restart_bench.py: how long)
        assert new_pid != pid and y == 42
        assert _metric(url, "strata:model_restarts", 'model="iso"') == 1.0

        # 3. SIGTERM with requests in flight: they finish; new ones are refused; then the server exits.
        t_kserve, kserve = _in_thread(lambda: _infer(url, 3000))
        stream_lines: list[str] = []

        def stream() -> None:
            with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions",
                                                                   json={**long, "max_tokens": 200}) as r:
                stream_lines.extend(line for line in r.iter_lines() if line.startswith("data:"))

        t_stream = threading.Thread(target=stream)
        t_stream.start()
        time.sleep(0.5)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
        new = httpx.post(f"{url}/v1/completions", json=greedy, timeout=30)
        assert new.status_code == 503 and new.headers["retry-after"] and new.json()["error"]["code"] == "draining"
        assert _infer(url, 5).status_code == 503
        t_kserve.join(30)
        t_stream.join(60)
        assert _y(kserve["r"])[1] == 3001
        assert stream_lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(stream_lines[-3:])
        assert not any('"error"' in line for line in stream_lines)
        assert srv.proc.wait(timeout=60) == 0, srv.log_tail()
    finally:
        srv.stop()
