"""Python-model answers through the KServe fronts of the shared `strata serve` (tritonclient HTTP and gRPC):
Triton's status per TritonError code, response parameters, and a decoupled stream that goes on after an error.
The models are written into the running server's repository and loaded (explicit control mode)."""

from __future__ import annotations

import queue
import shutil
import textwrap

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException
from _model_repos import PY_ERROR_MID_STREAM

CODES = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            code = int(pb_utils.get_input_tensor_by_name(r, "N").as_numpy()[0])
            if code < 0:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.int32))],
                                                      parameters={"answer": "yes", "n": 3, "ok": True}))
            else:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"code {code}", code)))
        return out
"""

IO = ('backend: "python"\nmax_batch_size: 0\ninput [ { name: "N" data_type: TYPE_INT32 dims: [1] } ]\n'
      'output [ { name: "OUT" data_type: TYPE_INT32 dims: [1] } ]\n')
# Triton's HTTP status and gRPC status per TritonError code (http_server.cc, grpc_utils.cc)
TRITON_STATUS = [(400, "UNKNOWN"), (500, "INTERNAL"), (404, "NOT_FOUND"), (400, "INVALID_ARGUMENT"),
                 (503, "UNAVAILABLE"), (501, "UNIMPLEMENTED"), (400, "ALREADY_EXISTS"), (400, "CANCELLED")]


@pytest.fixture(scope="module")
def models(kserve):
    for name, code, extra in (("py_codes", CODES, ""),
                              ("py_midstream", PY_ERROR_MID_STREAM, "model_transaction_policy { decoupled: true }\n")):
        (kserve.repo / name / "1").mkdir(parents=True)
        (kserve.repo / name / "1" / "model.py").write_text(textwrap.dedent(code))
        (kserve.repo / name / "config.pbtxt").write_text(IO + extra)
    http = httpclient.InferenceServerClient(kserve.http)
    for name in ("py_codes", "py_midstream"):
        http.load_model(name)
    yield http, grpcclient.InferenceServerClient(kserve.grpc)
    for name in ("py_codes", "py_midstream"):
        http.unload_model(name)
        shutil.rmtree(kserve.repo / name)


def _n(module, n: int):
    t = module.InferInput("N", [1], "INT32")
    t.set_data_from_numpy(np.array([n], np.int32))
    return [t]


def test_triton_error_codes_map_to_tritons_http_and_grpc_statuses(models):
    http, grpc = models
    statuses = []
    for code in range(8):
        got = []
        for module, client in ((httpclient, http), (grpcclient, grpc)):
            with pytest.raises(InferenceServerException) as info:
                client.infer("py_codes", _n(module, code))
            got.append(info.value.status())
        statuses.append(tuple(got))
    assert statuses == [(str(h), f"StatusCode.{g}") for h, g in TRITON_STATUS]


def test_response_parameters_reach_both_clients(models):
    http, grpc = models
    assert http.infer("py_codes", _n(httpclient, -1)).get_response()["parameters"] == \
        {"answer": "yes", "n": 3, "ok": True}
    params = grpc.infer("py_codes", _n(grpcclient, -1)).get_response().parameters
    assert (params["answer"].string_param, params["n"].int64_param, params["ok"].bool_param) == ("yes", 3, True)


def test_an_error_mid_stream_is_delivered_and_the_stream_goes_on(models):
    http, grpc = models
    got: queue.Queue = queue.Queue()
    grpc.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        grpc.async_stream_infer("py_midstream", _n(grpcclient, 0), request_id="e1", enable_empty_final_response=True)
        items = [got.get(timeout=30) for _ in range(4)]
    finally:
        grpc.stop_stream()
    assert "mid-stream error" in items[1][1].message()
    rest = [(r.get_response().id, r.as_numpy("OUT").tolist(), r.get_response().parameters["triton_final_response"]
             .bool_param) for i, (r, _) in enumerate(items) if i != 1]
    assert rest == [("e1", [0], False), ("e1", [2], False), ("e1", [3], True)]  # final flag on the last one
    collected = http.infer("py_midstream", _n(httpclient, 0)).get_response()["responses"]
    assert [r.get("error") or r["outputs"][0]["data"] for r in collected] == \
        [[0], "model 'py_midstream': mid-stream error", [2], [3]]
