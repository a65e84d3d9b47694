"""OpenAI response pieces built from engine outputs: logprobs in the completions and chat shapes, usage, SSE."""
from __future__ import annotations

import codecs
from typing import Any, Callable

import msgspec

from strataserve.types.outputs import Logprob

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"

# JSON leaves U+0085, U+2028 and U+2029 unescaped, but str.splitlines() ends a line at each, and so do SSE readers
# built on it (httpx's ``iter_lines``): a token that decodes to one would cut its event in two. Escaped, the JSON
# decodes to the same text. In valid UTF-8 these byte sequences are always those characters.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def line_safe(data: bytes) -> bytes:
    """``data`` (JSON) with the Unicode line breaks that JSON leaves raw written as escapes: one SSE line."""
    if b"\xc2\x85" in data or b"\xe2\x80" in data:
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    return data


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + line_safe(_json.encode(obj)) + b"\n\n"


def json_bytes(obj: Any) -> bytes:
    return _json.encode(obj)


#: what a logprob of -inf (a token the grammar, allowed_token_ids or bad_words masked) is sent as: JSON has no
#: infinity (msgspec writes it as null) and OpenAI's schema says a number; vLLM sends this same floor
LOGPROB_FLOOR = -9999.0


def finite_logprob(logprob: float) -> float:
    """``logprob`` as a response carries it: a masked token's -inf (or a NaN) becomes ``LOGPROB_FLOOR``."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class TokenNamer:
    """Text of single tokens for logprobs; uses the engine's decoded text when it sent one. A token that holds part
    of a UTF-8 character (it decodes to U+FFFD alone) is named by its bytes, as OpenAI does ("bytes:\\xe2\\x80"),
    and ``raw`` gives those bytes, so joining a completion's token bytes gives its text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._special: frozenset[int] | None = None

    def __call__(self, token_id: int, lp: Logprob | None = None) -> str:
        text = lp.decoded_token if lp is not None and lp.decoded_token is not None else self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 65536:
                self._cache[token_id] = text
        if "\ufffd" in text:
            raw = self._partial(token_id)
            if raw is not None:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text

    def special_ids(self) -> frozenset[int]:
        if self._special is None:
            hf = getattr(self.tokenizer, "hf", self.tokenizer)
            self._special = frozenset(getattr(hf, "all_special_ids", ()) or ())
        return self._special

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids()

    def raw(self, token_id: int, name: str) -> list[int]:
        """The bytes of the token ``self(token_id)`` named ``name`` (the chat API's ``bytes``)."""
        raw = self._partial(token_id) if name.startswith("bytes:") else None
        return list(raw if raw is not None else name.encode())

    def _partial(self, token_id: int) -> bytes | None:
        """The token's bytes when they are not whole UTF-8 characters (else None: its text says it all)."""
        read = getattr(self.tokenizer, "token_bytes", None)
        raw = read(token_id) if read is not None else None
        if raw is None:
            return None
        try:
            raw.decode()
        except UnicodeDecodeError:
            return raw
        return None


def _ranked(entries: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    items = sorted(entries.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                    -kv[1].logprob))
    return [(t, lp) for t, lp in items if lp.rank is None or lp.rank <= top_n][:top_n]


class CompletionLogprobs:
    """Accumulates the completions-API ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset."""

    __slots__ = ("namer", "top_n", "offset", "tokens", "token_logprobs", "top_logprobs", "text_offset", "_utf8",
                 "_hidden", "_text")

    def __init__(self, namer: TokenNamer, top_n: int, start_offset: int = 0, skip_special_tokens: bool = True) -> None:
        """``skip_special_tokens``: the request's; special tokens the generated text leaves out take no room in
        the offsets."""
        self.namer = namer
        self.top_n = top_n
        self.offset = start_offset
        self._hidden = namer.special_ids() if skip_special_tokens else frozenset()
        self._text: str | None = None
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        # offsets index the text's characters; a token inside a character has that character's offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_ids: list[int], entries: list[dict[int, Logprob] | None] | None,
            text: str | None = None) -> dict[str, Any]:
        """Append these tokens; return just their part (for a stream chunk). A None entry (the first prompt token
        of an echo) has no logprob: OpenAI sends null for it. ``text``: what these tokens read as in the response
        (the echoed prompt), where a special token takes room only if it is written there (a bos the tokenizer
        added is not)."""
        start = len(self.tokens)
        self._text = text
        for i, tid in enumerate(token_ids):
            step = entries[i] if entries is not None and i < len(entries) else {}
            if step is None:
                text = self.namer(tid)
                self.tokens.append(text)
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                self._advance(tid, text)
                continue
            chosen = step.get(tid)
            text = self.namer(tid, chosen)
            self.tokens.append(text)
            self.token_logprobs.append(finite_logprob(chosen.logprob) if chosen is not None else None)
            top: dict[str, float] = {}
            for t, lp in _ranked(step, self.top_n):
                # Distinct ids can share a text (e.g. partial UTF-8 bytes): the more likely one keeps the key.
                top.setdefault(self.namer(t, lp), finite_logprob(lp.logprob))
            if chosen is not None:
                top.setdefault(text, finite_logprob(chosen.logprob))
            self.top_logprobs.append(top)
            self._advance(tid, text)
        return self._slice(start)

    def _advance(self, token_id: int, name: str) -> None:
        if token_id in self._hidden or self._text is not None and self.namer.is_special(token_id):
            if self._text is None or not self._text.startswith(name, self.offset):
                self.text_offset.append(self.offset)  # not in the text: where it would have been
                return
        raw = bytes(self.namer.raw(token_id, name))
        # bytes still pending that this token does not continue (its first byte is no continuation byte) were an
        # invalid character: one U+FFFD in the text, before this token
        pending = self._utf8.getstate()[0]
        self.text_offset.append(self.offset + (1 if pending and raw and not 0x80 <= raw[0] <= 0xBF else 0))
        self.offset += len(self._utf8.decode(raw))

    def _slice(self, start: int) -> dict[str, Any]:
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top_logprobs[start:], "text_offset": self.text_offset[start:]}

    def result(self) -> dict[str, Any]:
        return self._slice(0)


