"""Dynamic batching seen through the KServe fronts: 32 concurrent clients (16 HTTP + 16 gRPC, aio clients)
hit one ONNX model; the statistics extension shows far fewer executions than requests, and every client gets
exactly its own rows back."""

from __future__ import annotations

import asyncio

import numpy as np
import tritonclient.grpc.aio as grpcaio
import tritonclient.http.aio as httpaio

from _model_repos import mlp_reference

MODEL = "onnx_batch"  # max_batch_size 32, max_queue_delay 50 ms (see conftest)


def _stats(kserve) -> tuple[int, int]:
    import httpx

    s = httpx.get(f"{kserve.base}/v2/models/{MODEL}/stats").json()["model_stats"][0]
    return s["inference_count"], s["execution_count"]


def test_concurrent_clients_are_batched_and_get_their_own_rows(kserve):
    clients = 32
    rows = [np.random.default_rng(100 + i).standard_normal((1 + i % 2, 4)).astype(np.float32) for i in range(clients)]
    inf0, exe0 = _stats(kserve)

    async def run() -> list[np.ndarray]:
        async with httpaio.InferenceServerClient(kserve.http) as h, grpcaio.InferenceServerClient(kserve.grpc) as g:
            async def one(i: int) -> np.ndarray:
                mod = httpaio if i % 2 == 0 else grpcaio
                inp = mod.InferInput("INPUT0", list(rows[i].shape), "FP32")
                inp.set_data_from_numpy(rows[i])
                res = await (h if i % 2 == 0 else g).infer(MODEL, [inp], request_id=str(i))
                resp = res.get_response()  # a dict over HTTP, a protobuf message over gRPC
                assert (resp["id"] if isinstance(resp, dict) else resp.id) == str(i)
                return res.as_numpy("OUTPUT0")

            return await asyncio.gather(*(one(i) for i in range(clients)))

    outs = asyncio.run(run())
    w = kserve.refs["batch_weights"][1]
    for x, y in zip(rows, outs):
        np.testing.assert_allclose(y, mlp_reference(x, w), rtol=1e-5, atol=1e-5)
    inf1, exe1 = _stats(kserve)
    requests_rows = sum(r.shape[0] for r in rows)
    assert inf1 - inf0 == requests_rows
    print(f"{exe1 - exe0} executions for {clients} requests")
    assert 1 <= exe1 - exe0 <= clients // 2, f"{exe1 - exe0} executions for {clients} concurrent requests"
