"""A repository LLM reached indirectly, as an ensemble's step or through a BLS call of an in-process Python model
(``exec`` and ``async_exec``), gets what a direct call gets behind the router: the outer request's SLA class (403
above the key's), the key's tokens per minute (429 + Retry-After over HTTP, RESOURCE_EXHAUSTED with retry-after
metadata over gRPC; the same bucket as the key's direct calls), ``--limit-max-tokens`` (400 / INVALID_ARGUMENT
above it, an unset budget held to it) and the per-class metrics under the LLM's name. Errors name the model
called. Real `strata serve` processes and tritonclient; then the model server's batcher, which keeps one caller's
requests per Python model batch (so a batch's BLS calls are that caller's)."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from _model_repos import add_python_scale, write_config as write_model_config, write_python_model
from _tiny_models import make_tiny_checkpoint
from router_servers import Proc, free_port, write_config
from tritonclient.grpc import service_pb2 as tpb
from tritonclient.grpc import service_pb2_grpc as tpb_grpc
from tritonclient.utils import InferenceServerException

from strataserve.modelserver.server import ModelServer
from strataserve.types.tensors import KSERVE_CALLER, InferRequest, InferTensor

ADMIN, ENS_HTTP, ENS_GRPC, BLS, BLS_ASYNC, LIMITED = "admin", "ens-http", "ens-grpc", "bls", "bls-async", "limited"
TPM, LIMIT, MOST_CALLS = 40, 4, 25  # each call: its prompt + LIMIT tokens, so a key runs dry in a few calls
PROMPT, LLM = "hello there", "llm"
STEP = "ensemble 'ens' step 0 (model 'llm')"
ABOVE = f"max_tokens={LIMIT + 1} is above this server's limit of {LIMIT}"

BLS_MODEL = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    def _call(request):
        return pb_utils.InferenceRequest(model_name="llm", requested_output_names=["text_output", "num_output_tokens"],
            inputs=[pb_utils.get_input_tensor_by_name(request, "text_input")], parameters=request.parameters())


    def _answer(resp):
        if resp.has_error():  # passed on as it came: the outer request's error
            return pb_utils.InferenceResponse(error=resp.error())
        return pb_utils.InferenceResponse([pb_utils.Tensor("text_output",
            pb_utils.get_output_tensor_by_name(resp, "text_output").as_numpy()), pb_utils.Tensor("N",
            pb_utils.get_output_tensor_by_name(resp, "num_output_tokens").as_numpy())])


    class TritonPythonModel:
        %s
"""
SYNC = "def execute(self, requests):\n            return [_answer(_call(r).exec()) for r in requests]"
ASYNC = ("async def execute(self, requests):\n"
         "            return [_answer(await _call(r).async_exec()) for r in requests]")
TEXT_IO = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
    output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] },
             { name: "N" data_type: TYPE_UINT32 dims: [ 1 ] } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("indirect_llm_calls")
    repo = tmp / "repo"
    make_tiny_checkpoint("llama", repo / LLM)  # a bare HF folder: a repository LLM (its default budget: 16)
    write_model_config(repo / "ens", """
        platform: "ensemble"
        max_batch_size: 0
        input [ { name: "PROMPT" data_type: TYPE_STRING dims: [ 1 ] } ]
        output [ { name: "ANSWER" data_type: TYPE_STRING dims: [ 1 ] },
                 { name: "N" data_type: TYPE_UINT32 dims: [ 1 ] } ]
        ensemble_scheduling { step [
          { model_name: "llm" input_map { key: "text_input" value: "PROMPT" }
            output_map { key: "text_output" value: "ANSWER" } output_map { key: "num_output_tokens" value: "N" } }
        ] }
    """)
    (repo / "ens" / "1").mkdir()
    write_python_model(repo, "bls", BLS_MODEL % SYNC, TEXT_IO)
    write_python_model(repo, "bls_async", BLS_MODEL % ASYNC, TEXT_IO)
    cfg = write_config(tmp / "router.yaml", {
        "model_repository": str(repo),
        "sla_classes": {"interactive": {"priority": 0}, "batch": {"priority": 10}},
        "default_sla": "interactive",
        "api_keys": [{"key": k, "sla": "batch"} for k in (ENS_HTTP, ENS_GRPC, BLS, BLS_ASYNC, LIMITED)],
    })
    srv = Proc(["--config", str(cfg), "--api-key", ADMIN, "--tokens-per-minute", str(TPM), "--limit-max-tokens",
                str(LIMIT)], free_port(), tmp / "router.log", grpc_port=free_port(),
               headers={"Authorization": f"Bearer {ADMIN}"})
    srv.start()
    yield srv
    srv.stop()


