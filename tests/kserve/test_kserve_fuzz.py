"""A short mutation fuzz of the KServe infer route with real model names (the schemathesis run in tests/api draws
random names, which stop at the 404): valid requests for the repository's models, one or two fields replaced by
arbitrary JSON, sent as JSON or with the binary-data extension. None may get a 5xx; every 4xx has KServe's
``{"error": ...}`` body; the server keeps answering valid requests. Fixed seed, bounded cases."""
from __future__ import annotations

import json

import httpx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# model -> (input name, one row of FP32 values, batched with a leading 1; or a string: py_text does not batch)
MODELS = {"onnx_mlp": ("INPUT0", [0.5, -1.0, 2.0, 0.25]), "torch_affine": ("INPUT__0", [1.0, 2.0, 3.0]),
          "pipeline": ("X", [0.1, 0.2, 0.3, 0.4]), "py_scale": ("IN", [1.0, 2.0, 3.0]),
          "py_text": ("text_input", "hello")}
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6) | st.sampled_from(["FP32", "BYTES", "INT8", "TYPE_FP32", "binary_data_size"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)
FIELDS = ["name", "datatype", "shape", "data", "parameters", "inputs", "outputs", "id", "top-parameters"]


def _valid(model: str) -> dict:
    name, row = MODELS[model]
    if isinstance(row, str):
        return {"inputs": [{"name": name, "shape": [1], "datatype": "BYTES", "data": [row]}]}
    return {"inputs": [{"name": name, "shape": [1, len(row)], "datatype": "FP32", "data": row}]}


def _mutate(body: dict, field: str, value) -> dict:
    inputs = body.get("inputs")
    if field == "top-parameters":
        body["parameters"] = value
    elif field in ("inputs", "outputs", "id") or not (isinstance(inputs, list) and inputs
                                                       and isinstance(inputs[0], dict)):
        body[field] = value  # (an input field once the inputs list itself was replaced: lands at the top level)
    else:
        inputs[0][field] = value
    return body


def _binary(body: dict) -> tuple[bytes, dict]:
    """The same request with its first FP32 input moved to the binary-data extension (header + raw bytes)."""
    t = body["inputs"][0]
    raw = b""
    if isinstance(t, dict) and t.get("datatype") == "FP32" and isinstance(t.get("data"), list):
        try:
            raw = np.asarray(t.pop("data"), dtype=np.float32).tobytes()
        except (TypeError, ValueError):
            raw = b"\0" * 7
        params = t.get("parameters") if isinstance(t.get("parameters"), dict) else {}
        t["parameters"] = {**params, "binary_data_size": len(raw)}
    header = json.dumps(body).encode()
    return header + raw, {"Inference-Header-Content-Length": str(len(header)),
                          "Content-Type": "application/octet-stream"}


def _check(response: httpx.Response, what: str) -> None:
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        assert isinstance(response.json().get("error"), str), f"{what}: not a KServe error body: {response.text}"


def test_mutated_infer_requests_never_5xx(kserve):
    statuses: list[int] = []
    with httpx.Client(base_url=kserve.base, timeout=30) as client:
        for model in MODELS:  # the valid requests themselves succeed, so the cases reach the models
            r = client.post(f"/v2/models/{model}/infer", json=_valid(model))
            assert r.status_code == 200, f"{model}: {r.text}"

        @given(model=st.sampled_from(sorted(MODELS)), edits=st.lists(st.tuples(st.sampled_from(FIELDS), JSON_VALUES),
                                                                     min_size=1, max_size=2),
               binary=st.booleans())
        @settings(max_examples=150, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(model, edits, binary):
            body = _valid(model)
            for field, value in edits:
                body = _mutate(body, field, value)
            inputs = body.get("inputs")
            if binary and isinstance(inputs, list) and inputs and isinstance(inputs[0], dict):
                content, headers = _binary(body)
                r = client.post(f"/v2/models/{model}/infer", content=content, headers=headers)
            else:
                r = client.post(f"/v2/models/{model}/infer", json=body)
            _check(r, f"{model} {edits} binary={binary}")
            statuses.append(r.status_code)

        fuzz()
        assert len(statuses) >= 100 and any(400 <= s < 500 for s in statuses)
        deep = b"[" * 50000 + b"1" + b"]" * 50000  # the JSON decoder recursed per level: RecursionError was a 500
        for path, body in (("infer", b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[1,3],"data":%s}]}' % deep),
                           ("generate", b'{"IN":%s}' % deep)):
            r = client.post(f"/v2/models/py_scale/{path}", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and "nested too deeply" in r.json()["error"], (path, r.text[:200])
        for model in MODELS:  # still serving
            assert client.post(f"/v2/models/{model}/infer", json=_valid(model)).status_code == 200


def test_mutated_grpc_requests_never_internal(kserve):
    """The same over gRPC with raw tensors (the path where a BYTES shape of [2**40, 4] over six bytes tried to
    allocate 32 TiB): every answer is OK or a client error, never INTERNAL / UNKNOWN."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    codes: list[str] = []
    with grpc.insecure_channel(kserve.grpc) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)

        @given(model=st.sampled_from(sorted(MODELS)),
               shape=st.one_of(st.none(), st.lists(st.integers(0, 2 ** 40), max_size=3)),
               datatype=st.one_of(st.none(), st.sampled_from(["FP32", "BYTES", "INT64", "FP8", ""])),
               raw_cut=st.integers(-6, 6), extra_raw=st.booleans())
        @settings(max_examples=120, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(model, shape, datatype, raw_cut, extra_raw):
            name, row = MODELS[model]
            is_text = isinstance(row, str)
            req = pb.ModelInferRequest(model_name=model)
            default_type, default_shape = ("BYTES", [1]) if is_text else ("FP32", [1, len(row)])
            req.inputs.add(name=name, datatype=default_type if datatype is None else datatype,
                           shape=default_shape if shape is None else shape)
            raw = (len(row).to_bytes(4, "little") + row.encode()) if is_text else np.asarray(row, np.float32).tobytes()
            req.raw_input_contents.append(raw[:raw_cut] if raw_cut < 0 else raw + b"\x01" * raw_cut)
            if extra_raw:
                req.raw_input_contents.append(b"\0" * 4)
            try:
                stub.ModelInfer(req, timeout=30)
                codes.append("OK")
            except grpc.RpcError as exc:
                assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), \
                    f"{model} shape={shape} datatype={datatype}: {exc.code()} {exc.details()}"
                codes.append(exc.code().name)

        fuzz()
    assert "OK" in codes and "INVALID_ARGUMENT" in codes and len(codes) >= 100
