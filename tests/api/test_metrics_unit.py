"""The lock-free loop histogram exposes exactly what prometheus-client's own Histogram would."""
from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from strataserve.api.metrics import LoopHistogram, ServerMetrics, _token_buckets
from strataserve.types.outputs import CompletionOutput, RequestOutput


def _samples(registry: CollectorRegistry, name: str) -> dict:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) if fam.name == name for s in fam.samples}


def test_loop_histogram_matches_prometheus_histogram():
    buckets = (0.01, 0.1, 0.5, 1.0, 5.0)
    ref_reg = CollectorRegistry()
    ref = Histogram("strata:x_seconds", "doc", ["model_name"], buckets=buckets, registry=ref_reg).labels("m")
    ours = LoopHistogram("strata:x_seconds", "doc", buckets)
    rng = random.Random(0)
    values = [rng.choice([0.0, 0.01, 0.1, 1.0, 5.0, 7.0]) for _ in range(50)] + [rng.random() * 6 for _ in range(200)]
    for v in values:
        ref.observe(v)
        ours.observe(v)

    class One:
        def collect(self):
            yield ours.family(["m"])

    our_reg = CollectorRegistry()
    our_reg.register(One())
    want = {k: v for k, v in _samples(ref_reg, "strata:x_seconds").items() if not k[0].endswith("_created")}
    assert _samples(our_reg, "strata:x_seconds") == want


def test_request_timer_feeds_counters_and_histograms():
    m = ServerMetrics("m", 100, lambda: None)
    t = m.track(7)
    t.on_output(RequestOutput("r", None, [1] * 7, [CompletionOutput(0, "", [5])], False))
    t.on_output(RequestOutput("r", None, [1] * 7, [CompletionOutput(0, "", [5, 6], finish_reason="length")], True))
    t.finish()
    m.success("length")
    s = {(x.name, tuple(sorted(x.labels.items()))): x.value
         for fam in text_string_to_metric_families(generate_latest(m.registry).decode()) for x in fam.samples}
    assert s[("strata:prompt_tokens_total", (("model_name", "m"),))] == 7
    assert s[("strata:generation_tokens_total", (("model_name", "m"),))] == 3
    assert s[("strata:request_success_total", (("finished_reason", "length"), ("model_name", "m")))] == 1
    assert s[("strata:inter_token_latency_seconds_count", (("model_name", "m"),))] == 1
    assert s[("strata:request_generation_tokens_sum", (("model_name", "m"),))] == 3
    assert s[("strata:num_requests_running", (("model_name", "m"),))] == 0  # no stats yet: zeros, not an error


def test_token_buckets_cover_the_context():
    assert _token_buckets(512) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)


def test_engine_counters_stay_monotonic_across_an_engine_restart():
    """A restarted engine counts from zero again (and none reports while it starts): the exported counters carry
    what the old one counted, so rate() never sees a counter going down."""
    from strataserve.types.protocol import SchedulerStats

    readings = iter([SchedulerStats(num_total_blocks=8, prefix_cache_queries=15, num_preemptions=2), None,
                     SchedulerStats(num_total_blocks=8, prefix_cache_queries=0),
                     SchedulerStats(num_total_blocks=8, prefix_cache_queries=4, num_preemptions=1)])
    reg = CollectorRegistry()
    ServerMetrics("m", 64, lambda: next(readings), reg)
    seen = []
    for _ in range(4):  # one scrape per reading
        values = {fam.name: fam.samples[0].value
                  for fam in text_string_to_metric_families(generate_latest(reg).decode())
                  if fam.name in ("strata:prefix_cache_queries", "strata:num_preemptions")}
        seen.append((values["strata:prefix_cache_queries"], values["strata:num_preemptions"]))
    assert seen == [(15, 2), (15, 2), (15, 2), (19, 3)]