def _h(key: str, sla: str | None = None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **({"x-sla-class": sla} if sla else {})}  # gRPC: lower case


def _counts(server: Proc) -> dict[tuple[str, str], float]:
    """strata:router_requests_total of the LLM by (class, outcome), and its generated tokens as ("tokens", class)."""
    text = httpx.get(server.url + "/metrics", headers=_h(ADMIN)).text
    pat = re.compile(r'^strata:router_requests_total\{model_name="%s",outcome="(\w+)",sla_class="(\w+)"\} (\S+)$'
                     % LLM, re.M)
    out = {(c, o): float(v) for o, c, v in pat.findall(text)}
    for c, v in re.findall(r'^strata:router_generation_tokens_total\{model_name="%s",sla_class="(\w+)"\} (\S+)$'
                           % LLM, text, re.M):
        out[("tokens", c)] = float(v)
    return out


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _inputs(mod, name: str) -> list:
    t = mod.InferInput(name, [1], "BYTES")
    t.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
    return [t]


def _infer_json(server: Proc, model: str, key: str, **params) -> httpx.Response:
    name = "PROMPT" if model == "ens" else "text_input"
    return httpx.post(f"{server.url}/v2/models/{model}/infer", headers=_h(key), timeout=120, json={
        "inputs": [{"name": name, "datatype": "BYTES", "shape": [1], "data": [PROMPT]}], "parameters": params})


def _until_refused(call) -> tuple[int, Exception]:
    """(calls served, the refusal) of calling ``call`` until it raises; each served one wrote LIMIT tokens (the
    step's unset budget, held to --limit-max-tokens)."""
    for served in range(MOST_CALLS):
        try:
            result = call()
        except InferenceServerException as exc:
            return served, exc
        assert int(result.as_numpy("N")[0]) == LIMIT
    raise AssertionError(f"{MOST_CALLS} calls of {TPM} tokens per minute were all served: the key is not charged")


def _refused_directly(server: Proc, key: str) -> None:
    """The key's own direct call to the LLM finds the bucket the indirect calls emptied."""
    r = httpx.post(f"{server.url}/v2/models/{LLM}/generate", headers=_h(key), timeout=120,
                   json={"text_input": PROMPT, "parameters": {"max_tokens": 1}})
    assert r.status_code == 429 and "tokens per minute" in r.json()["error"], r.text


def test_an_ensembles_llm_step_is_classed_and_charged_to_the_callers_key(server):
    http = httpclient.InferenceServerClient(server.http)
    try:
        with pytest.raises(InferenceServerException) as exc:  # above the key's class: the outer request's 403
            http.infer("ens", _inputs(httpclient, "PROMPT"), headers=_h(ENS_HTTP, "interactive"))
        assert exc.value.status() == "403" and STEP in exc.value.message()
        before = _counts(server)
        served, refusal = _until_refused(lambda: http.infer("ens", _inputs(httpclient, "PROMPT"), headers=_h(ENS_HTTP),
                                                            parameters={"ignore_eos": True}))
    finally:
        http.close()
    assert served >= 1 and refusal.status() == "429", refusal
    assert STEP in refusal.message() and f"{TPM} tokens per minute" in refusal.message()
    r = _infer_json(server, "ens", ENS_HTTP, ignore_eos=True)  # the HTTP answer carries Retry-After
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1 and STEP in r.json()["error"], r.text
    _refused_directly(server, ENS_HTTP)
    # counted as direct calls are: under the key's class and the LLM's name, with the tokens written
    assert _delta(before, _counts(server)) == {("batch", "ok"): served, ("batch", "rejected"): 3.0,
                                               ("tokens", "batch"): served * LIMIT}