def chat_logprobs(namer: TokenNamer, token_ids: list[int], entries: list[dict[int, Logprob]] | None,
                  top_n: int) -> list[dict[str, Any]]:
    """The chat API's ``logprobs.content`` items for these tokens."""
    items = []
    for i, tid in enumerate(token_ids):
        step = entries[i] if entries is not None and i < len(entries) else {}
        chosen = step.get(tid)
        text = namer(tid, chosen)
        top = []
        for t, lp in _ranked(step, top_n):
            name = namer(t, lp)
            top.append({"token": name, "logprob": finite_logprob(lp.logprob), "bytes": namer.raw(t, name)})
        items.append({"token": text, "logprob": finite_logprob(chosen.logprob) if chosen is not None else LOGPROB_FLOOR,
                      "bytes": namer.raw(tid, text), "top_logprobs": top})
    return items


def vllm_prompt_logprobs(namer: TokenNamer, ids: list[int], entries: list[dict[int, Logprob] | None] | None,
                         top: int) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` of one prompt (a completions choice's, a chat response's): None for the first
    token, then {token id: {logprob, rank, decoded_token}} with the prompt's own token and the ``top`` most
    likely. ``entries``: the engine's prompt logprobs (None: it sent none)."""
    if entries is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for tid, pos in zip(ids, entries):
        if pos is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": finite_logprob(lp.logprob), "rank": lp.rank, "decoded_token": namer(t, lp)}
                    for t, lp in pos.items() if t == tid or (lp.rank is not None and lp.rank <= top)})
    return out


class ChunkTemplate:
    """Pre-serialised SSE chunk ``{**head, "choices": [{"index": i, <key>: ..., "logprobs": ..., "finish_reason":
    ...}]}``: only the per-token values are encoded per chunk (the hot path of a stream), byte-identical to
    ``sse`` of the same dict."""

    __slots__ = ("_start", "_end", "_usage_of")

    def __init__(self, head: dict[str, Any], usage_of: Callable[[], dict[str, int]] | None = None) -> None:
        """``usage_of``: each chunk ends with ``"usage": usage_of()`` in place of the head's own usage
        (``stream_options.continuous_usage_stats``)."""
        if usage_of is not None:
            head = {k: v for k, v in head.items() if k != "usage"}
        body = line_safe(_json.encode({**head, "choices": []}))  # ...,"choices":[]}
        self._start = b"data: " + body[:-2] + b'{"index":'
        self._end = b"}]}\n\n"
        self._usage_of = usage_of

    def text(self, index: int, text: str, logprobs: Any, finish_reason: str | None,
             extra: dict[str, Any] | None = None) -> bytes:
        """A completions chunk (``"text"``); ``extra`` keys (token ids) follow ``finish_reason``."""
        return self._choice(index, b',"text":', line_safe(_json.encode(text)), logprobs, finish_reason, extra)

    def delta(self, index: int, delta: dict[str, Any], logprobs: Any, finish_reason: str | None,
              extra: dict[str, Any] | None = None) -> bytes:
        """A chat chunk (``"delta"``); ``extra`` as for ``text``."""
        return self._choice(index, b',"delta":', line_safe(_json.encode(delta)), logprobs, finish_reason, extra)

    def _choice(self, index: int, key: bytes, value: bytes, logprobs: Any, finish_reason: str | None,
                extra: dict[str, Any] | None) -> bytes:
        tail = b"," + _json.encode(extra)[1:-1] if extra else b""  # ',"token_ids":[...]': the dict without braces
        end = self._end if self._usage_of is None else b'}],"usage":' + _json.encode(self._usage_of()) + b"}\n\n"
        return b"".join((self._start, b"%d" % index, key, value, b',"logprobs":', line_safe(_json.encode(logprobs)),
                         b',"finish_reason":', _json.encode(finish_reason), tail, end))
