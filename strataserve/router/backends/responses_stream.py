"""What the router reads of an upstream's Responses API stream (``/v1/responses``) while relaying it byte for byte:
its output tokens (one per ``*.delta`` event, then the final usage when the upstream sends one), and enough of its
state (the response object, closed items, last ``sequence_number``) to end a stream that breaks mid-way as the
local path ends one: an ``error`` event, then ``response.failed`` for the same response, numbered on."""
from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from strataserve.api.errors import APIError
from strataserve.api.formatting import json_bytes, line_safe
from strataserve.router.backends.sse_events import event_data, normalise_newlines

_FINAL = ("response.completed", "response.incomplete", "response.failed")


class ResponsesStream:
    def __init__(self, model: str) -> None:
        self.model = model
        self.seq = -1  # the last sequence_number relayed
        self.response: dict[str, Any] | None = None  # the latest response object an event carried
        self.items: dict[int, dict[str, Any]] = {}  # closed output items, by output_index
        self.output_tokens: int | None = None  # the final event's usage, when it came

    def feed(self, chunk: bytes) -> int:
        """Read whole events (``chunk`` ends at an event boundary, its lines ended by LF, CRLF or CR alike); the
        tokens they carry."""
        tokens = 0
        for block in normalise_newlines(chunk).split(b"\n\n"):
            data = event_data(block)
            if data is None:
                continue
            try:
                event = msgspec.json.decode(data)
            except msgspec.DecodeError:
                continue
            if not isinstance(event, dict):
                continue
            kind = event.get("type")
            if isinstance(kind, str) and kind.endswith(".delta"):  # text, call arguments, reasoning: tokens
                tokens += 1
            seq = event.get("sequence_number")
            if isinstance(seq, int):
                self.seq = max(self.seq, seq)
            response = event.get("response")
            if isinstance(response, dict):
                self.response = response
                usage = response.get("usage")
                if kind in _FINAL and isinstance(usage, dict) and isinstance(usage.get("output_tokens"), int):
                    self.output_tokens = usage["output_tokens"]
            item, index = event.get("item"), event.get("output_index")
            if kind == "response.output_item.done" and isinstance(item, dict) and isinstance(index, int):
                self.items[index] = item
        return tokens

    def _event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        data = {"type": kind, "sequence_number": self.seq, **fields}
        return b"event: " + kind.encode() + b"\ndata: " + line_safe(json_bytes(data)) + b"\n\n"

    def failure(self, exc: APIError) -> bytes:
        """The end of a broken stream: ``error``, then ``response.failed`` with the items closed so far."""
        code = str(exc.code) if exc.code is not None else exc.type
        out = self._event("error", code=code, message=exc.message, param=exc.param)
        head = self.response or {"id": f"resp_{uuid.uuid4().hex}", "object": "response",
                                 "created_at": int(time.time()), "model": self.model}
        failed = {**head, "status": "failed", "completed_at": None, "incomplete_details": None, "usage": None,
                  "output": [self.items[i] for i in sorted(self.items)],
                  "error": {"code": "server_error" if exc.status >= 500 else "invalid_prompt",
                            "message": exc.message}}
        return out + self._event("response.failed", response=failed)
