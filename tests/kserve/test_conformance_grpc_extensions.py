"""KServe v2 gRPC conformance: Triton's extension RPCs this server lacks (system / CUDA shared memory, trace,
logging) answer UNIMPLEMENTED with a message naming the missing extension, as the HTTP routes answer a 404
that says so; gRPC's bare "Method not found!" told a tritonclient user nothing. The server keeps serving."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def client(kserve):
    c = grpcclient.InferenceServerClient(kserve.grpc)
    yield c
    c.close()


CALLS = [
    ("get_system_shared_memory_status", (), "shared-memory"),
    ("register_system_shared_memory", ("region0", "/strata_key", 64), "shared-memory"),
    ("unregister_system_shared_memory", (), "shared-memory"),
    ("get_cuda_shared_memory_status", (), "shared-memory"),
    ("register_cuda_shared_memory", ("region1", b"\0" * 64, 0, 64), "shared-memory"),
    ("unregister_cuda_shared_memory", ("region1",), "shared-memory"),
    ("get_trace_settings", (), "trace or logging"),
    ("get_log_settings", (), "trace or logging"),
]


@pytest.mark.parametrize("call, args, needle", CALLS, ids=[c[0] for c in CALLS])
def test_missing_extension_is_a_clear_unimplemented(client, call, args, needle):
    with pytest.raises(InferenceServerException) as err:
        getattr(client, call)(*args)
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    assert needle in err.value.message() and "extension" in err.value.message()


def test_server_serves_after_the_refusals(client):
    x = np.ones((1, 3), np.float32)
    inp = grpcclient.InferInput("INPUT__0", [1, 3], "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("torch_affine", [inp]).as_numpy("OUTPUT__0"), x * 2 + 1)
