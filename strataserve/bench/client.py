"""One streaming request to an OpenAI-compatible server, timed: TTFT, every inter-token gap, end-to-end latency.

Works with ``/v1/completions`` (``choices[0].text``) and ``/v1/chat/completions`` (``choices[0].delta.content``).
The output token count is the server's ``usage.completion_tokens`` (asked for with
``stream_options.include_usage``); servers that do not report usage fall back to one token per content chunk.

The load generator shares the CPU with the server it measures, so the per-chunk path is kept lean: aiohttp reads
whatever bytes have arrived, lines are split by hand, and each ``data:`` payload is decoded by msgspec straight
into the few fields we use (everything else is skipped without building Python objects).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

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


# Only the fields the benchmark reads; unknown ones (logprobs, finish_reason, ids...) are skipped by the decoder.
class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: msgspec.Raw = msgspec.Raw(b"")  # kept raw: only its presence matters, its text goes into the message


_DECODE = msgspec.json.Decoder(_Chunk).decode
_ENCODE = msgspec.json.Encoder().encode
# msgspec.DecodeError covers malformed JSON and wrongly typed fields (ValidationError).
_ERRORS = (aiohttp.ClientError, msgspec.DecodeError, OSError, asyncio.TimeoutError, UnicodeDecodeError)


def _error_text(raw: msgspec.Raw) -> str:
    try:  # normalise to json.dumps spacing so messages read the same whatever the server's formatting
        return json.dumps(json.loads(bytes(raw)))
    except ValueError:
        return bytes(raw).decode("utf-8", "replace")


async def send_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], prompt_len: int, headers: dict[str, str] | None = None
) -> RequestResult:
    """POST ``body`` and consume its SSE stream. Never raises for server or network errors: they fill ``error``."""
    chat = "messages" in body
    data = _ENCODE(body)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    clock = time.perf_counter
    decode = _DECODE
    res = RequestResult(success=False, prompt_len=prompt_len, start_time=clock())
    start = last = res.start_time
    itl = res.itl
    chunks = 0
    usage_tokens: int | None = None
    text: list[str] = []
    try:
        async with session.post(url, data=data, headers=hdrs) as resp:
            if resp.status != 200:
                detail = (await resp.read()).decode("utf-8", "replace")[:300]
                res.error = f"HTTP {resp.status}: {detail}"
                return res
            done = False
            pending = b""
            stream = resp.content
            while not done:
                block = await stream.readany()
                now = clock()  # arrival time of every event in this read
                if not block:  # end of body: a last line without a newline still counts
                    if not pending:
                        break
                    lines, pending = [pending], b""
                    done_reading = True
                else:
                    lines = (pending + block).split(b"\n") if pending else block.split(b"\n")
                    pending = lines.pop()
                    done_reading = False
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue  # blank separators, ':' comments, 'event:' lines
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    chunk = decode(payload)
                    if chunk.error:
                        res.error = f"stream error: {_error_text(chunk.error)[:300]}"
                        return res
                    choices = chunk.choices
                    if choices:
                        c = choices[0]
                        piece = (c.delta.content if c.delta is not None else None) if chat else c.text
                        if piece:
                            if chunks == 0:
                                res.ttft = now - start
                            else:
                                itl.append(now - last)
                            last = now
                            chunks += 1
                            text.append(piece)
                    usage = chunk.usage
                    if usage is not None:
                        if usage.completion_tokens is not None:
                            usage_tokens = usage.completion_tokens
                        if usage.prompt_tokens is not None:
                            res.prompt_len = usage.prompt_tokens
                if done_reading:
                    break
            res.latency = clock() - start
            if not done:
                res.error = "stream ended without data: [DONE]"
                return res
    except _ERRORS as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    res.generated_text = "".join(text)
    res.success = True
    return res
