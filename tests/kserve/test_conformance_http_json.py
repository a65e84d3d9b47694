"""KServe v2 HTTP conformance, JSON side, as tritonclient.http exercises it against Triton:

- non-finite floats: Triton's JSON reader takes ``NaN`` / ``Infinity`` / ``-Infinity`` and its writer emits them;
  tritonclient sends them for a float input given with ``binary_data=False`` and reads them back. ``null`` (what
  msgspec writes) is read by the client as NaN, so an infinity came back as NaN, and the request was refused as
  "not valid JSON".
- ``binary_data`` / ``binary_data_output`` are booleans: Triton refuses other JSON types; the string "false" used
  to be read as true.
"""

from __future__ import annotations

import json
import math

import httpx
import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as httpclient

from strataserve.api.kserve_codec import decode_http_request, encode_http_response, json_dumps, response_to_dict
from strataserve.types.tensors import InferResponse, InferTensor, ModelServerError

SPECIAL = [math.inf, -math.inf, math.nan, 0.5]


@pytest.fixture(scope="module")
def client(kserve):
    c = httpclient.InferenceServerClient(kserve.http)
    yield c
    c.close()


def _same(got, want) -> bool:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return bool(np.array_equal(got, want, equal_nan=True))


# ------------------------------------------------------------------------------------------ end to end
def test_tritonclient_json_round_trip_of_non_finite_floats(client):
    """torch_affine: relu(x) * 2 + 1, so inf -> inf, -inf -> 1, nan -> nan; JSON both ways as tritonclient sends."""
    x = np.array([[np.inf, -np.inf, np.nan]], np.float32)
    inp = httpclient.InferInput("INPUT__0", [1, 3], "FP32")
    inp.set_data_from_numpy(x, binary_data=False)  # the body carries NaN / Infinity tokens
    out = httpclient.InferRequestedOutput("OUTPUT__0", binary_data=False)
    result = client.infer("torch_affine", [inp], outputs=[out])
    assert "data" in result.get_output("OUTPUT__0")  # answered as JSON, not binary
    got = result.as_numpy("OUTPUT__0")
    assert got.dtype == np.float32 and got.shape == (1, 3)
    assert _same(got, [[np.inf, 1.0, np.nan]]), got


def test_raw_json_body_with_non_finite_tokens(kserve):
    body = b'{"inputs":[{"name":"INPUT__0","datatype":"FP32","shape":[1,3],"data":[Infinity,-Infinity,NaN]}]}'
    r = httpx.post(f"{kserve.base}/v2/models/torch_affine/infer", content=body,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert b"[Infinity,1.0,NaN]" in r.content.replace(b" ", b"")
    assert _same(json.loads(r.content)["outputs"][0]["data"], [np.inf, 1.0, np.nan])


def test_malformed_json_with_nan_text_is_still_a_clear_400(kserve):
    r = httpx.post(f"{kserve.base}/v2/models/torch_affine/infer", content=b'{"inputs": [NaN,}')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    body = b'{"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[NaN]}]}'
    with pytest.raises(ModelServerError, match="INT32 data must be integers"):
        decode_http_request(body, None, "m")


@pytest.mark.parametrize("where, params", [
    ("request", {"parameters": {"binary_data_output": "false"}}),
    ("output", {"outputs": [{"name": "OUTPUT__0", "parameters": {"binary_data": 1}}]}),
])
def test_binary_data_flags_must_be_booleans(kserve, where, params):
    body = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}], **params}
    r = httpx.post(f"{kserve.base}/v2/models/torch_affine/infer", json=body)
    assert r.status_code == 400, r.content[:200]
    msg = r.json()["error"]
    assert "must be true or false" in msg and ("binary_data_output" if where == "request" else "binary_data") in msg
    ok = httpx.post(f"{kserve.base}/v2/models/torch_affine/infer",
                    json={**body, "parameters": {"binary_data_output": False}, "outputs": [{"name": "OUTPUT__0"}]})
    assert ok.status_code == 200 and ok.json()["outputs"][0]["data"] == [3.0, 5.0, 7.0]


# ------------------------------------------------------------------------------------------ codec
@pytest.mark.parametrize("datatype, dtype", [("FP16", np.float16), ("FP32", np.float32), ("FP64", np.float64),
                                             ("BF16", ml_dtypes.bfloat16)])
def test_every_float_type_writes_non_finite_tokens(datatype, dtype):
    y = np.array(SPECIAL, dtype=dtype)
    resp = InferResponse("m", "1", None, [InferTensor("y", datatype, [4], y)])
    out, hl = encode_http_response(resp, decode_http_request(b'{"inputs":[]}', None, "m"))
    assert hl is None
    result = httpclient.InferResult.from_response_body(out)  # tritonclient's own reader
    assert _same(result.as_numpy("y").astype(np.float64), y.astype(np.float64))
    # the all-JSON form (SSE events, a decoupled model's "responses") too
    doc = json.loads(json_dumps(response_to_dict(resp)))
    assert _same(doc["outputs"][0]["data"], y.astype(np.float64))


def test_finite_floats_still_plain_lists():
    resp = InferResponse("m", "1", None, [InferTensor("y", "FP32", [2], np.array([0.5, -2.0], np.float32))])
    assert response_to_dict(resp)["outputs"][0]["data"] == [0.5, -2.0]
