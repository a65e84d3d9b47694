"""pb_utils APIs beyond requests and responses: Logger, custom metrics (MetricFamily), BLS model management,
and a JSON config override on load that carries Triton-only blocks."""

from __future__ import annotations

import asyncio
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


RULES = """
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils


    def refused(make):
        try:
            make()
        except pb_utils.TritonModelException as e:
            return str(e)
        return None


    class TritonPythonModel:
        def initialize(self, args):
            F = pb_utils.MetricFamily
            self.seen = F(name="rules_seen", description="d", kind=F.COUNTER).Metric(labels={"m": "x"})
            self.errors = {
                "reserved": refused(lambda: F(name="strata:inference_request_success", description="d", kind=F.COUNTER)),
                "bad_name": refused(lambda: F(name="bad name-1", description="d", kind=F.GAUGE)),
                "bad_label": refused(lambda: F(name="rules_g", description="d", kind=F.GAUGE).Metric(labels={"0x-y": "v"})),
                "dup_buckets": refused(lambda: F(name="rules_h", description="d", kind=F.HISTOGRAM).Metric(buckets=[1, 1, 2])),
                "unsorted": refused(lambda: F(name="rules_h", description="d", kind=F.HISTOGRAM).Metric(buckets=[2, 1])),
                "no_buckets": refused(lambda: F(name="rules_h", description="d", kind=F.HISTOGRAM).Metric(buckets=[])),
            }

        def execute(self, requests):
            self.seen.increment(1)
            out = json.dumps({"errors": self.errors, "seen": self.seen.value()})
            return [pb_utils.InferenceResponse([pb_utils.Tensor("P", np.array([out.encode()], dtype=object))])
                    for _ in requests]
"""


def test_metric_names_buckets_and_lifetime_follow_triton(tmp_path):
    """Names in the server's namespaces, non-Prometheus names and labels, and duplicate or unsorted buckets are
    refused (they made /metrics unscrapable); buckets=[] is allowed (+Inf only); a model's families leave
    /metrics when it is unloaded, and a reload counts from zero."""
    write_python_model(tmp_path, "rules", RULES, IO)
    registry = prometheus_client.CollectorRegistry()

    async def main():
        async with serving(tmp_path, control_mode="explicit", registry=registry, load_models=["rules"]) as server:
            first = json.loads(outputs(await server.infer(request("rules", N=np.array([1], np.int32))))["P"][0])
            await server.infer(request("rules", N=np.array([1], np.int32)))
            loaded = prometheus_client.generate_latest(registry).decode()
            await server.unload("rules")
            for _ in range(500):  # the instances close after unload returns (in-flight requests drain first)
                unloaded = prometheus_client.generate_latest(registry).decode()
                if "rules_seen" not in unloaded:
                    break
                await asyncio.sleep(0.01)
            await server.load("rules")
            again = json.loads(outputs(await server.infer(request("rules", N=np.array([1], np.int32))))["P"][0])
        return first, loaded, unloaded, again

    first, loaded, unloaded, again = run(main())
    errors = first["errors"]
    assert "server's own metrics" in errors["reserved"] and "Prometheus metric name" in errors["bad_name"]
    assert "label name" in errors["bad_label"]
    assert "strictly increasing" in errors["dup_buckets"] and "strictly increasing" in errors["unsorted"]
    assert errors["no_buckets"] is None
    assert 'rules_seen{m="x"} 2.0' in loaded and "rules_seen" not in unloaded
    assert loaded.count("# TYPE strata:inference_request_success ") <= 1
    assert again["seen"] == 1.0  # a fresh family after the reload


def test_a_cancelled_background_execution_fails_its_requests():
    """An async decoupled execution the server cancels (it is stopping) ends its requests with an error instead of
    leaving their streams open."""
    import time

    from strataserve.modelserver import pb_runtime

    loop = pb_runtime.InstanceLoop(pb_runtime.ModelContext(None, "m"), "m_0")
    errors = []
    loop.spawn(asyncio.sleep(30), errors.append)
    time.sleep(0.05)
    loop.close()
    deadline = time.monotonic() + 5
    while not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert errors and "cancelled" in str(errors[0])


def test_an_unloaded_version_is_freed_without_waiting_for_the_garbage_collector(tmp_path):
    """Unloading drops the last reference to the version's scheduler (the cancelled worker tasks' tracebacks held
    it in a cycle, so every unloaded model lived until a full collection; `strata serve` freezes its start-up heap
    and collects rarely)."""
    import gc
    import weakref

    write_python_model(tmp_path, "probe", PROBE, IO)

    async def main():
        async with serving(tmp_path, control_mode="explicit", load_models=["probe"]) as server:
            await server.infer(request("probe", N=np.array([1], np.int32)))
            ref = weakref.ref(server._version("probe").scheduler)
            gc.collect()
            gc.disable()
            try:
                await server.unload("probe")
                for _ in range(500):
                    if ref() is None:
                        break
                    await asyncio.sleep(0.01)
                return ref() is None
            finally:
                gc.enable()

    assert run(main())
