"""The output tokens of a relayed chat / completions stream, read from its events' JSON (never from the bytes'
spelling: ``"choices": []`` and ``"choices":[]`` are the same chunk).

A chunk with choices carries one token of one choice, except the role-only chunk a chat stream opens each choice
with (``first_events``); the usage-only chunk (``choices: []``), ``[DONE]``, comments and events that are not JSON
carry none. When the upstream reports ``usage.completion_tokens`` (``stream_options.include_usage``, or vLLM's
continuous usage on every chunk) the last one reported is the request's count: a chunk may hold several tokens.
"""
from __future__ import annotations

import msgspec

from strataserve.router.backends.sse_events import event_data


class _Chunk(msgspec.Struct):
    choices: list[msgspec.Raw] | None = None
    usage: msgspec.Raw = msgspec.Raw()  # empty when absent (msgspec takes no Raw in a union); read if present


_decode = msgspec.json.Decoder(_Chunk).decode


class StreamTokens:
    def __init__(self, first_events: int = 0) -> None:
        self.first_events = first_events
        self.events = 0  # chunks with choices so far
        self.usage: int | None = None  # the last usage.completion_tokens reported

    def feed(self, events: list[bytes]) -> int:
        """Read whole events (as ``SSESplitter`` gives them); the tokens they carry beyond the opening ones."""
        n = 0
        for event in events:
            data = event_data(event)
            if data is None or data == b"[DONE]":
                continue
            try:
                chunk = _decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not a chunk: relayed as it is, counted as nothing
            if chunk.choices:
                n += 1
            if len(chunk.usage):
                self._read_usage(chunk.usage)
        before = self.events
        self.events += n
        return max(0, self.events - self.first_events) - max(0, before - self.first_events)

    def _read_usage(self, raw: msgspec.Raw) -> None:
        try:
            usage = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
            self.usage = tokens
