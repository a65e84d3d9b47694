"""The failure reason (Triton's, stats.py) of each way a request fails besides those the HTTP test drives: a
model's error response and an execution past EXECUTION_TIMEOUT_MS are BACKEND; an ensemble's bad input is
REJECTED, an ensemble whose step failed is OTHER (as Triton counts it; the step's own counter says why), and an
ensemble cancelled mid-step is CANCELED, for the ensemble and for its step. In-process ModelServer."""

from __future__ import annotations

import asyncio

import numpy as np
from _model_repos import add_python_scale, write_config, write_python_model
from ms_helpers import expect_error, request, run, serving

# sleeps X seconds, answers X
SLOW = """
    import time
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
                time.sleep(float(x[0]))
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
            return out
"""


def _ensemble(repo, name: str, step: str, mbs: int, dims: str, keys: tuple[str, str]) -> None:
    (repo / name / "1").mkdir(parents=True)
    write_config(repo / name, f"""
        platform: "ensemble"
        max_batch_size: {mbs}
        input [ {{ name: "X" data_type: TYPE_FP32 dims: {dims} }} ]
        output [ {{ name: "Y" data_type: TYPE_FP32 dims: {dims} }} ]
        ensemble_scheduling {{ step [ {{ model_name: "{step}" input_map {{ key: "{keys[0]}" value: "X" }}
                                         output_map {{ key: "{keys[1]}" value: "Y" }} }} ] }}
    """)


def _counts(**reasons: int) -> dict[str, int]:
    return {r: reasons.get(r, 0) for r in ("REJECTED", "CANCELED", "BACKEND", "OTHER")}


def test_backend_ensemble_and_timeout_failures_count_under_their_reasons(tmp_path):
    add_python_scale(tmp_path)  # an error response for a non-finite IN
    _ensemble(tmp_path, "ens", "py_scale", 8, "[ 3 ]", ("IN", "OUT"))
    write_python_model(tmp_path, "slow", SLOW, """
        backend: "python"
        max_batch_size: 0
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
        parameters { key: "EXECUTION_TIMEOUT_MS" value: { string_value: "500" } }
    """)
    _ensemble(tmp_path, "slow_ens", "slow", 0, "[ 1 ]", ("X", "Y"))
    nan = np.full((1, 3), np.nan, np.float32)

    async def main():
        async with serving(tmp_path) as server:
            await expect_error("invalid_argument", server.infer(request("py_scale", IN=nan)), "must be finite")
            await expect_error("invalid_argument", server.infer(request("ens", X=nan)), "step 0", "must be finite")
            await expect_error("invalid_argument", server.infer(request("ens", X=np.ones((1, 4), np.float32))),
                               "shape")
            await expect_error("deadline_exceeded", server.infer(request("slow", X=np.array([1.5], np.float32))))
            cancelled = asyncio.ensure_future(server.infer(request("slow_ens", X=np.array([0.3], np.float32))))
            await asyncio.sleep(0.1)  # its step runs now
            cancelled.cancel()
            await asyncio.gather(cancelled, return_exceptions=True)
            stats = {m: server._version(m).stats for m in ("py_scale", "ens", "slow", "slow_ens")}
            totals = {m: server.statistics(m)["model_stats"][0]["inference_stats"]["fail"]["count"] for m in stats}
            return {m: s.failures() for m, s in stats.items()}, totals

    failures, totals = run(main())
    assert failures == {
        "py_scale": _counts(BACKEND=2),  # its error response, called alone and as the ensemble's step
        "ens": _counts(OTHER=1, REJECTED=1),
        "slow": _counts(BACKEND=1, CANCELED=1),  # past its execution timeout; its caller (the ensemble) left
        "slow_ens": _counts(CANCELED=1),
    }
    assert totals == {m: sum(f.values()) for m, f in failures.items()}  # `fail` is every reason's total
