"""One streaming request to an OpenAI-compatible server, timed: TTFT, every inter-token gap, end-to-end latency.

Works with ``/v1/completions`` (``choices[0].text``) and ``/v1/chat/completions`` (``choices[0].delta``). As in
vLLM's bench, timing runs on the chunks that carry generated output: TTFT is send -> the first of them, ITLs are the
gaps between them and the end-to-end latency ends at the last of them (a trailing usage chunk or a slow
``[DONE]`` is not part of it). A chunk carries output when it has text, delta content, reasoning, tool calls or
token ids, or (completions) an empty text with no finish reason: a token that decoded to no text yet.
The output token count is the server's ``usage.completion_tokens`` (asked for with
``stream_options.include_usage``); without usage it is the number of output chunks, which ``serve`` replaces by a
re-tokenisation of the text when it has a tokenizer (``output_tokens_source`` says which).

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
    ttft: float = 0.0  # seconds from sending to the first output chunk (0 only when no output arrived)
    itl: list[float] = field(default_factory=list)  # seconds between consecutive output chunks
    latency: float = 0.0  # seconds from sending to the last output chunk (to the end of the stream without output)
    start_time: float = 0.0  # perf_counter() when sent
    error: str = ""
    generated_text: str = ""
    output_tokens_source: str = "chunks"  # "usage" (the server's count), "chunks" or "tokenizer" (set by serve)

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
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if is_chat(endpoint):
        if not isinstance(req.prompt, str):
            raise ValueError("chat endpoints need text prompts: pass --tokenizer so token prompts can be decoded")
        # max_tokens is deprecated for chat in the OpenAI API; vLLM's bench sends max_completion_tokens too
        body["max_completion_tokens"] = req.expected_output_len
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["max_tokens"] = req.expected_output_len
        body["prompt"] = req.prompt
    return body


# Only the fields the benchmark reads; unknown ones (logprobs, ids...) are skipped by the decoder.
class _Delta(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # vLLM / DeepSeek reasoning parsers
    reasoning: str | None = None  # newer vLLM, OpenRouter
    tool_calls: list[msgspec.Raw] | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: msgspec.Raw = msgspec.Raw(b"")  # kept raw: only its presence matters, its text goes into the message


_NO_ERROR = (b"", b"null")  # "error": null is valid JSON for "no error" (the openai SDK reads it so too)


_DECODE = msgspec.json.Decoder(_Chunk).decode
_ENCODE = msgspec.json.Encoder().encode
# msgspec.DecodeError covers malformed JSON and wrongly typed fields (ValidationError).
_ERRORS = (aiohttp.ClientError, msgspec.DecodeError, OSError, asyncio.TimeoutError, UnicodeDecodeError)


def _output(c: _Choice, chat: bool) -> tuple[bool, str]:
    """(does this choice carry generated output, its text)."""
    if c.token_ids:
        return True, _delta_text(c.delta) if chat else (c.text or "")
    if not chat:
        text = c.text
        # "" with no finish reason: a token whose text is not out yet (a partial UTF-8 sequence, a special token)
        return (bool(text) or (text is not None and c.finish_reason is None)), text or ""
    d = c.delta
    if d is None:
        return False, ""
    if d.content or d.reasoning_content or d.reasoning or d.tool_calls:
        return True, _delta_text(d)
    # an empty content delta is a token only when it is not the role chunk nor the finish chunk
    return d.content is not None and d.role is None and c.finish_reason is None, ""


def _delta_text(d: _Delta | None) -> str:
    """Reasoning then content: both are generated tokens, so both count when the output is re-tokenised."""
    if d is None:
        return ""
    return (d.reasoning_content or d.reasoning or "") + (d.content or "")


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
                    if bytes(chunk.error) not in _NO_ERROR:
                        res.error = f"stream error: {_error_text(chunk.error)[:300]}"
                        return res
                    choices = chunk.choices
                    if choices:
                        produced, piece = _output(choices[0], chat)
                        if produced:
                            if chunks == 0:
                                res.ttft = now - start
                            else:
                                itl.append(now - last)
                            last = now
                            chunks += 1
                            if piece:
                                text.append(piece)
                    usage = chunk.usage
                    if usage is not None:
                        if usage.completion_tokens is not None:
                            usage_tokens = usage.completion_tokens
                        if usage.prompt_tokens is not None:
                            res.prompt_len = usage.prompt_tokens
                if done_reading:
                    break
            # A body that ended cleanly without "data: [DONE]" is complete (vLLM's bench accepts it too); a cut
            # connection raises ClientPayloadError above instead.
            end = clock()
    except asyncio.TimeoutError as exc:
        # aiohttp's total timeout raises a bare TimeoutError: say what it was
        limit = session.timeout.total
        res.error = (f"{type(exc).__name__}: {exc}" if str(exc) else
                     f"TimeoutError: no complete response within --request-timeout {limit:g} s" if limit else "TimeoutError")
        return res
    except _ERRORS as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if usage_tokens is not None and usage_tokens > 0 and chunks == 0:
        res.error = f"the server reported {usage_tokens} output tokens but streamed no chunk with output to time"
        return res
    # latency ends at the last output chunk, as in vLLM; a response without output ends with its stream
    res.latency = (last if chunks else end) - start
    if usage_tokens is not None:
        res.output_tokens, res.output_tokens_source = usage_tokens, "usage"
    else:
        res.output_tokens = chunks
    res.generated_text = "".join(text)
    res.success = True
    return res
