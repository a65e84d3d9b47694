"""One streaming request to an OpenAI-compatible server, timed: TTFT, every inter-token gap, end-to-end latency.

Works with ``/v1/completions`` (``choices[0].text``) and ``/v1/chat/completions`` (``choices[0].delta.content``).
The output token count is the server's ``usage.completion_tokens`` (asked for with
``stream_options.include_usage``); servers that do not report usage fall back to one token per content chunk.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from strataserve.bench.datasets import SampleRequest


@dataclass(slots=True)
class RequestResult:
    success: bool
    prompt_len: int  # server-reported usage.prompt_tokens when available, else the dataset's count
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from sending to the first content chunk (0 when none arrived)
    itl: list[float] = field(default_factory=list)  # seconds between consecutive content chunks
    latency: float = 0.0  # seconds from sending to the end of the stream
    start_time: float = 0.0  # perf_counter() when sent
    error: str = ""
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, or None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def build_payload(endpoint: str, model: str, req: SampleRequest, ignore_eos: bool, sampling: dict[str, Any]) -> dict[str, Any]:
    """The JSON body for ``req``; ``sampling`` adds fields such as temperature, top_p, top_k."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.expected_output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if is_chat(endpoint):
        if not isinstance(req.prompt, str):
            raise ValueError("chat endpoints need text prompts: pass --tokenizer so token prompts can be decoded")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], prompt_len: int, headers: dict[str, str] | None = None
) -> RequestResult:
    """POST ``body`` and consume its SSE stream. Never raises for server or network errors: they fill ``error``."""
    chat = "messages" in body
    res = RequestResult(success=False, prompt_len=prompt_len, start_time=time.perf_counter())
    start = last = res.start_time
    chunks = 0
    usage_tokens: int | None = None
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode("utf-8", "replace")[:300]
                res.error = f"HTTP {resp.status_code}: {detail}"
                return res
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, ':' comments, 'event:' lines
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return res
                now = time.perf_counter()
                if piece := _chunk_text(chunk, chat):
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                    text.append(piece)
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    res.prompt_len = usage.get("prompt_tokens", res.prompt_len)
            res.latency = time.perf_counter() - start
            if not done:
                res.error = "stream ended without data: [DONE]"
                return res
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    res.generated_text = "".join(text)
    res.success = True
    return res
