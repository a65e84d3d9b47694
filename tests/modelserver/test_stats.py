"""Statistics extension fields and the Prometheus metrics (Triton's names under strata:) agree with the traffic."""

from __future__ import annotations

import asyncio

import numpy as np
import prometheus_client
from _model_repos import add_onnx_mlp, add_python_scale
from ms_helpers import expect_error, request, run, serving


def test_statistics_and_prometheus_metrics(tmp_path):
    add_onnx_mlp(tmp_path, versions=(1, 2), config='platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
                 'version_policy: { all: {} }\ndynamic_batching { max_queue_delay_microseconds: 20000 }')
    add_python_scale(tmp_path)
    registry = prometheus_client.CollectorRegistry()
    xs = [np.ones((2, 4), np.float32)] * 6

    async def main():
        async with serving(tmp_path, registry=registry) as server:
            await asyncio.gather(*(server.infer(request("onnx_mlp", "2", INPUT0=x)) for x in xs))
            await server.infer(request("onnx_mlp", "1", INPUT0=xs[0]))
            await expect_error("invalid_argument", server.infer(request("onnx_mlp", "1", INPUT0=np.ones((1, 5), np.float32))),
                               "shape")
            stats = server.statistics()
            one = server.statistics("onnx_mlp", "2")
            text = prometheus_client.generate_latest(registry).decode()
            samples = {(m.name, s.labels.get("version")): s.value for m in registry.collect() for s in m.samples
                       if s.labels.get("model") == "onnx_mlp" and "reason" not in s.labels}
            failures = {(s.labels["version"], s.labels["reason"]): s.value for m in registry.collect()
                        for s in m.samples if s.name == "strata:inference_request_failure"
                        and s.labels.get("model") == "onnx_mlp"}
            return stats, one, text, samples, failures

    stats, one, text, samples, failures = run(main())
    by_key = {(s["name"], s["version"]): s for s in stats["model_stats"]}
    assert set(by_key) == {("onnx_mlp", "1"), ("onnx_mlp", "2"), ("py_scale", "1")}
    v2 = by_key[("onnx_mlp", "2")]
    assert one["model_stats"] == [v2]
    assert v2["inference_count"] == 12 and v2["inference_stats"]["success"]["count"] == 6
    assert v2["execution_count"] < 6  # batched
    assert v2["last_inference"] > 0 and v2["inference_stats"]["queue"]["count"] == 6
    for phase in ("compute_input", "compute_infer", "compute_output"):
        assert v2["inference_stats"][phase]["count"] == 6
        assert sum(b[phase]["count"] for b in v2["batch_stats"]) == v2["execution_count"]
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in v2["batch_stats"]) == 12
    v1 = by_key[("onnx_mlp", "1")]
    assert v1["inference_stats"]["fail"]["count"] == 1 and v1["inference_stats"]["success"]["count"] == 1

    def value(name, version="2"):
        return samples.get((name, version))

    assert value("strata:inference_request_success") == 6
    # the bad shape was refused before it ran: Triton's REJECTED; every reason has its series, zeros included
    assert failures == {(v, r): float(v == "1" and r == "REJECTED") for v in ("1", "2")
                        for r in ("REJECTED", "CANCELED", "BACKEND", "OTHER")}
    assert value("strata:inference_count") == 12
    assert value("strata:inference_exec_count") == v2["execution_count"]
    assert value("strata:inference_pending_request_count") == 0
    assert value("strata:inference_queue_duration_us") == v2["inference_stats"]["queue"]["ns"] // 1000
    assert value("strata:inference_request_duration_us") == v2["inference_stats"]["success"]["ns"] // 1000 > 0
    assert value("strata:inference_compute_infer_duration_us") == v2["inference_stats"]["compute_infer"]["ns"] // 1000
    for name in ("compute_input", "compute_output"):
        assert value(f"strata:inference_{name}_duration_us") is not None
    assert "# TYPE strata:inference_request_success untyped" in text
    assert 'strata:inference_count{model="onnx_mlp",version="2"} 12.0' in text


def test_statistics_errors_and_registry_cleanup(tmp_path):
    add_python_scale(tmp_path)
    registry = prometheus_client.CollectorRegistry()

    async def main():
        async with serving(tmp_path, registry=registry) as server:
            for args, code, what in ((("ghost",), "not_found", "unknown model 'ghost'"),
                                     (("py_scale", "3"), "not_found", "no ready version 3"),
                                     (("", "1"), "invalid_argument", "needs a model name")):
                try:
                    server.statistics(*args)
                except Exception as e:  # noqa: BLE001
                    assert e.code == code and what in e.message
                else:
                    raise AssertionError(f"statistics{args} did not fail")
            assert registry.get_sample_value("strata:inference_count", {"model": "py_scale", "version": "1"}) == 0
        # Stopping the server unregisters its collector, so a new server can use the same registry.
        async with serving(tmp_path, registry=registry):
            pass

    run(main())
