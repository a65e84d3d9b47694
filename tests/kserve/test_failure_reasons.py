"""`strata:inference_request_failure` counts each failed request under Triton's reason (the `reason` label of
nv_inference_request_failure): a client that hangs up or times out is CANCELED, a model that raises is BACKEND,
a request refused before it ran (queue full, timed out in the queue, bad input) is REJECTED. Each failure moves
its own reason's counter and no other; the statistics extension's `fail` count stays the total. Through a real
`strata serve`, /metrics scraped over HTTP."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from _kserve_launch import kserve_server
from _model_repos import write_python_model
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
MODEL = "py_fail"

# sleeps SLEEP_MS, or raises when it is negative
PY_FAIL = """
    import time
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                ms = float(pb_utils.get_input_tensor_by_name(request, "SLEEP_MS").as_numpy().reshape(-1)[0])
                if ms < 0:
                    raise RuntimeError("asked to fail")
                time.sleep(ms / 1000)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([[ms]], np.float32))]))
            return responses
"""

# one instance, one request per execution, room for one queued request; a request may shorten its queue timeout
CONFIG = f"""
    name: "{MODEL}"
    backend: "python"
    max_batch_size: 1
    input [ {{ name: "SLEEP_MS" data_type: TYPE_FP32 dims: [ 1 ] }} ]
    output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
    instance_group [ {{ count: 1 kind: KIND_CPU }} ]
    dynamic_batching {{ default_queue_policy {{ max_queue_size: 1 allow_timeout_override: true }} }}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("failure_reasons")
    write_python_model(tmp / "repo", MODEL, PY_FAIL, CONFIG)
    with kserve_server(tmp / "repo", tmp / "server.log") as launched:
        yield launched


def _samples(base: str) -> dict[tuple[str, str], float]:
    """(metric, reason or "") -> value, for the model's version 1, from a real scrape of /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model") == MODEL and s.labels.get("version") == "1":
                out[(s.name, s.labels.get("reason", ""))] = s.value
    return out


def _failures(base: str) -> dict[str, float]:
    samples = _samples(base)
    return {r: samples[("strata:inference_request_failure", r)] for r in REASONS}


def _gauge(base: str, name: str) -> float:
    return _samples(base)[(name, "")]


def _wait(what, until, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = what()
        if until(value):
            return value
        assert time.monotonic() < deadline, f"gave up waiting; last value {value}"
        time.sleep(0.02)


def _body(ms: float, **parameters) -> dict:
    body = {"inputs": [{"name": "SLEEP_MS", "datatype": "FP32", "shape": [1, 1], "data": [ms]}]}
    if parameters:
        body["parameters"] = parameters
    return body


def _post(base: str, body: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{base}/v2/models/{MODEL}/infer", json=body, timeout=timeout)


def _plus(before: dict[str, float], reason: str, n: int = 1) -> dict[str, float]:
    return {r: before[r] + (n if r == reason else 0) for r in REASONS}


def _in_background(fn) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_each_failure_counts_under_its_own_reason(server):
    base = server.base
    start = _failures(base)
    assert start == dict.fromkeys(REASONS, 0.0)  # every reason has its series from the first scrape

    # BACKEND: the model's execute() raises
    r = _post(base, _body(-1))
    assert r.status_code == 500 and "asked to fail" in r.text, r.text
    after_backend = _failures(base)
    assert after_backend == _plus(start, "BACKEND")

    # CANCELED: an HTTP client that gives up (its connection closes) while the model runs its request
    execs = _gauge(base, "strata:inference_exec_count")
    with pytest.raises(httpx.ReadTimeout):
        _post(base, _body(1500), timeout=0.5)
    after_http_cancel = _wait(lambda: _failures(base), lambda f: f != after_backend)
    assert after_http_cancel == _plus(after_backend, "CANCELED")
    _wait(lambda: _gauge(base, "strata:inference_exec_count"), lambda n: n == execs + 1)  # the model is idle again

    # CANCELED: a gRPC client's deadline passes
    client = grpcclient.InferenceServerClient(server.grpc)
    x = grpcclient.InferInput("SLEEP_MS", [1, 1], "FP32")
    x.set_data_from_numpy(np.array([[1500]], np.float32))
    with pytest.raises(InferenceServerException, match="(?i)deadline"):
        client.infer(MODEL, [x], client_timeout=0.5)
    after_grpc_cancel = _wait(lambda: _failures(base), lambda f: f != after_http_cancel)
    assert after_grpc_cancel == _plus(after_http_cancel, "CANCELED")
    _wait(lambda: _gauge(base, "strata:inference_exec_count"), lambda n: n == execs + 2)
    client.close()

    # REJECTED: while the only instance is busy, one request waits in the queue (max_queue_size 1) with a 1 s
    # timeout, the next finds the queue full; then the waiting one times out in the queue
    blocker, blocker_out = _in_background(lambda: _post(base, _body(3000)))
    _wait(lambda: _gauge(base, "strata:inference_pending_request_count"), lambda n: n == 1)
    time.sleep(0.3)  # the worker has taken it off the queue: it runs now
    queued, queued_out = _in_background(lambda: _post(base, _body(0, timeout=1_000_000)))
    _wait(lambda: _gauge(base, "strata:inference_pending_request_count"), lambda n: n == 2)
    full = _post(base, _body(0))
    assert full.status_code == 503 and "queue full" in full.text, full.text
    after_full = _failures(base)
    assert after_full == _plus(after_grpc_cancel, "REJECTED")
    queued.join(30)
    assert queued_out[0].status_code == 504 and "timed out" in queued_out[0].text, queued_out[0].text
    after_timeout = _failures(base)
    assert after_timeout == _plus(after_full, "REJECTED")
    blocker.join(30)
    assert blocker_out[0].status_code == 200, blocker_out[0].text

    # REJECTED: bad input, refused before it is queued
    bad = _post(base, {"inputs": [{"name": "SLEEP_MS", "datatype": "FP32", "shape": [1, 2], "data": [0, 0]}]})
    assert bad.status_code == 400, bad.text
    end = _failures(base)
    assert end == _plus(after_timeout, "REJECTED")

    # the statistics extension: `fail` is the total of every reason (Triton's), the successes are apart
    stats = httpx.get(f"{base}/v2/models/{MODEL}/versions/1/stats", timeout=10).json()["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] == sum(end.values()) == 6
    assert stats["inference_stats"]["success"]["count"] == 1  # the blocker
    assert end == {"REJECTED": 3, "CANCELED": 2, "BACKEND": 1, "OTHER": 0}
