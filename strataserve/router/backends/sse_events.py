"""Cutting an upstream's server-sent-event stream into whole events as its bytes arrive, for relaying event by
event (never the whole stream at once) and for reading what each event says.

The SSE spec lets a line end in CRLF, LF or a lone CR, so an event may end in ``\\n\\n``, ``\\r\\n\\r\\n`` or
``\\r\\r`` (sse-starlette, behind llama-cpp-python's server, ends them in CRLF). Events come out with their line
endings made ``\\n``: one form for the router's own reading, and what any SSE client accepts.

An event has a size bound: an upstream that never ends one (no blank line) would otherwise be buffered without
limit; past the bound the splitter raises ``EventTooLarge`` and the relay ends the stream with an error event.
"""
from __future__ import annotations

#: The largest event relayed. Token deltas are tiny; the largest real events are a Responses stream's final
#: ``response.completed`` (the whole output, logprobs included), so the bound is generous.
MAX_EVENT_BYTES = 8 << 20


class EventTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"an SSE event grew past {limit >> 20} MiB without ending (no blank line)")
        self.limit = limit


def normalise_newlines(data: bytes) -> bytes:
    """CRLF and lone CR made LF."""
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n") if b"\r" in data else data


class SSESplitter:
    """Feed it bytes as they arrive; it returns the events they complete, each ending in ``\\n\\n``."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._buf = b""
        self._skip_lf = False  # the last chunk ended in CR: an LF opening the next is the same line end

    def feed(self, data: bytes) -> list[bytes]:
        if self._skip_lf and data[:1] == b"\n":
            data = data[1:]
        if data:
            self._skip_lf = data[-1:] == b"\r"
        self._buf += normalise_newlines(data)
        cut = self._buf.rfind(b"\n\n")
        if cut < 0:
            self._check()
            return []
        done, self._buf = self._buf[: cut + 2], self._buf[cut + 2:]
        self._check()
        events = (e.lstrip(b"\n") for e in done[:-2].split(b"\n\n"))  # extra blank lines: no event
        return [e + b"\n\n" for e in events if e]

    def _check(self) -> None:
        if len(self._buf) > self.max_event_bytes:
            self._buf = b""
            raise EventTooLarge(self.max_event_bytes)

    def close(self) -> bytes:
        """What is left when the stream ends: an unfinished event, ended (the spec drops it; relaying it whole,
        closed, loses nothing for a client that reads it), or ``b""``."""
        rest, self._buf = self._buf.strip(b"\n"), b""
        return rest + b"\n\n" if rest else b""


def event_data(event: bytes) -> bytes | None:
    """An event's ``data`` (its data lines joined by LF, as the spec reads them), or None when it has none."""
    lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[1:] if line[:1] == b" " else line for line in lines)
