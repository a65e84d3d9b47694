"""--limit-max-tokens on the KServe calls that used to escape it: a repository LLM's (generate, HTTP infer, gRPC
infer) and a text_input call forwarded to an upstream KServe LLM, held as /v1 holds its requests: an explicit
max_tokens above the limit is a 400 with a KServe error body (gRPC INVALID_ARGUMENT) naming it; an unset one is
the model's default held to the limit (the repository's checkpoint default, the upstream's 16); a null one (the
rest of the context) is the limit. Real `strata serve` processes (a router in front of the package's upstream),
tritonclient and httpx; then ``hold_to_limit`` on request objects, for where it writes the budget."""
from __future__ import annotations

import json

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from _tiny_models import make_tiny_checkpoint
from router_servers import Proc, free_port, write_config
from tritonclient.utils import InferenceServerException

from strataserve.api.errors import APIError
from strataserve.api.limits import RequestLimits
from strataserve.router.kserve_calls import hold_to_limit, tensor_call_tokens
from strataserve.types.tensors import InferRequest, InferTensor

LIMIT, PROMPT = 5, "hello there"  # below vLLM's default of 16, so an unset budget is held too
ABOVE = f"max_tokens={LIMIT + 1} is above this server's limit of {LIMIT}"
# every output token counted, none cut short by the random model's eos
COUNT = {"ignore_eos": True, "return_num_output_tokens": True}


@pytest.fixture(scope="module")
def server(upstream, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kserve_limit_max_tokens")
    make_tiny_checkpoint("llama", tmp / "repo" / "bare")  # a bare HF folder: a repository LLM (default 16)
    make_tiny_checkpoint("llama", tmp / "repo" / "gc")
    (tmp / "repo" / "gc" / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    cfg = write_config(tmp / "router.yaml", {
        # the upstream's command-line LLM (no limit of its own there), over KServe
        "models": [{"name": "ks", "upstream": "kserve", "url": upstream.url, "upstream_model": "tiny"}],
        "model_repository": str(tmp / "repo"),
    })
    srv = Proc(["--config", str(cfg), "--limit-max-tokens", str(LIMIT)], free_port(), tmp / "router.log",
               grpc_port=free_port())
    srv.start()
    yield srv
    srv.stop()


def _generate(server: Proc, model: str, params: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/models/{model}/generate", timeout=120,
                      json={"text_input": PROMPT, "parameters": params})


def _infer_json(server: Proc, model: str, params: dict, sampling: str | None = None) -> httpx.Response:
    inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]}]
    if sampling is not None:
        inputs.append({"name": "sampling_parameters", "datatype": "BYTES", "shape": [1], "data": [sampling]})
    return httpx.post(f"{server.url}/v2/models/{model}/infer", timeout=120,
                      json={"inputs": inputs, "parameters": params})


def _written(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    out = {o["name"]: o["data"] for o in r.json()["outputs"]}
    return int(out["num_output_tokens"][0])


def _inputs(mod) -> list:
    t = mod.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
    return [t]


def test_repository_llm_is_held_to_the_limit(server):
    r = _generate(server, "bare", {"max_tokens": LIMIT + 1})
    assert r.status_code == 400 and ABOVE in r.json()["error"], r.text
    r = _generate(server, "bare", {**COUNT})  # unset: its default 16, held to the limit
    assert r.status_code == 200 and r.json()["num_output_tokens"] == LIMIT, r.text
    r = _generate(server, "bare", {**COUNT, "max_tokens": None})  # null: the rest of the context, held too
    assert r.status_code == 200 and r.json()["num_output_tokens"] == LIMIT, r.text
    r = _generate(server, "bare", {**COUNT, "max_tokens": 3})  # within the limit: as asked
    assert r.status_code == 200 and r.json()["num_output_tokens"] == 3, r.text
    r = _generate(server, "gc", {**COUNT})  # a checkpoint default below the limit stays
    assert r.status_code == 200 and r.json()["num_output_tokens"] == 3, r.text
    r = _infer_json(server, "bare", {}, json.dumps({"max_tokens": LIMIT + 1}))  # vLLM-backend tensors
    assert r.status_code == 400 and ABOVE in r.json()["error"], r.text
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        with pytest.raises(InferenceServerException) as exc:
            client.infer("bare", _inputs(grpcclient), parameters={"max_tokens": LIMIT + 1})
        assert exc.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT) and ABOVE in exc.value.message()
    finally:
        client.close()


