"""Fixes on the text models' KServe face (the command line's model and the repository's LLMs) and the max-tokens
limit on every generation route: an unset / null max_tokens is held to --limit-max-tokens; malformed guided
decoding and out-of-int64 integers are 400s naming the parameter; generate bodies pass extra top-level keys as
parameters; generate_stream sends JSON events only; truncate_prompt_tokens is applied; a repository LLM takes its
checkpoint's generation_config.json and Triton's vLLM-backend tensors, and answers tritonclient's infer."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from _tiny_models import make_tiny_checkpoint
from router_servers import Proc, free_port

LIMIT, PROMPT = 5, "hello there"
GEN = "/v2/models/{}/generate"


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kserve_text_fixes")
    repo = tmp / "repo"
    make_tiny_checkpoint("llama", repo / "bare")  # a bare HF folder: a repository LLM
    make_tiny_checkpoint("llama", repo / "gc")
    (repo / "gc" / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    srv = Proc([str(tiny), "--served-model-name", "chat", "--device", "cpu", "--dtype", "float32",
                "--kv-cache-memory-gib", "0.01", "--max-model-len", "256", "--max-num-seqs", "4",
                "--limit-max-tokens", str(LIMIT), "--model-repository", str(repo),
                "--model-control-mode", "explicit", "--load-model", "*"],
               free_port(), tmp / "server.log", grpc_port=free_port())
    srv.start()
    yield srv
    srv.stop()


def _generate(server, model: str, body: dict, stream: bool = False) -> httpx.Response:
    path = GEN.format(model) + ("_stream" if stream else "")
    return httpx.post(server.url + path, json=body, timeout=60)


def test_unset_or_null_max_tokens_is_held_to_the_limit(server):
    base = {"model": "chat", "ignore_eos": True, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json={**base, "prompt": PROMPT, "max_tokens": None}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == LIMIT, r.text
    r = httpx.post(server.url + "/v1/completions", json={**base, "prompt": PROMPT, "max_tokens": LIMIT + 1})
    assert r.status_code == 400 and "max_tokens" in r.text  # only an explicit larger value is refused
    msgs = [{"role": "user", "content": PROMPT}]
    for extra in ({}, {"max_tokens": None}, {"max_completion_tokens": None}):
        r = httpx.post(server.url + "/v1/chat/completions", json={**base, "messages": msgs, **extra}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == LIMIT, (extra, r.text)
    for params in ({"max_tokens": None}, {}):  # null, and unset (its default 16 is above the limit too)
        r = _generate(server, "chat", {"text_input": PROMPT, "parameters": {
            **params, "ignore_eos": True, "return_num_output_tokens": True}})
        assert r.status_code == 200 and r.json()["num_output_tokens"] == LIMIT, (params, r.text)
    r = _generate(server, "chat", {"text_input": PROMPT, "parameters": {"max_tokens": LIMIT + 1}})
    assert r.status_code == 400 and "max_tokens" in r.text
    r = httpx.post(server.url + "/v1/responses", json={"model": "chat", "input": PROMPT, "temperature": 0,
                                                        "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == LIMIT, r.text


@pytest.mark.parametrize("name", ["guided_decoding", "structured_outputs"])
@pytest.mark.parametrize("value", ["x", 5, ["a"], {"bogus": 1}])
@pytest.mark.parametrize("model", ["chat", "bare"])
def test_malformed_guided_decoding_is_a_400_naming_it(server, name, value, model):
    for stream in (False, True):
        r = _generate(server, model, {"text_input": PROMPT, "parameters": {name: value}}, stream)
        assert r.status_code == 400 and name in r.json()["error"], r.text


@pytest.mark.parametrize("params, named", [({"seed": 2**70}, "seed"), ({"stop_token_ids": [2**64]}, "stop_token_ids"),
                                           ({"max_tokens": -(2**64)}, "max_tokens")])
def test_integers_outside_int64_are_400s_naming_them(server, params, named):
    for model in ("chat", "bare"):
        r = _generate(server, model, {"text_input": PROMPT, "parameters": params})
        assert r.status_code == 400 and named in r.json()["error"], r.text


def test_extra_generate_keys_are_parameters_and_stream_has_no_done(server):
    body = {"text_input": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "return_num_output_tokens": True}
    for model in ("chat", "bare"):
        r = _generate(server, model, body)
        assert r.status_code == 200 and r.json()["num_output_tokens"] == 3, r.text
        r = _generate(server, model, {**body, "parameters": {"max_tokens": 2}})  # explicit parameters win
        assert r.status_code == 200 and r.json()["num_output_tokens"] == 2, r.text
        r = _generate(server, model, {**body, "bogus": 1})
        assert r.status_code == 400 and "bogus" in r.json()["error"], r.text
        r = _generate(server, model, body, stream=True)
        lines = [line for line in r.text.splitlines() if line]
        assert r.status_code == 200 and lines and all(line.startswith("data: {") for line in lines), r.text
        events = [json.loads(line[len("data: "):]) for line in lines]
        assert sum(e.get("num_output_tokens", 0) for e in events) == 3


def test_truncate_prompt_tokens_is_applied(server):
    long_prompt = "word " * 400  # well past the 256-token context
    r = _generate(server, "chat", {"text_input": long_prompt, "parameters": {"max_tokens": 2}})
    assert r.status_code == 400
    r = _generate(server, "chat", {"text_input": long_prompt, "parameters": {
        "max_tokens": 2, "truncate_prompt_tokens": 10, "return_num_input_tokens": True}})
    assert r.status_code == 200 and r.json()["num_input_tokens"] == 10, r.text


def test_repository_llm_takes_its_generation_config(server):
    body = {"text_input": PROMPT, "parameters": {"ignore_eos": True, "return_num_output_tokens": True}}
    r = _generate(server, "gc", body)
    assert r.status_code == 200 and r.json()["num_output_tokens"] == 3, r.text  # max_new_tokens, not 16
    r = _generate(server, "bare", body)  # its default 16, held to --limit-max-tokens as every LLM's
    assert r.status_code == 200 and r.json()["num_output_tokens"] == LIMIT, r.text


def test_repository_llm_has_the_vllm_backend_tensors_and_answers_infer(server):
    meta = httpx.get(server.url + "/v2/models/bare").json()
    assert [t["name"] for t in meta["inputs"]] == [
        "text_input", "stream", "sampling_parameters", "exclude_input_in_output", "return_finish_reason",
        "return_num_input_tokens", "return_num_output_tokens"]
    assert {t["name"] for t in meta["outputs"]} >= {"text_output", "finish_reason", "num_output_tokens"}
    cfg = httpx.get(server.url + "/v2/models/bare/config").json()
    assert not cfg.get("model_transaction_policy", {}).get("decoupled")
    sampling = json.dumps({"max_tokens": 5, "temperature": 0})
    r = _generate(server, "bare", {"text_input": PROMPT, "stream": False, "sampling_parameters": sampling,
                                   "return_num_output_tokens": True})
    assert r.status_code == 200 and r.json()["num_output_tokens"] == 5, r.text
    whole = r.json()["text_output"]
    client = httpclient.InferenceServerClient(server.http)
    inputs = []
    for name, value in (("text_input", PROMPT), ("sampling_parameters", sampling)):
        t = httpclient.InferInput(name, [1], "BYTES")
        t.set_data_from_numpy(np.array([value.encode()], dtype=object))
        inputs.append(t)
    res = client.infer("bare", inputs)
    assert res.as_numpy("text_output").tolist() == [whole.encode()]
    client.close()
    # a stream (gRPC ModelStreamInfer) gets the text in pieces, as from the command line's model
    import queue

    import tritonclient.grpc as grpcclient

    grpc = grpcclient.InferenceServerClient(server.grpc)
    got: queue.Queue = queue.Queue()
    grpc.start_stream(callback=lambda result, error: got.put((result, error)))
    g_inputs = []
    for name, value in (("text_input", PROMPT), ("sampling_parameters", sampling)):
        t = grpcclient.InferInput(name, [1], "BYTES")
        t.set_data_from_numpy(np.array([value.encode()], dtype=object))
        g_inputs.append(t)
    grpc.async_stream_infer("bare", g_inputs, enable_empty_final_response=True)
    text, pieces = "", 0
    while True:
        result, error = got.get(timeout=30)
        assert error is None, error
        out = result.as_numpy("text_output")
        text, pieces = text + (out[0].decode() if out is not None else ""), pieces + (out is not None)
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    grpc.stop_stream()
    grpc.close()
    assert text == whole and pieces > 1
