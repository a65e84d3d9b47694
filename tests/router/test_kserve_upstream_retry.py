"""KServeUpstreamBackend follows the upstream failure policy of ``upstream_retry.py`` (as the OpenAI upstream
does): an infer that makes its upstream drop the connection is tried once on another replica and takes no replica
out of rotation; a replica that cannot be reached is marked down and the call goes to the next one."""
from __future__ import annotations

import asyncio

import numpy as np
from aiohttp import web
from router_servers import free_port, serve_aiohttp

from strataserve.router.backends.kserve_upstream import KServeUpstreamBackend
from strataserve.router.config import KServeUpstream
from strataserve.types.tensors import InferRequest, InferTensor, ModelServerError


def _replica(name: str, hits: dict):
    """A KServe replica of model ``remote`` answering y = [its index]; a request whose id is "poison" makes it
    close the connection without answering."""
    async def infer(request):
        body = await request.read()
        hits[name] = hits.get(name, 0) + 1
        if b'"poison"' in body:
            request.transport.close()
            await asyncio.sleep(0.05)
            return web.Response()
        return web.json_response({"model_name": "remote", "outputs": [
            {"name": "y", "datatype": "INT32", "shape": [1], "data": [ord(name)]}]})
    return infer


async def _cluster(names: list[str], extra_urls: tuple[str, ...] = ()):
    hits: dict[str, int] = {}
    runners, urls = [], list(extra_urls)
    for n in names:
        runner, url = await serve_aiohttp(_replica(n, hits))
        runners.append(runner)
        urls.append(url)
    spec = KServeUpstream(name="m", upstream="kserve", url=urls, upstream_model="remote", timeout_s=3,
                          connect_timeout_s=1)
    return KServeUpstreamBackend(spec), hits, runners


def _request(rid: str) -> InferRequest:
    return InferRequest(model_name="m", id=rid, inputs=[InferTensor("x", "INT32", [1], np.array([1], np.int32))])


async def _close(b, runners) -> None:
    await b.stop()
    for r in runners:
        await r.cleanup()


def test_a_dropped_infer_is_tried_once_more_and_takes_no_replica_down():
    async def run():
        b, hits, runners = await _cluster(["a", "b", "c"])
        try:
            try:
                await b.infer(_request("poison"))
                bad = None
            except ModelServerError as exc:
                bad = exc
            poisoned = dict(hits)
            healthy = [r.healthy for r in b.replicas.replicas]
            good = [await b.infer(_request(str(i))) for i in range(3)]
            return bad, poisoned, healthy, good
        finally:
            await _close(b, runners)

    bad, poisoned, healthy, good = asyncio.run(run())
    assert bad is not None and bad.http_status == 502 and "closed the connection" in bad.message
    assert sum(poisoned.values()) == 2  # two replicas of three saw it, not all
    assert healthy == [True, True, True]
    assert all(r.outputs[0].data.tolist()[0] in (ord("a"), ord("b"), ord("c")) for r in good)


def test_an_unreachable_replica_is_marked_down_and_the_next_one_answers():
    async def run():
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        b, hits, runners = await _cluster(["a"], extra_urls=(dead,))
        b.replicas.replicas[1].outstanding = 100  # least-outstanding picks the dead replica first
        try:
            answers = [await b.infer(_request(str(i))) for i in range(2)]
            return answers, [r.healthy for r in b.replicas.replicas], dict(hits)
        finally:
            b.replicas.replicas[1].outstanding = 0
            await _close(b, runners)

    answers, healthy, hits = asyncio.run(run())
    assert [a.outputs[0].data.tolist() for a in answers] == [[ord("a")], [ord("a")]]
    assert healthy == [False, True] and hits == {"a": 2}
