"""A repository LLM (a bare HF folder) called through the router's KServe fronts gets what every other LLM path
gets: the key's SLA class (403 / PERMISSION_DENIED above it, 400 for an unknown one) on generate,
generate_stream, HTTP infer, gRPC infer and ModelStreamInfer; the class's TTFT admission (429 + Retry-After);
the key's tokens per minute, charged prompt + max_tokens at admission (429 + Retry-After over HTTP, and
RESOURCE_EXHAUSTED with retry-after metadata over gRPC); and the per-class metrics under the model's name."""
from __future__ import annotations

import asyncio
import queue
import re

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from _tiny_models import make_tiny_checkpoint
from router_servers import Proc, free_port, write_config
from tritonclient.grpc import service_pb2 as tpb
from tritonclient.grpc import service_pb2_grpc as tpb_grpc
from tritonclient.utils import InferenceServerException

ADMIN, BATCH, TTFT_KEY, TPM_HTTP, TPM_GRPC = "admin-key", "batch-key", "ttft-key", "tpm-http", "tpm-grpc"
TPM = 400  # tokens per minute of every key
PROMPT, MODEL = "hello there", "bare"


@pytest.fixture(scope="module")
def server(upstream, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kserve_repo_llm_sla")
    make_tiny_checkpoint("llama", tmp / "repo" / MODEL)
    cfg = write_config(tmp / "router.yaml", {
        # a KServe upstream makes the config serve a model besides the repository's
        "models": [{"name": "mlp", "upstream": "kserve", "url": upstream.url, "upstream_model": "onnx_mlp"}],
        "model_repository": str(tmp / "repo"),
        "sla_classes": {"interactive": {"priority": 0, "ttft_ms": 30000}, "strict": {"priority": 5, "ttft_ms": 1},
                        "batch": {"priority": 10}},
        "default_sla": "interactive",
        "api_keys": [{"key": BATCH, "sla": "batch"}, {"key": TTFT_KEY, "sla": "interactive"},
                     {"key": TPM_HTTP, "sla": "batch"}, {"key": TPM_GRPC, "sla": "batch"}],
    })
    srv = Proc(["--config", str(cfg), "--api-key", ADMIN, "--tokens-per-minute", str(TPM)], free_port(),
               tmp / "router.log", grpc_port=free_port(), headers={"Authorization": f"Bearer {ADMIN}"})
    srv.start()
    yield srv
    srv.stop()


def _h(key: str = ADMIN, sla: str | None = None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **({"x-sla-class": sla} if sla else {})}  # gRPC: lower case


def _metrics(server: Proc) -> str:
    return httpx.get(server.url + "/metrics", headers=_h()).text


def _counts(server: Proc) -> dict[tuple[str, str], float]:
    """strata:router_requests_total of the repository LLM by (class, outcome)."""
    pat = re.compile(r'^strata:router_requests_total\{model_name="%s",outcome="(\w+)",sla_class="(\w+)"\} (\S+)$'
                     % MODEL, re.M)
    return {(c, o): float(v) for o, c, v in pat.findall(_metrics(server))}


def _series(server: Proc, name: str, sla: str) -> float:
    m = re.search(r'^%s\{model_name="%s",sla_class="%s"\} (\S+)$' % (re.escape(name), MODEL, sla),
                  _metrics(server), re.M)
    return float(m.group(1)) if m else 0.0


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _generate(server: Proc, key: str, sla: str | None = None, stream: bool = False, **params) -> httpx.Response:
    path = f"/v2/models/{MODEL}/generate" + ("_stream" if stream else "")
    return httpx.post(server.url + path, headers=_h(key, sla), timeout=120,
                      json={"text_input": PROMPT, "parameters": {"ignore_eos": True, **params}})


def _inputs(mod) -> list:
    t = mod.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
    return [t]


def _grpc_stream(server: Proc, key: str, sla: str | None, max_tokens: int) -> tuple[str, str | None]:
    """(text, error message) of one ModelStreamInfer request."""
    client = grpcclient.InferenceServerClient(server.grpc)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)), headers=_h(key, sla))
    client.async_stream_infer(MODEL, _inputs(grpcclient), parameters={"max_tokens": max_tokens, "ignore_eos": True},
                              enable_empty_final_response=True)
    text, error = "", None
    while True:
        result, err = got.get(timeout=60)
        if err is not None:
            error = err.message()
            break
        out = result.as_numpy("text_output")
        text += out[0].decode() if out is not None else ""
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return text, error


def _stats(server: Proc) -> tuple[int, int]:
    """(success, fail) counts of the model's statistics (the KServe statistics extension)."""
    inference = httpx.get(f"{server.url}/v2/models/{MODEL}/stats", headers=_h()).json()["model_stats"][0]
    return inference["inference_stats"]["success"]["count"], inference["inference_stats"]["fail"]["count"]


