"""KServe v2 HTTP codec against tritonclient's own request builder and response parser (no server)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import serialize_byte_tensor

from strataserve.api.kserve_codec import decode_http_request, encode_http_response, response_to_dict
from strataserve.api.kserve_tensors import tensor_from_raw
from strataserve.types.tensors import InferResponse, InferTensor, ModelServerError


def _inp(name, arr, datatype, binary):
    x = httpclient.InferInput(name, list(arr.shape), datatype)
    x.set_data_from_numpy(arr, binary_data=binary)
    return x


def _body(inputs, outputs=None, **kw):
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, outputs, **kw)
    return body, (None if json_size is None else str(json_size))


@pytest.mark.parametrize("binary", [True, False])
def test_request_roundtrip_every_dtype(binary):
    rng = np.random.default_rng(0)
    arrays = {
        "f32": (rng.standard_normal((2, 3)).astype(np.float32), "FP32"),
        "f64": (rng.standard_normal((4,)).astype(np.float64), "FP64"),
        "i8": (np.array([[-3, 4]], dtype=np.int8), "INT8"),
        "i64": (np.array([1 << 40, -7], dtype=np.int64), "INT64"),
        "u16": (np.array([1, 65535], dtype=np.uint16), "UINT16"),
        "b": (np.array([True, False, True]), "BOOL"),
        "s": (np.array([b"hello", "wörld".encode(), b""], dtype=object).reshape(1, 3), "BYTES"),
    }
    if binary:  # JSON cannot carry FP16 through tritonclient; the binary extension can
        arrays["f16"] = (np.array([0.5, -2.0], dtype=np.float16), "FP16")
    inputs = [_inp(n, a, dt, binary) for n, (a, dt) in arrays.items()]
    outputs = [httpclient.InferRequestedOutput("y", binary_data=True), httpclient.InferRequestedOutput("z", binary_data=False)]
    body, hl = _body(inputs, outputs, request_id="r1", priority=2, timeout=1500)
    decoded = decode_http_request(body, hl, "m", "3")
    req = decoded.request
    assert (req.model_name, req.model_version, req.id, req.priority, req.timeout_us) == ("m", "3", "r1", 2, 1500)
    assert req.requested_outputs == ["y", "z"]
    assert decoded.binary_outputs == {"y": True, "z": False}
    got = {t.name: t for t in req.inputs}
    for name, (arr, dt) in arrays.items():
        t = got[name]
        assert t.datatype == dt and t.shape == list(arr.shape)
        assert t.data.shape == arr.shape
        if dt == "BYTES":
            assert t.data.tolist() == arr.tolist()
        else:
            assert t.data.dtype == arr.dtype
            np.testing.assert_array_equal(t.data, arr)
        assert "binary_data_size" not in t.parameters


def test_nested_json_data_and_base64_bytes():
    body = (
        b'{"inputs":[{"name":"x","datatype":"INT32","shape":[2,2],"data":[[1,2],[3,4]]},'
        b'{"name":"s","datatype":"BYTES","shape":[2],"data":["AAE=","/w=="],"parameters":{"content_type":"base64"}}]}'
    )
    req = decode_http_request(body, None, "m").request
    np.testing.assert_array_equal(req.inputs[0].data, np.array([[1, 2], [3, 4]], dtype=np.int32))
    assert req.inputs[1].data.tolist() == [b"\x00\x01", b"\xff"]
    assert req.requested_outputs is None


@pytest.mark.parametrize("binary_out", [True, False])
def test_response_parsed_by_tritonclient(binary_out):
    y = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    s = np.array([b"abc", "é".encode(), b"\xff\xfe"], dtype=object)  # last one is not UTF-8
    resp = InferResponse("m", "1", "rid", [InferTensor("y", "FP32", [2, 3], y), InferTensor("s", "BYTES", [3], s)])
    body = b'{"inputs":[],"outputs":[{"name":"y"},{"name":"s"}],"parameters":{"binary_data_output":%s}}' % (
        b"true" if binary_out else b"false"
    )
    decoded = decode_http_request(body, None, "m")
    out, hl = encode_http_response(resp, decoded)
    assert hl is not None  # the non-UTF-8 BYTES output always goes binary
    result = httpclient.InferResult.from_response_body(out, header_length=hl)
    np.testing.assert_array_equal(result.as_numpy("y"), y)
    assert result.as_numpy("s").tolist() == s.tolist()
    assert result.get_response()["id"] == "rid"
    y_meta = result.get_output("y")
    assert ("binary_data_size" in y_meta.get("parameters", {})) == binary_out


def test_json_only_response_has_no_header_length():
    resp = InferResponse("m", "1", None, [InferTensor("y", "INT64", [2], np.array([5, -1]))])
    out, hl = encode_http_response(resp, decode_http_request(b'{"inputs":[]}', None, "m"))
    assert hl is None
    result = httpclient.InferResult.from_response_body(out)
    np.testing.assert_array_equal(result.as_numpy("y"), [5, -1])
    d = response_to_dict(resp)
    assert d["outputs"][0]["data"] == [5, -1] and "id" not in d


BAD = [
    (b"not json", None, "not valid JSON"),
    (b"[1,2]", None, "JSON object"),
    (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[3],"data":[1,2]}]}', None, "holds 2 elements"),
    (b'{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[1,2.5]}]}', None, "must be integers"),
    (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":["a"]}]}', None, "must be numbers"),
    (b'{"inputs":[{"name":"x","datatype":"BOOL","shape":[1],"data":[1]}]}', None, "must be booleans"),
    (b'{"inputs":[{"name":"x","datatype":"UINT8","shape":[1],"data":[300]}]}', None, "does not fit UINT8"),
    (b'{"inputs":[{"name":"x","datatype":"UINT16","shape":[2],"data":[1,-1]}]}', None, "value -1 does not fit UINT16"),
    (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[true,1.5]}]}', None, "element 0 is True"),
    (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[1,[2]]}]}', None, "element 1 is [2]"),
    (b'{"inputs":[{"name":"x","datatype":"INT64","shape":[1],"data":[100000000000000000000000]}]}', None, "does not fit INT64"),
    (b'{"inputs":[{"name":"x","datatype":"FP8","shape":[1],"data":[1]}]}', None, "unsupported datatype"),
    # not a string (found by a fuzz run: a list was looked up in the datatype table and raised TypeError -> 500)
    (b'{"inputs":[{"name":"x","datatype":["FP32"],"shape":[1],"data":[1]}]}', None, "unsupported datatype ['FP32']"),
    (b'{"inputs":[{"name":"x","datatype":{"a":1},"shape":[1],"data":[1]}]}', None, "unsupported datatype {'a': 1}"),
    (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[-1],"data":[1]}]}', None, "non-negative"),
    (b'{"inputs":[{"name":"x","shape":[1],"data":[1]}]}', None, "missing 'datatype'"),
    (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1]}]}', None, "needs 'data'"),
    (b'{"inputs":[{"name":"s","datatype":"BYTES","shape":[1],"data":[3]}]}', None, "must be a string"),
    (b'{"inputs":[{"name":"s","datatype":"BYTES","shape":[1],"data":["%%"],"parameters":{"content_type":"base64"}}]}', None, "base64"),
    (b'{"inputs":{}}', None, "'inputs' list"),
    (b'{"inputs":[],"parameters":{"priority":-1}}', None, "priority"),
    (b'{"inputs":[]}', "99", "body has only"),
    (b'{"inputs":[]}', "x", "must be an integer"),
    # found by a fuzz: msgspec's RecursionError on deep nesting was a 500
    (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":' + b"[" * 50000 + b"1" + b"]" * 50000 + b"}]}",
     None, "nested too deeply"),
]


@pytest.mark.parametrize("body,hl,needle", BAD)
def test_bad_requests_name_the_fault(body, hl, needle):
    with pytest.raises(ModelServerError) as err:
        decode_http_request(body, hl, "m")
    assert err.value.code == "invalid_argument"
    assert needle in err.value.message


def _binary_body(header: bytes, blob: bytes) -> tuple[bytes, str]:
    return header + blob, str(len(header))


def test_bytes_tensor_with_a_huge_shape_is_refused_before_allocating():
    # found by a gRPC fuzz: shape [2**40, 4] over 6 bytes tried to allocate 32 TiB of object pointers (500)
    raw = struct.pack("<I", 2) + b"hi"
    with pytest.raises(ModelServerError, match="cannot hold the 4398046511104 elements"):
        tensor_from_raw("s", "BYTES", [2 ** 40, 4], raw)
    assert tensor_from_raw("s", "BYTES", [1], raw).data.tolist() == [b"hi"]


def test_binary_size_mismatches():
    hdr = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"parameters":{"binary_data_size":%d}}]}'
    # declared size matches the blob but not the shape
    with pytest.raises(ModelServerError, match="got 4 bytes but shape \\[2\\] of FP32 needs 8"):
        decode_http_request(*_binary_body(hdr % 4, b"\0" * 4), "m")
    # declared size runs past the blob
    with pytest.raises(ModelServerError, match="runs past the binary data"):
        decode_http_request(*_binary_body(hdr % 8, b"\0" * 4), "m")
    # blob has bytes nobody claimed
    with pytest.raises(ModelServerError, match="not claimed"):
        decode_http_request(*_binary_body(hdr % 8, b"\0" * 12), "m")


def test_bytes_tensor_framing_errors():
    good = serialize_byte_tensor(np.array([b"ab", b"cde"], dtype=object)).item()
    t = tensor_from_raw("s", "BYTES", [2], good)
    assert t.data.tolist() == [b"ab", b"cde"]
    with pytest.raises(ModelServerError, match="declares 2 elements|holds 2 elements but its shape declares 3"):
        tensor_from_raw("s", "BYTES", [3], good)
    with pytest.raises(ModelServerError, match="more than the 1 elements"):
        tensor_from_raw("s", "BYTES", [1], good)
    with pytest.raises(ModelServerError, match="declares 3 bytes"):
        tensor_from_raw("s", "BYTES", [2], good[:-1])
    with pytest.raises(ModelServerError, match="inside a 4-byte length prefix"):
        tensor_from_raw("s", "BYTES", [3], good + b"\x01\x00")


def test_decoded_binary_inputs_are_writable_copies():
    raw = np.arange(4, dtype=np.float32).tobytes()
    t = tensor_from_raw("x", "FP32", [2, 2], raw)
    t.data[0, 0] = 9.0  # Python-backend models may modify their inputs in place
    assert t.data.flags.writeable and np.frombuffer(raw, np.float32)[0] == 0.0


def test_compressed_bodies(monkeypatch):
    import gzip
    import zlib as _zlib

    from strataserve.api import kserve_codec

    body = b'{"inputs":[]}'
    assert kserve_codec.decompress(gzip.compress(body), "gzip") == body
    assert kserve_codec.decompress(_zlib.compress(body), "deflate") == body
    with pytest.raises(ModelServerError, match="not valid gzip"):
        kserve_codec.decompress(b"plain", "gzip")
    with pytest.raises(ModelServerError, match="unsupported Content-Encoding"):
        kserve_codec.decompress(body, "br")
    monkeypatch.setattr(kserve_codec, "MAX_DECOMPRESSED_BYTES", 1000)
    bomb = gzip.compress(b"\0" * 1001)
    with pytest.raises(ModelServerError, match="inflates to more than"):
        kserve_codec.decompress(bomb, "gzip")


def test_parameters_must_be_objects_but_may_be_null():
    req = decode_http_request(b'{"inputs":[],"parameters":null}', None, "m").request
    assert req.parameters == {}
    for body in (b'{"inputs":[],"parameters":[]}',
                 b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1],"parameters":"a"}]}',
                 b'{"inputs":[],"outputs":[{"name":"y","parameters":[1]}]}'):
        with pytest.raises(ModelServerError, match="'parameters' must be a JSON object"):
            decode_http_request(body, None, "m")
