"""Strict readiness, as Triton's --strict-readiness (on by default): /v2/health/ready and gRPC ServerReady say
ready only while every repository model that should be loaded is READY. A model that failed to load keeps the
server not ready (liveness, the other models' readiness and the OpenAI /health are untouched); unloading it
through the repository API makes the server ready, loading it again (and failing) not ready again. With
--no-strict-readiness the server is ready once started, as before. Real `strata serve` processes, httpx and
tritonclient.grpc."""

from __future__ import annotations

import httpx
import pytest
import tritonclient.grpc as grpcclient
from _kserve_launch import kserve_server
from _model_repos import add_python_text


def _repo(path):
    add_python_text(path)  # loads
    (path / "broken" / "1").mkdir(parents=True)  # no model.onnx: its load fails
    (path / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "onnxruntime"\nmax_batch_size: 2\n')
    return path


def _ready(server) -> tuple[int, dict, bool]:
    r = httpx.get(f"{server.base}/v2/health/ready", timeout=10)
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        return r.status_code, r.json(), client.is_server_ready()
    finally:
        client.close()


def _control(server, name: str, action: str) -> httpx.Response:
    return httpx.post(f"{server.base}/v2/repository/models/{name}/{action}", json={}, timeout=60)


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("strict")
    with kserve_server(_repo(tmp / "repo"), tmp / "server.log", "--model-control-mode", "explicit",
                       "--load-model", "*") as server:
        yield server


def test_a_model_that_failed_to_load_makes_the_server_not_ready(strict):
    index = httpx.post(f"{strict.base}/v2/repository/index", json={}, timeout=10).json()
    assert {(m["name"], m["state"]) for m in index} >= {("broken", "UNAVAILABLE"), ("py_text", "READY")}
    assert _ready(strict) == (503, {"ready": False}, False)
    # only readiness follows the models: the server is live, the good model is ready, /health is as it was
    assert httpx.get(f"{strict.base}/v2/health/live", timeout=10).status_code == 200
    client = grpcclient.InferenceServerClient(strict.grpc)
    assert client.is_server_live() and client.is_model_ready("py_text") and not client.is_model_ready("broken")
    client.close()
    assert httpx.get(f"{strict.base}/v2/models/py_text/ready", timeout=10).status_code == 200
    assert httpx.get(f"{strict.base}/health", timeout=10).status_code == 200

    # a model unloaded on request does not count (Triton's rule) ...
    assert _control(strict, "broken", "unload").status_code == 200
    assert _ready(strict) == (200, {"ready": True}, True)
    # ... one asked to load again, which fails again, does
    failed = _control(strict, "broken", "load")
    assert failed.status_code >= 400 and "broken" in failed.text, failed.text
    assert _ready(strict) == (503, {"ready": False}, False)
    # unloading a model that loaded keeps it out too
    assert _control(strict, "broken", "unload").status_code == 200
    assert _control(strict, "py_text", "unload").status_code == 200
    assert _ready(strict) == (200, {"ready": True}, True)


def test_without_strict_readiness_the_server_is_ready_once_started(tmp_path):
    with kserve_server(_repo(tmp_path / "repo"), tmp_path / "server.log", "--no-strict-readiness") as server:
        index = httpx.post(f"{server.base}/v2/repository/index", json={}, timeout=10).json()
        assert ("broken", "UNAVAILABLE") in {(m["name"], m["state"]) for m in index}
        assert _ready(server) == (200, {"ready": True}, True)
