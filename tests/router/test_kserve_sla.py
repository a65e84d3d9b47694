"""SLA classes and API keys on the KServe fronts, as on /v1: an upstream KServe model's infer (HTTP and gRPC)
checks the caller's class (400 / INVALID_ARGUMENT for an unknown one, 403 / PERMISSION_DENIED above its key's),
counts every outcome in ``strata:router_*`` and its cost when the answer carries a token count; a local text
model's generate / infer answers a key asking above its class with 403 / PERMISSION_DENIED, as /v1 does."""
from __future__ import annotations

import re

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from router_servers import Proc, free_port, local_entry, write_config
from tritonclient.utils import InferenceServerException

ADMIN, BATCH_KEY = "admin-key", "batch-key"
PROMPT = "hello there"


@pytest.fixture(scope="module")
def sla_router(tiny, upstream, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kserve_sla")
    cfg = write_config(tmp / "router.yaml", {
        "models": [
            local_entry("local", tiny, max_model_len=256, max_num_seqs=4),
            {"name": "mlp", "upstream": "kserve", "url": upstream.url, "upstream_model": "onnx_mlp",
             "gpu_cost_per_hour": 2.0},
            # the upstream's own text model over KServe: an answer that can carry its token count
            {"name": "ks", "upstream": "kserve", "url": upstream.url, "upstream_model": "tiny",
             "gpu_cost_per_hour": 3600.0},
        ],
        "sla_classes": {"interactive": {"priority": 0, "ttft_ms": 30000}, "batch": {"priority": 10}},
        "default_sla": "interactive",
        "api_keys": [{"key": BATCH_KEY, "sla": "batch"}],
        "health_check_interval_s": 0.3,
    })
    srv = Proc(["--config", str(cfg), "--api-key", ADMIN], free_port(), tmp / "router.log", grpc_port=free_port(),
               headers={"Authorization": f"Bearer {ADMIN}"})
    srv.start()
    yield srv
    srv.stop()


def _h(key: str = ADMIN, sla: str | None = None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **({"x-sla-class": sla} if sla else {})}  # gRPC: lower case


def _counts(server: Proc, model: str) -> dict[tuple[str, str], float]:
    """strata:router_requests_total of ``model`` by (class, outcome)."""
    text = httpx.get(server.url + "/metrics", headers=_h()).text
    pat = re.compile(r'^strata:router_requests_total\{model_name="%s",outcome="(\w+)",sla_class="(\w+)"\} (\S+)$'
                     % re.escape(model), re.M)
    return {(c, o): float(v) for o, c, v in pat.findall(text)}


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _mlp_input(mod):
    x = mod.InferInput("INPUT0", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    return x


def _text_inputs(mod, count_tokens: bool = False) -> list:
    t = mod.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
    if not count_tokens:
        return [t]
    flag = mod.InferInput("return_num_output_tokens", [1], "BOOL")
    flag.set_data_from_numpy(np.array([True]))
    return [t, flag]


CASES = [  # (key, x-sla-class header, HTTP status, gRPC code); None: served
    (ADMIN, "batch", None, None),
    (BATCH_KEY, None, None, None),
    (BATCH_KEY, "interactive", 403, grpc.StatusCode.PERMISSION_DENIED),
    (ADMIN, "zzz", 400, grpc.StatusCode.INVALID_ARGUMENT),
]


@pytest.mark.parametrize("front", ["http", "grpc"])
def test_upstream_kserve_model_checks_the_class_and_counts(sla_router, front):
    mod = httpclient if front == "http" else grpcclient
    client = mod.InferenceServerClient(sla_router.http if front == "http" else sla_router.grpc)
    before = _counts(sla_router, "mlp")
    for key, sla, status, code in CASES:
        headers = _h(key, sla)
        if status is None:
            y = client.infer("mlp", [_mlp_input(mod)], headers=headers).as_numpy("OUTPUT0")
            assert y.shape[0] == 1
            continue
        with pytest.raises(InferenceServerException) as exc:
            client.infer("mlp", [_mlp_input(mod)], headers=headers)
        if front == "http":
            assert exc.value.status() == str(status), (headers, exc.value)
        else:
            assert exc.value.status() == str(code), (headers, exc.value)
        assert "x-sla-class" in exc.value.message() or "SLA class" in exc.value.message()
    bad = mod.InferInput("INPUT0", [1, 3], "FP32")  # the upstream's 400: a client error of its class
    bad.set_data_from_numpy(np.ones((1, 3), np.float32))
    with pytest.raises(InferenceServerException):
        client.infer("mlp", [bad], headers=_h(BATCH_KEY))
    client.close()
    # the refused classes never reach a series (as on /v1: the class is resolved before the model's route)
    assert _delta(before, _counts(sla_router, "mlp")) == {("batch", "ok"): 2.0, ("batch", "client_error"): 1.0}
    metrics = httpx.get(sla_router.url + "/metrics", headers=_h()).text
    assert re.search(r'strata:router_e2e_request_latency_seconds_count\{model_name="mlp",sla_class="batch"\} '
                     r'[1-9]', metrics)


def test_upstream_kserve_model_cost_from_its_token_count(sla_router):
    client = httpclient.InferenceServerClient(sla_router.http)
    res = client.infer("ks", _text_inputs(httpclient, count_tokens=True), headers=_h(BATCH_KEY),
                       parameters={"max_tokens": 4, "ignore_eos": True})
    assert int(res.as_numpy("num_output_tokens").sum()) == 4
    client.close()
    metrics = httpx.get(sla_router.url + "/metrics", headers=_h()).text
    assert 'strata:router_generation_tokens_total{model_name="ks",sla_class="batch"} 4.0' in metrics
    assert re.search(r'strata:router_cost_per_1k_output_tokens_count\{model_name="ks",sla_class="batch"\} 1\.0',
                     metrics), metrics


def test_local_text_model_key_above_its_class_is_403(sla_router):
    r = httpx.post(sla_router.url + "/v1/completions", headers=_h(BATCH_KEY, "interactive"),
                   json={"model": "local", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 403  # the reference
    for route in ("generate", "generate_stream"):
        r = httpx.post(sla_router.url + f"/v2/models/local/{route}", headers=_h(BATCH_KEY, "interactive"),
                       json={"text_input": PROMPT, "parameters": {"max_tokens": 2}}, timeout=60)
        assert r.status_code == 403 and "batch" in r.json()["error"], (route, r.text)
    r = httpx.post(sla_router.url + "/v2/models/local/generate", headers=_h(ADMIN, "zzz"),
                   json={"text_input": PROMPT, "parameters": {"max_tokens": 2}}, timeout=60)
    assert r.status_code == 400 and "zzz" in r.json()["error"]
    r = httpx.post(sla_router.url + "/v2/models/local/generate", headers=_h(BATCH_KEY),
                   json={"text_input": PROMPT, "parameters": {"max_tokens": 2}}, timeout=60)
    assert r.status_code == 200, r.text
    client = grpcclient.InferenceServerClient(sla_router.grpc)
    with pytest.raises(InferenceServerException) as exc:
        client.infer("local", _text_inputs(grpcclient), headers=_h(BATCH_KEY, "interactive"),
                     parameters={"max_tokens": 2})
    assert exc.value.status() == str(grpc.StatusCode.PERMISSION_DENIED)
    client.close()
    http = httpclient.InferenceServerClient(sla_router.http)
    with pytest.raises(InferenceServerException) as exc:
        http.infer("local", _text_inputs(httpclient), headers=_h(BATCH_KEY, "interactive"),
                   parameters={"max_tokens": 2})
    assert exc.value.status() == "403"
    http.close()