def test_upstream_text_input_call_is_held_to_the_limit(server):
    r = _infer_json(server, "ks", {"max_tokens": LIMIT + 1})
    assert r.status_code == 400 and ABOVE in r.json()["error"], r.text
    r = _infer_json(server, "ks", {}, json.dumps({"max_tokens": str(LIMIT + 1)}))  # Triton's clients: strings
    assert r.status_code == 400 and ABOVE in r.json()["error"], r.text
    assert _written(_infer_json(server, "ks", COUNT)) == LIMIT  # unset: the upstream's 16, held to the limit
    # null in sampling_parameters (the upstream's rest of the context), and unset beside other sampling fields
    assert _written(_infer_json(server, "ks", COUNT, json.dumps({"max_tokens": None}))) == LIMIT
    assert _written(_infer_json(server, "ks", COUNT, json.dumps({"temperature": 0}))) == LIMIT
    assert _written(_infer_json(server, "ks", {**COUNT, "max_tokens": 2})) == 2  # within the limit: as asked
    http = httpclient.InferenceServerClient(server.http)
    grpc_client = grpcclient.InferenceServerClient(server.grpc)
    try:
        with pytest.raises(InferenceServerException) as exc:
            http.infer("ks", _inputs(httpclient), parameters={"max_tokens": LIMIT + 1})
        assert exc.value.status() == "400" and ABOVE in exc.value.message()
        with pytest.raises(InferenceServerException) as exc:
            grpc_client.infer("ks", _inputs(grpcclient), parameters={"max_tokens": LIMIT + 1})
        assert exc.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT) and ABOVE in exc.value.message()
    finally:
        http.close()
        grpc_client.close()


# ---------------------------------------------------------------- where hold_to_limit writes the budget
def _bytes(name: str, value: str) -> InferTensor:
    return InferTensor(name, "BYTES", [1], np.array([value.encode()], dtype=object))


def _request(*tensors: InferTensor, **parameters) -> InferRequest:
    return InferRequest(model_name="m", inputs=[_bytes("text_input", "x" * 40), *tensors], parameters=parameters)


def _sampling_doc(req: InferRequest) -> dict:
    t = next(t for t in req.inputs if t.name == "sampling_parameters")
    assert t.data.shape == (1,)
    return json.loads(t.data[0].decode())


def test_an_explicit_budget_above_the_limit_is_refused_wherever_it_is_named():
    limits = RequestLimits(max_tokens=LIMIT)
    budget = InferTensor("max_tokens", "INT32", [1], np.array([LIMIT + 1], np.int32))  # TensorRT-LLM's input
    for req in (_request(max_tokens=LIMIT + 1), _request(max_tokens=str(LIMIT + 1)), _request(budget),
                _request(_bytes("sampling_parameters", json.dumps({"max_tokens": LIMIT + 1})), max_tokens=1)):
        with pytest.raises(APIError) as exc:
            hold_to_limit(req, limits)
        assert exc.value.status == 400 and ABOVE in exc.value.message
    req = _request(_bytes("sampling_parameters", json.dumps({"max_tokens": 2})), max_tokens=LIMIT + 1)
    hold_to_limit(req, limits)  # the sampling_parameters JSON wins, as the model reads it: 2 is allowed
    assert _sampling_doc(req) == {"max_tokens": 2} and req.parameters == {"max_tokens": LIMIT + 1}


def test_an_unset_or_null_budget_is_written_where_the_model_reads_it():
    limits = RequestLimits(max_tokens=LIMIT)
    req = _request(n=2)
    hold_to_limit(req, limits)
    assert req.parameters == {"n": 2, "max_tokens": LIMIT}
    assert tensor_call_tokens(req) == 10 + 2 * LIMIT  # the key is charged the budget it was held to
    req = _request(_bytes("sampling_parameters", json.dumps({"temperature": 0})))
    hold_to_limit(req, limits)
    assert _sampling_doc(req) == {"temperature": 0, "max_tokens": LIMIT} and req.parameters == {}
    req = _request(_bytes("sampling_parameters", json.dumps({"max_tokens": None})), max_tokens=3)
    hold_to_limit(req, limits)
    assert _sampling_doc(req) == {"max_tokens": LIMIT}


def test_what_hold_to_limit_leaves_alone():
    unset = _request()
    hold_to_limit(unset, RequestLimits(max_tokens=16))  # the upstream's default 16 is within the limit
    assert unset.parameters == {}
    hold_to_limit(unset, RequestLimits())  # no limit
    assert unset.parameters == {}
    null = _request(max_tokens=None)
    hold_to_limit(null, RequestLimits(max_tokens=64))  # null is the rest of the context: held even at 64
    assert null.parameters == {"max_tokens": 64}
    bad = _request(max_tokens="many")
    hold_to_limit(bad, RequestLimits(max_tokens=LIMIT))  # not a count: the upstream's own 400
    assert bad.parameters == {"max_tokens": "many"}
    tensor = InferRequest(model_name="m", inputs=[InferTensor("INPUT0", "FP32", [1, 4], np.ones((1, 4), np.float32))])
    hold_to_limit(tensor, RequestLimits(max_tokens=LIMIT))  # no text_input: not an LLM call
    assert tensor.parameters == {}
    bad_json = _request(_bytes("sampling_parameters", "{bad"))
    hold_to_limit(bad_json, RequestLimits(max_tokens=LIMIT))
    assert bad_json.parameters == {"max_tokens": LIMIT}  # still held; the upstream refuses the bad JSON itself
