"""OpenAIUpstreamBackend's failure policy against fake upstream replicas on loopback (aiohttp): a request that makes
its upstream drop the connection is tried once elsewhere and takes no replica out of rotation, 5xx before the body
goes to another replica, a 200 that is not JSON is the upstream's fault, and a non-streamed request stops counting
as queued work for admission at its expected first-token time."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from router_servers import serve_aiohttp

from strataserve.api.errors import APIError
from strataserve.router.admission import MIN_SAMPLES, AdmissionController
from strataserve.router.backends.openai_upstream import OpenAIUpstreamBackend
from strataserve.router.config import OpenAIUpstream
from strataserve.router.metrics import RouterMetrics, RouteTrace

OK = {"id": "x", "object": "chat.completion", "model": "remote-m", "usage": {"completion_tokens": 2},
      "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}


def _replica(name: str, hits: dict, faults: dict):
    """A replica answering OK, or with the fault ``faults[name]`` ("drop", a status code, "html", "malformed")
    when the request's body says ``"poison": true`` or the fault is set for every request (``faults["all"]``)."""
    async def handler(request):
        body = await request.json()
        hits[name] = hits.get(name, 0) + 1
        fault = faults.get(name) if body.get("poison") or faults.get("all") else None
        if fault == "drop":
            request.transport.close()
            await asyncio.sleep(0.05)
            return web.Response()
        if isinstance(fault, int):
            return web.json_response({"error": {"message": f"{name} says {fault}"}}, status=fault,
                                     headers={"Retry-After": "7"})
        if fault == "html":
            return web.Response(text="<html><body>502 Bad Gateway</body></html>", content_type="text/html")
        if fault == "malformed":
            return web.Response(text='{"id": "x", "choices": [', content_type="application/json")
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"model":"remote-m","choices":[{"index":0,"text":"' + name.encode() +
                             b'"}]}\n\ndata: [DONE]\n\n')
            return resp
        return web.json_response({**OK, "served_by": name})
    return handler


async def _cluster(names: list[str], faults: dict) -> tuple[OpenAIUpstreamBackend, dict, list]:
    hits: dict[str, int] = {}
    runners, urls = [], []
    for n in names:
        runner, url = await serve_aiohttp(_replica(n, hits, faults))
        runners.append(runner)
        urls.append(url)
    spec = OpenAIUpstream(name="m", upstream="openai", url=urls, upstream_model="remote-m", timeout_s=3)
    return OpenAIUpstreamBackend(spec), hits, runners


async def _close(b: OpenAIUpstreamBackend, runners: list) -> None:
    await b.stop()
    for r in runners:
        await r.cleanup()


async def _ask(b: OpenAIUpstreamBackend, metrics: RouterMetrics, *, stream: bool = False, **body):
    """(status, body text) of one request; an APIError is its status and message."""
    trace = RouteTrace(metrics, b.name, "default", b.cost)
    try:
        resp = await b.forward("/v1/completions", {"model": "m", "prompt": "x", "stream": stream, **body},
                               stream=stream, prefix=None, trace=trace, first_events=0)
    except APIError as exc:
        return exc.status, exc.message
    data = b"".join([c async for c in resp.body_iterator]) if stream else resp.body
    return resp.status_code, data.decode()


def test_a_query_of_death_is_tried_once_more_and_takes_no_replica_down():
    """A request that makes its upstream drop the connection reached every replica and marked each down: every
    other client then got 503. Now: one retry on another replica, a 502 for that request alone, all replicas
    still in rotation, and the next client is served."""
    async def run():
        b, hits, runners = await _cluster(["a", "b", "c"], {"a": "drop", "b": "drop", "c": "drop"})
        metrics = RouterMetrics(None)
        try:
            bad = await _ask(b, metrics, poison=True)
            healthy = [r.healthy for r in b.replicas.replicas]
            good = [await _ask(b, metrics) for _ in range(3)]
            return bad, dict(hits), healthy, good, metrics.of("m", "default").outcomes
        finally:
            await _close(b, runners)

    bad, hits, healthy, good, outcomes = asyncio.run(run())
    assert bad[0] == 502 and "closed the connection" in bad[1]
    assert sum(hits.values()) == 2 + 3  # the poison reached two replicas of three, then the three good ones
    assert healthy == [True, True, True]
    assert [g[0] for g in good] == [200, 200, 200]
    assert outcomes["upstream_error"] == 1 and outcomes["ok"] == 3


def test_a_replica_that_keeps_dropping_requests_is_taken_out():
    """Five failed requests in a row (no success between) do mark a replica down, as Envoy's outlier detection;
    the requests themselves were served by the other replica."""
    async def run():
        b, hits, runners = await _cluster(["a", "b"], {"a": "drop", "all": True})
        b.replicas.replicas[1].outstanding = 100  # least-outstanding keeps choosing `a` while it is up
        metrics = RouterMetrics(None)
        try:
            statuses = [(await _ask(b, metrics))[0] for _ in range(6)]
            return statuses, [r.healthy for r in b.replicas.replicas], dict(hits)
        finally:
            b.replicas.replicas[1].outstanding = 0
            await _close(b, runners)

    statuses, healthy, hits = asyncio.run(run())
    assert statuses == [200] * 6 and healthy == [False, True]
    assert hits["a"] == 5  # the sixth request no longer went to it


@pytest.mark.parametrize("status", [500, 502, 503, 504])
@pytest.mark.parametrize("stream", [False, True])
def test_a_5xx_before_the_body_is_served_by_another_replica(status, stream):
    async def run():
        b, hits, runners = await _cluster(["a", "b"], {"a": status, "all": True})
        b.replicas.replicas[1].outstanding = 1  # `a` first
        metrics = RouterMetrics(None)
        try:
            got = await _ask(b, metrics, stream=stream)
            return got, [r.healthy for r in b.replicas.replicas], dict(hits)
        finally:
            b.replicas.replicas[1].outstanding = 0
            await _close(b, runners)

    (code, text), healthy, hits = asyncio.run(run())
    assert code == 200 and (('"text":"b"' in text) if stream else json.loads(text)["served_by"] == "b")
    assert hits == {"a": 1, "b": 1} and healthy == [True, True]


def _ask_a_first(faults: dict) -> tuple:
    """((status, text) of one request, hits) on replicas a and b, least-outstanding choosing a first."""
    async def run():
        b, hits, runners = await _cluster(["a", "b"], faults)
        b.replicas.replicas[1].outstanding = 1
        try:
            return await _ask(b, RouterMetrics(None)), dict(hits)
        finally:
            b.replicas.replicas[1].outstanding = 0
            await _close(b, runners)

    return asyncio.run(run())


@pytest.mark.parametrize("status", [400, 429, 501])
def test_other_statuses_are_not_retried(status):
    (code, _), hits = _ask_a_first({"a": status, "all": True})
    assert code == (status if status < 500 else 502) and hits == {"a": 1}


def test_when_every_replica_fails_the_last_upstream_error_is_the_answer():
    (code, message), hits = _ask_a_first({"a": 503, "b": 500, "all": True})
    assert code == 502 and "b says 500" in message and hits == {"a": 1, "b": 1}


@pytest.mark.parametrize("fault", ["html", "malformed"])
def test_a_200_that_is_not_json_is_the_upstreams_fault(fault):
    async def run():
        b, hits, runners = await _cluster(["a"], {"a": fault, "all": True})
        metrics = RouterMetrics(None)
        try:
            return await _ask(b, metrics), metrics.of("m", "default").outcomes
        finally:
            await _close(b, runners)

    (code, message), outcomes = asyncio.run(run())
    assert code == 502 and "model `m`" in message and "not JSON" in message
    assert outcomes["upstream_error"] == 1 and outcomes["ok"] == 0


def test_a_non_streamed_request_stops_counting_as_queued_at_its_expected_first_token():
    """A whole answer shows no first token: it counted as prefill work ahead until its answer came, so 30 of them
    in flight made the router refuse a stream the upstream serves in time. Now it leaves the queue when the learnt
    pace says a stream would have had its first token, and gives no TTFT sample."""
    async def slow(request):
        await asyncio.sleep(1.5)  # a long generation, answered whole
        return web.json_response(OK)

    async def run():
        runner, url = await serve_aiohttp(slow)
        spec = OpenAIUpstream(name="m", upstream="openai", url=[url], upstream_model="remote-m", timeout_s=5)
        b, metrics = OpenAIUpstreamBackend(spec), RouterMetrics(None)
        ctl = AdmissionController("m")
        ctl.seconds_per_work, ctl.samples = 0.05, MIN_SAMPLES  # learnt from streams: 50 ms to a first token
        try:
            tasks = []
            for _ in range(10):
                trace = RouteTrace(metrics, b.name, "default", b.cost, ctl, ctl.enter(0, 1.0))
                tasks.append(asyncio.ensure_future(b.forward("/v1/completions", {"model": "m"}, stream=False,
                                                             prefix=None, trace=trace)))
            await asyncio.sleep(0.1)
            early = ctl.work_ahead(0)
            await asyncio.sleep(0.6)  # past 10 x 50 ms: each would have had its first token
            late = ctl.work_ahead(0)
            ctl.check(0, 1.0, ttft_ms=300)  # a stream with a 300 ms target is admitted
            done = await asyncio.gather(*tasks)
            return early, late, [r.status_code for r in done], ctl.samples, sum(metrics.of("m", "default").ttft.counts)
        finally:
            await b.stop()
            await runner.cleanup()

    early, late, statuses, samples, ttfts = asyncio.run(run())
    assert 0 < early < 10  # the later ones are still within their expected queueing time
    assert late == 0 and statuses == [200] * 10
    assert samples == MIN_SAMPLES and ttfts == 0  # no made-up first-token time
