"""Operations fixes, without a server: rate-limit refusals in /metrics, --served-model-name aliases, the protocol
default max_tokens under a lower --limit-max-tokens, a quiet 503 for a body cut off by the shutdown, and the
per-sequence request histograms of an n > 1 request."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from strataserve.api.door import Door, DoorConfig
from strataserve.api.errors import APIError
from strataserve.api.limits import RequestLimits
from strataserve.api.metrics import ServerMetrics
from strataserve.api.middleware import GuardMiddleware
from strataserve.api.protocol import CompletionRequest
from strataserve.api.rate_metrics import CountingQuota
from strataserve.router.aliases import AliasRouter
from strataserve.cli import _serve_options, build_parser
from strataserve.router.quota import RateLimits
from strataserve.router.sla import SLA, SLAPolicy
from strataserve.router.types import Backend, ModelCard, Payload
from strataserve.types.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _samples(registry: CollectorRegistry) -> dict:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# ---------------------------------------------------------------- rate limits in /metrics
def test_rate_limit_refusals_are_counted_by_kind_and_key_class():
    registry = CollectorRegistry()
    policy = SLAPolicy({"default": SLA("default"), "batch": SLA("batch", 10)}, "default", {"bk": "batch"})
    quota = CountingQuota(RateLimits(requests_per_minute=2, tokens_per_minute=100), registry, policy)
    door = Door(DoorConfig(("k", "bk"), rate=quota.limits), quota)

    def series(kind: str, sla_class: str) -> float:
        return _samples(registry)[("strata:rate_limited_requests_total",
                                   (("kind", kind), ("sla_class", sla_class)))]

    assert series("requests_per_minute", "batch") == 0  # there at 0 before any refusal, for rate() and alerts
    for _ in range(2):
        door.admit("Bearer bk", 0)
    for _ in range(3):
        with pytest.raises(APIError) as err:
            door.admit("Bearer bk", 0)
        assert err.value.status == 429
    door.admit("Bearer k", 0)  # another key, its own allowance: no refusal
    assert series("requests_per_minute", "batch") == 3 and series("requests_per_minute", "default") == 0
    quota.take_tokens("k", 90)
    with pytest.raises(APIError):
        quota.take_tokens("k", 20)  # 429: the minute's tokens are spent
    with pytest.raises(APIError) as err:
        quota.take_tokens("k", 500)  # 400: more than a minute's allowance, not a rate limit
    assert err.value.status == 400
    assert series("tokens_per_minute", "default") == 1


# ---------------------------------------------------------------- --served-model-name NAME ALIAS
class _Backend(Backend):
    payload = Payload.TEXT

    def ready(self) -> bool:
        return True

    def card(self) -> ModelCard:
        return ModelCard(name=self.name, payload=self.payload, backend="test", ready=True)


def test_every_served_name_routes_to_the_model():
    router = AliasRouter()
    main = _Backend("main")
    router.add(main)
    router.add_alias("alias", "main")
    assert router.resolve("alias", Payload.TEXT) is main and router.resolve("main", Payload.TEXT) is main
    assert router.resolve(None, Payload.TEXT) is main  # one model: a request may name none, aliases or not
    assert router.names() == ["main", "alias"] and router.aliases_of("main") == ["alias"]
    assert [c.name for c in router.cards()] == ["main"]  # one backend: its metrics and health stay one
    with pytest.raises(APIError) as err:
        router.resolve("other", Payload.TEXT)
    assert err.value.status == 404 and "alias" in err.value.message
    with pytest.raises(ValueError):
        router.add_alias("main", "main")
    with pytest.raises(ValueError):
        router.add(_Backend("alias"))


def test_served_model_name_takes_several_names_as_vllm():
    console = Console(file=open("/dev/null", "w"))
    args = build_parser(["serve"]).parse_args(["serve", "--served-model-name", "main", "alias", "--grpc-port", "0"])
    (spec,) = _serve_options(args, console).llms
    assert spec.name == "main" and spec.aliases == ("alias",) and spec.engine.model.served_model_name == "main"
    args = build_parser(["serve"]).parse_args(["serve", "--served-model-name", "a", "a"])
    assert _serve_options(args, console) is None  # a name given twice


# ---------------------------------------------------------------- --limit-max-tokens below the protocol's 16
def test_an_unset_completions_budget_is_held_to_a_lower_limit():
    limits = RequestLimits(max_tokens=10)
    body = CompletionRequest(model="m", prompt="x")  # max_tokens: the protocol's default 16, not the client's
    limits.check(body)
    assert body.max_tokens == 10
    with pytest.raises(APIError) as err:
        limits.check(CompletionRequest(model="m", prompt="x", max_tokens=16))  # the client's 16 is still refused
    assert err.value.status == 400 and err.value.param == "max_tokens"
    body = CompletionRequest(model="m", prompt="x", max_tokens=8)
    limits.check(body)
    assert body.max_tokens == 8


# ---------------------------------------------------------------- shutdown while a body is half sent
def test_a_body_cut_off_by_the_shutdown_gets_a_quiet_503():
    door = Door()
    sent: list[dict] = []

    async def app(scope, receive, send):  # never reached: the body does not arrive
        raise AssertionError("the app ran")

    async def receive():
        door.begin_drain()  # the drain's time is up while the client is still sending: the server cancels
        raise asyncio.CancelledError

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-length", b"1000"), (b"content-type", b"application/json")]}
    asyncio.run(GuardMiddleware(app, door=door)(scope, receive, send))  # no CancelledError out of it
    assert sent[0]["status"] == 503 and b"server_shutdown" in sent[1]["body"]
    assert door.inflight == 0 and door.queued_bytes == 0


def test_a_cancel_outside_a_drain_still_propagates():
    async def receive():
        raise asyncio.CancelledError

    async def send(message):
        raise AssertionError("nothing is sent")

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", b"5")]}
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(GuardMiddleware(lambda *a: None, door=Door())(scope, receive, send))


# ---------------------------------------------------------------- n > 1: each sequence is a request
def _out(tokens: dict[int, int], finished: dict[int, str] | None = None, done: bool = False) -> RequestOutput:
    finished = finished or {}
    return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(i, "", [5] * n, finish_reason=finished.get(i))
                                               for i, n in tokens.items()], done)


def test_each_parallel_sample_counts_as_a_request_in_the_histograms():
    m = ServerMetrics("m", 100, lambda: None)
    t = m.track(3, n=2)
    t.on_output(_out({0: 1, 1: 1}))
    t.on_output(_out({0: 1, 1: 1}, {0: "stop"}))
    t.on_output(_out({1: 2}, {1: "length"}, done=True))
    t.finish(RequestMetrics(arrival_time=1.0, first_scheduled_time=1.1, first_token_time=1.2, finished_time=1.5))
    for reason in ("stop", "length"):
        m.success(reason)
    s, label = _samples(m.registry), (("model_name", "m"),)
    success = sum(v for (name, _), v in s.items() if name == "strata:request_success_total")
    for hist in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_generation_tokens",
                 "request_prompt_tokens", "request_queue_time_seconds", "request_decode_time_seconds"):
        assert s[(f"strata:{hist}_count", label)] == success == 2, hist
    assert s[("strata:request_generation_tokens_sum", label)] == s[("strata:generation_tokens_total", label)] == 6
    assert s[("strata:prompt_tokens_total", label)] == s[("strata:request_prompt_tokens_sum", label)] == 6


def test_an_aborted_parallel_request_counts_every_sequence():
    m = ServerMetrics("m", 100, lambda: None)
    t = m.track(3, n=3)
    t.on_output(_out({0: 1}))
    t.finish()  # cancelled: no sequence finished
    s = _samples(m.registry)
    assert s[("strata:e2e_request_latency_seconds_count", (("model_name", "m"),))] == 3
    assert s[("strata:time_to_first_token_seconds_count", (("model_name", "m"),))] == 1  # only one got a token
