"""A tiny fake OpenAI streaming server (FastAPI + uvicorn on a free loopback port, in a thread) for bench tests.

It streams ``max_tokens`` one-token chunks with ``token_delay_s`` before each, records every request body, and
fails the measured requests whose arrival index (0 = the probe) is listed in ``fail_indices`` with HTTP 500.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "fake-model"


@dataclass
class FakeState:
    token_delay_s: float = 0.003
    fail_indices: set[int] = field(default_factory=set)
    send_usage: bool = True
    api_key: str | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    failed_bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def _handle(request: Request, chat: bool):
        if state.api_key and request.headers.get("authorization") != f"Bearer {state.api_key}":
            return JSONResponse({"error": {"message": "bad key", "type": "auth", "param": None, "code": 401}}, 401)
        body = await request.json()
        index = len(state.bodies)
        state.bodies.append(body)
        if index in state.fail_indices:
            state.failed_bodies.append(body)
            return JSONResponse({"error": {"message": "injected failure", "type": "server", "param": None, "code": 500}}, 500)
        n = body.get("max_completion_tokens") or body["max_tokens"]  # chat sends the former, as vLLM's bench
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())

        async def events():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                async for event in _tokens():
                    yield event
            finally:
                state.in_flight -= 1

        async def _tokens():
            for i in range(n):
                await asyncio.sleep(state.token_delay_s)
                choice = {"index": 0, "delta": {"content": f"w{i} "}} if chat else {"index": 0, "text": f"w{i} "}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            if state.send_usage:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _handle(request, chat=True)

    return app


@contextmanager
def fake_server(state: FakeState) -> Iterator[str]:
    """Serve ``state`` on 127.0.0.1:<free port>; yields the base URL; stops the server and joins its thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(500):
            if server.started:
                break
            threading.Event().wait(0.01)
        assert server.started, "fake server did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
