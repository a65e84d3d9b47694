"""pb_utils APIs beyond requests and responses: Logger, custom metrics (MetricFamily), BLS model management,
and a JSON config override on load that carries Triton-only blocks."""

from __future__ import annotations

import json
import logging

import numpy as np
import prometheus_client
from _model_repos import write_python_model
from ms_helpers import expect_error, outputs, request, run, serving

ISOLATED = '\nparameters { key: "EXECUTION_ISOLATION" value: { string_value: "process" } }\n'
IO = 'backend: "python"\nmax_batch_size: 0\ninput [ { name: "N" data_type: TYPE_INT32 dims: [1] } ]\n' \
     'output [ { name: "P" data_type: TYPE_STRING dims: [1] } ]\n'

PROBE = """
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.count = pb_utils.MetricFamily(name="probe_requests", description="requests seen",
                                               kind=pb_utils.MetricFamily.COUNTER).Metric(labels={"model": "probe"})
            self.gauge = pb_utils.MetricFamily(name="probe_level", description="a level",
                                               kind=pb_utils.MetricFamily.GAUGE).Metric(labels={"k": "v"})
            self.hist = pb_utils.MetricFamily(name="probe_latency", description="latency",
                kind=pb_utils.MetricFamily.HISTOGRAM).Metric(labels={"k": "v"}, buckets=[0.1, 1.0])

        def execute(self, requests):
            L = pb_utils.Logger
            L.log_info("MARK-INFO")
            L.log("MARK-WARNING", L.WARNING)
            L.log("MARK-VERBOSE", L.VERBOSE)
            L.log("MARK-DEFAULT")
            self.count.increment(1)
            self.gauge.set(7.5)
            self.hist.observe(0.5)
            info = {"count": self.count.value(), "gauge": self.gauge.value()}
            try:
                self.count.set(3)
            except pb_utils.TritonModelException as e:
                info["counter_set"] = str(e)
            mode = int(pb_utils.get_input_tensor_by_name(requests[0], "N").as_numpy()[0])
            if mode == 1:  # BLS model management (explicit control mode only)
                info["ready_before"] = pb_utils.is_model_ready(model_name="other")
                try:
                    pb_utils.load_model(model_name="other")
                    info["ready_loaded"] = pb_utils.is_model_ready("other")
                    pb_utils.unload_model("other")
                    info["ready_unloaded"] = pb_utils.is_model_ready("other")
                except pb_utils.TritonModelException as e:
                    info["load_error"] = str(e)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("P", np.array([json.dumps(info).encode()],
                                                                                dtype=object))]) for _ in requests]
"""

OTHER = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("P", np.array([b"x"], dtype=object))])
                    for _ in requests]
"""

ISOLATED_METRIC = """
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            pb_utils.MetricFamily(name="m", description="d", kind=pb_utils.MetricFamily.GAUGE)
"""


def test_logger_metrics_and_model_management(tmp_path, caplog):
    write_python_model(tmp_path, "probe", PROBE, IO)
    write_python_model(tmp_path, "other", OTHER, IO)
    write_python_model(tmp_path, "iso_metric", ISOLATED_METRIC, IO + ISOLATED)
    registry = prometheus_client.CollectorRegistry()

    async def main():
        results = {}
        for mode in ("explicit", "none"):
            kwargs = {"load_models": ["probe", "iso_metric"]} if mode == "explicit" else {}
            async with serving(tmp_path, control_mode=mode, registry=registry, **kwargs) as server:
                results[mode] = json.loads(outputs(await server.infer(request("probe", N=np.array([1], np.int32))))
                                           ["P"][0])
                if mode == "explicit":
                    results["metrics"] = prometheus_client.generate_latest(registry).decode()
                    results["index"] = {e["name"]: e for e in server.repository_index()}
        return results

    with caplog.at_level(logging.INFO, logger="strataserve.model"):
        results = run(main())
    explicit, none = results["explicit"], results["none"]
    assert explicit["count"] == 1.0 and explicit["gauge"] == 7.5 and "only for GAUGE" in explicit["counter_set"]
    assert explicit["ready_before"] is False and explicit["ready_loaded"] is True
    assert explicit["ready_unloaded"] is False
    assert "control mode is 'none'" in none["load_error"]
    metrics = results["metrics"]
    assert 'probe_requests{model="probe"} 1.0' in metrics and 'probe_level{k="v"} 7.5' in metrics
    assert 'probe_latency_bucket{k="v",le="1.0"} 1.0' in metrics and 'probe_latency_bucket{k="v",le="0.1"} 0.0' in metrics
    iso = results["index"]["iso_metric"]
    assert iso["state"] == "UNAVAILABLE" and "EXECUTION_ISOLATION 'process'" in iso["reason"]
    logs = [(r.name, r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("strataserve.model")]
    assert ("strataserve.model.probe", logging.INFO, "MARK-INFO") in logs
    assert ("strataserve.model.probe", logging.WARNING, "MARK-WARNING") in logs
    assert ("strataserve.model.probe", logging.INFO, "MARK-DEFAULT") in logs
    assert not any(m == "MARK-VERBOSE" for _, _, m in logs)  # VERBOSE is DEBUG: off by default, as in Triton


def test_json_config_override_skips_triton_only_blocks(tmp_path):
    write_python_model(tmp_path, "other", OTHER, IO)

    async def main():
        async with serving(tmp_path, control_mode="explicit", load_models=["other"]) as server:
            base = server.model_config("other")
            override = {**base, "max_batch_size": 0, "model_warmup": [{"name": "w", "batch_size": 1}],
                        "optimization": {"input_pinned_memory": {"enable": True}}, "batch_input": []}
            await server.load("other", {"config": json.dumps(override)})
            ready = server.model_ready("other")
            await expect_error("invalid_argument", server.load("other", {"config": json.dumps(
                {**base, "sequence_batching": {"max_sequence_idle_microseconds": 5}})}), "sequence batching")
            return ready

    assert run(main()) is True
