"""An OpenAI streaming server with exactly known timings, for checking bench metrics against the truth.

Request n (0 = the first one) waits ``ttft`` seconds, sends its first output chunk, then one every ``itl`` seconds
until max_tokens / max_completion_tokens tokens are out; ``multi`` makes chunk k carry several tokens. Then a
finish chunk, ``done_delay`` seconds, the usage chunk (unless ``usage`` is off) and ``data: [DONE]`` (unless
``done`` is off). Runs on its own event loop in a thread, on a free loopback port; records every body and its
arrival time.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from aiohttp import web


@dataclass
class Timing:
    ttft: float = 0.2
    itl: float = 0.05
    multi: dict[int, int] = field(default_factory=dict)  # chunk index -> tokens it carries
    usage: bool = True
    done: bool = True
    done_delay: float = 0.0
    reasoning: bool = False  # chat: tokens go to delta.reasoning_content, content stays null
    error_null: bool = False  # every chunk carries "error": null
    stall_from: int | None = None  # requests with index >= this stall forever after their first chunk
    bodies: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)


def _app(t: Timing) -> web.Application:
    def event(d: dict[str, Any]) -> bytes:
        if t.error_null:
            d["error"] = None
        return f"data: {json.dumps(d)}\n\n".encode()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "timed", "object": "model"}]})

    async def gen(req: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        body = await req.json()
        n = len(t.bodies)
        t.bodies.append(body)
        t.arrivals.append(t0)
        chat = "messages" in body
        total = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        if chat:  # the role chunk, at once, as vLLM and strataserve send it: no output yet
            await resp.write(event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        sent = i = 0
        while sent < total:
            delay = t0 + t.ttft + i * t.itl - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            k = min(t.multi.get(i, 1), total - sent)
            text = "".join(f"w{sent + j} " for j in range(k))
            if chat:
                delta = {"reasoning_content": text, "content": None} if t.reasoning else {"content": text}
                await resp.write(event({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}))
            else:
                await resp.write(event({"choices": [{"index": 0, "text": text, "finish_reason": None}]}))
            sent += k
            i += 1
            if t.stall_from is not None and n >= t.stall_from:
                await asyncio.sleep(3600)
        finish = {"index": 0, "delta": {}, "finish_reason": "length"} if chat else {"index": 0, "text": "", "finish_reason": "length"}
        await resp.write(event({"choices": [finish]}))
        if t.done_delay:
            await asyncio.sleep(t.done_delay)
        if t.usage:
            pt = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 7
            await resp.write(event({"choices": [], "usage": {"prompt_tokens": pt, "completion_tokens": sent}}))
        if t.done:
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", gen)
    app.router.add_post("/v1/chat/completions", gen)
    return app


@contextmanager
def timed_server(t: Timing) -> Iterator[str]:
    """Serve ``t`` on 127.0.0.1:<free port>; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(_app(t), handle_signals=False, shutdown_timeout=0.2)
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, sock).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10), "timed server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(_shutdown(runner), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        sock.close()


async def _shutdown(runner: web.AppRunner) -> None:
    await runner.cleanup()
    rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]  # stalled handlers
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
