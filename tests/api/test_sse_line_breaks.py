"""Text with U+0085, U+2028 or U+2029 stays inside its SSE line. JSON leaves those characters raw, and
``str.splitlines()`` (so httpx's ``iter_lines``, which many SSE readers use) ends a line at each: unescaped, a
token that decodes to one splits its event and the reader gets broken JSON."""
from __future__ import annotations

import json

import httpx
import pytest

from strataserve.api.formatting import ChunkTemplate, line_safe, sse

BREAKS = "a\u2028b\x85c\u2029d"


def test_line_safe_escapes_only_the_unicode_line_breaks():
    for data in (sse({"t": BREAKS + " é ✓"}), ChunkTemplate({"id": "x\u2028"}).text(0, BREAKS, None, None),
                 ChunkTemplate({"id": "x"}).delta(1, {"content": BREAKS}, {"content": [{"token": "\x85"}]}, None)):
        text = data.decode()
        assert text.endswith("\n\n") and len(text[:-2].splitlines()) == 1
        assert json.loads(text[len("data: "):])  # still JSON
    assert json.loads(line_safe(json.dumps(BREAKS, ensure_ascii=False).encode())) == BREAKS
    plain = json.dumps({"t": "é ✓ \u2027 \u202a"}, ensure_ascii=False).encode()
    assert line_safe(plain) is plain  # nothing to escape: the same bytes, not a copy


def _events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, headers=server.headers,
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines), lines
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_streamed_echo_keeps_line_breaks_in_one_event(server):
    events = _events(server, "/v1/completions", {"model": "tiny", "prompt": BREAKS, "echo": True, "max_tokens": 2,
                                                 "temperature": 0})
    assert events[0]["choices"][0]["text"] == BREAKS


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_tokens_with_line_breaks(server, path):
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "guided_choice": [BREAKS]}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
        key = "content"
    else:
        body["prompt"] = "hi"
        key = "text"
    events = _events(server, path, body)
    parts = [(c.get("delta", {}).get(key) if "delta" in c else c.get(key)) or "" for e in events
             for c in e["choices"]]
    assert "".join(parts) == BREAKS