def test_an_ensembles_llm_step_is_charged_over_grpc(server):
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        served, refusal = _until_refused(lambda: client.infer("ens", _inputs(grpcclient, "PROMPT"),
                                                              headers=_h(ENS_GRPC), parameters={"ignore_eos": True}))
    finally:
        client.close()
    assert served >= 1 and refusal.status() == str(grpc.StatusCode.RESOURCE_EXHAUSTED), refusal
    assert STEP in refusal.message()
    with grpc.insecure_channel(server.grpc) as channel:  # the retry-after metadata, as the direct call sends it
        req = tpb.ModelInferRequest(model_name="ens")
        req.inputs.add(name="PROMPT", datatype="BYTES", shape=[1]).contents.bytes_contents.append(PROMPT.encode())
        with pytest.raises(grpc.RpcError) as exc:
            tpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, metadata=tuple(_h(ENS_GRPC).items()),
                                                                  timeout=60)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and STEP in exc.value.details()
    assert int(dict(exc.value.trailing_metadata())["retry-after"]) >= 1
    _refused_directly(server, ENS_GRPC)


def test_limit_max_tokens_holds_the_ensembles_llm_step(server):
    http = httpclient.InferenceServerClient(server.http)
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        with pytest.raises(InferenceServerException) as exc:
            http.infer("ens", _inputs(httpclient, "PROMPT"), headers=_h(LIMITED), parameters={"max_tokens": LIMIT + 1})
        assert exc.value.status() == "400" and ABOVE in exc.value.message() and STEP in exc.value.message()
        with pytest.raises(InferenceServerException) as exc:
            client.infer("ens", _inputs(grpcclient, "PROMPT"), headers=_h(LIMITED),
                         parameters={"max_tokens": LIMIT + 1})
        assert exc.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT) and ABOVE in exc.value.message()
        for params, written in (({}, LIMIT), ({"max_tokens": 2}, 2)):  # unset: its default 16, held to the limit
            res = http.infer("ens", _inputs(httpclient, "PROMPT"), headers=_h(LIMITED),
                             parameters={"ignore_eos": True, **params})
            assert int(res.as_numpy("N")[0]) == written, params
    finally:
        http.close()
        client.close()
    r = _infer_json(server, "ens", LIMITED, max_tokens=None, ignore_eos=True)  # null: the rest of the context, held
    assert r.status_code == 200, r.text
    assert {o["name"]: o["data"] for o in r.json()["outputs"]}["N"] == [LIMIT]


@pytest.mark.parametrize("model,key", [("bls", BLS), ("bls_async", BLS_ASYNC)])
def test_an_in_process_bls_call_is_charged_to_the_callers_key(server, model, key):
    http = httpclient.InferenceServerClient(server.http)
    try:
        before = _counts(server)
        served, refusal = _until_refused(lambda: http.infer(model, _inputs(httpclient, "text_input"), headers=_h(key),
                                                            parameters={"ignore_eos": True}))
        with pytest.raises(InferenceServerException) as exc:  # --limit-max-tokens, named by the model's error
            http.infer(model, _inputs(httpclient, "text_input"), headers=_h(key), parameters={"max_tokens": LIMIT + 1})
        assert exc.value.status() == "400" and ABOVE in exc.value.message()
    finally:
        http.close()
    assert served >= 1 and refusal.status() == "429", refusal
    assert f"model '{model}': BLS call to model 'llm'" in refusal.message() and "tokens per minute" in refusal.message()
    r = _infer_json(server, model, key, ignore_eos=True)  # the refusal passed on as it came keeps its Retry-After
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
    _refused_directly(server, key)
    assert _delta(before, _counts(server))[("batch", "ok")] == served


# ------------------------------------------------------------------ the batcher keeps callers apart
def test_a_python_models_batch_holds_one_callers_requests(tmp_path: Path):
    """Four requests queued together, two callers: a Python model (whose BLS calls are its batch's caller's) gets
    two batches of two, each executed with its caller bound; the rows it saw tell."""
    add_python_scale(tmp_path, max_queue_delay_us=500_000, preferred=(4,))

    async def call(caller: tuple[str | None, str | None]) -> int:
        KSERVE_CALLER.set(caller)  # as the KServe fronts set it per call (this task's own context)
        req = InferRequest("py_scale", inputs=[InferTensor("IN", "FP32", [1, 3], np.ones((1, 3), np.float32))])
        resp = await server.infer(req)
        return int(next(t for t in resp.outputs if t.name == "BATCH").data[0, 0])

    async def main() -> list[int]:
        await server.start()
        try:
            callers = [(None, "Bearer a"), (None, "Bearer b")] * 2
            return await asyncio.wait_for(asyncio.gather(*(call(c) for c in callers)), 60)
        finally:
            await server.stop()

    server = ModelServer(tmp_path)
    assert asyncio.run(main()) == [2, 2, 2, 2]