def test_repository_llm_checks_the_class_and_counts_per_class(server):
    before, tokens_before = _counts(server), _series(server, "strata:router_generation_tokens_total", "batch")
    stats_before = _stats(server)
    ttft_before = _series(server, "strata:router_time_to_first_token_seconds_count", "batch")
    for stream in (False, True):  # a key above its class, and an unknown class
        r = _generate(server, BATCH, "interactive", stream, max_tokens=2)
        assert r.status_code == 403 and "batch" in r.json()["error"], (stream, r.text)
        r = _generate(server, ADMIN, "zzz", stream, max_tokens=2)
        assert r.status_code == 400 and "zzz" in r.json()["error"], (stream, r.text)
    http = httpclient.InferenceServerClient(server.http)
    with pytest.raises(InferenceServerException) as exc:
        http.infer(MODEL, _inputs(httpclient), headers=_h(BATCH, "interactive"), parameters={"max_tokens": 2})
    assert exc.value.status() == "403"
    g = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as exc:
        g.infer(MODEL, _inputs(grpcclient), headers=_h(BATCH, "interactive"), parameters={"max_tokens": 2})
    assert exc.value.status() == str(grpc.StatusCode.PERMISSION_DENIED)
    _, error = _grpc_stream(server, BATCH, "interactive", 2)
    assert error is not None and "batch" in error
    # the key's own class is served on every route, and counted under it
    assert _generate(server, BATCH, None, max_tokens=3).status_code == 200
    r = _generate(server, BATCH, None, True, max_tokens=3)
    assert r.status_code == 200 and r.text.startswith("data: "), r.text
    res = http.infer(MODEL, _inputs(httpclient), headers=_h(BATCH), parameters={"max_tokens": 3, "ignore_eos": True})
    assert res.as_numpy("text_output") is not None
    res = g.infer(MODEL, _inputs(grpcclient), headers=_h(BATCH), parameters={"max_tokens": 3, "ignore_eos": True})
    assert res.as_numpy("text_output") is not None
    http.close()
    g.close()
    text, error = _grpc_stream(server, BATCH, None, 3)
    assert error is None and text
    # refused classes reach no series (as on /v1: the class is resolved first); the served ones count as batch
    assert _delta(before, _counts(server)) == {("batch", "ok"): 5.0}
    assert _series(server, "strata:router_generation_tokens_total", "batch") - tokens_before == 15
    assert _series(server, "strata:router_time_to_first_token_seconds_count", "batch") - ttft_before == 5
    success, fail = _stats(server)  # the version's own statistics still count every call
    assert (success - stats_before[0], fail - stats_before[1]) == (5, 7)


def test_repository_llm_refuses_an_unreachable_ttft(server):
    """Class `strict` wants 1 ms: once the router has learnt the engine's pace, a strict call with strict work
    queued ahead of it is answered 429 + Retry-After at once, and the others are served."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            url = f"{server.url}/v2/models/{MODEL}/generate"
            for _ in range(5):  # samples for the estimator
                r = await client.post(url, headers=_h(TTFT_KEY), json={"text_input": PROMPT, "max_tokens": 2})
                assert r.status_code == 200, r.text
            body = {"text_input": "a long story " * 4, "max_tokens": 2, "ignore_eos": True}
            return await asyncio.gather(*(client.post(url, json=body, headers=_h(TTFT_KEY, "strict"))
                                          for _ in range(6)))

    before = _counts(server)
    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert 200 in codes and 429 in codes, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert "time to first token" in refused.json()["error"]
    assert _delta(before, _counts(server))[("strict", "rejected")] == codes.count(429)


def test_repository_llm_charges_tokens_per_minute_over_http(server):
    before = _counts(server)
    r = _generate(server, TPM_HTTP, max_tokens=TPM - 60)  # prompt + max_tokens: most of the minute's tokens
    assert r.status_code == 200, r.text
    r = _generate(server, TPM_HTTP, max_tokens=300)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
    assert f"{TPM} tokens per minute" in r.json()["error"]
    http = httpclient.InferenceServerClient(server.http)
    with pytest.raises(InferenceServerException) as exc:
        http.infer(MODEL, _inputs(httpclient), headers=_h(TPM_HTTP), parameters={"max_tokens": 300})
    assert exc.value.status() == "429" and "tokens per minute" in exc.value.message()
    http.close()
    r = _generate(server, TPM_HTTP, max_tokens=5000)  # clipped to the context, still over a minute's tokens
    assert r.status_code == 400 and "tokens per minute" in r.json()["error"], r.text
    assert _delta(before, _counts(server)) == {("batch", "ok"): 1.0, ("batch", "rejected"): 2.0,
                                               ("batch", "client_error"): 1.0}
    m = re.search(r'^strata:rate_limited_requests_total\{kind="tokens_per_minute",sla_class="batch"\} (\S+)$',
                  _metrics(server), re.M)
    assert m and float(m.group(1)) >= 2


def test_repository_llm_charges_tokens_per_minute_over_grpc(server):
    g = grpcclient.InferenceServerClient(server.grpc)
    res = g.infer(MODEL, _inputs(grpcclient), headers=_h(TPM_GRPC),
                  parameters={"max_tokens": TPM - 60, "ignore_eos": True})
    assert res.as_numpy("text_output") is not None
    g.close()
    with grpc.insecure_channel(server.grpc) as channel:
        req = tpb.ModelInferRequest(model_name=MODEL)
        req.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(PROMPT.encode())
        req.parameters["max_tokens"].int64_param = 300
        with pytest.raises(grpc.RpcError) as exc:
            tpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, metadata=tuple(_h(TPM_GRPC).items()),
                                                                  timeout=60)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokens per minute" in exc.value.details()
    assert int(dict(exc.value.trailing_metadata())["retry-after"]) >= 1
    _, error = _grpc_stream(server, TPM_GRPC, None, 300)  # a stream's request: refused in the stream
    assert error is not None and "tokens per minute" in error
