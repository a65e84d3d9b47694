"""Incremental detokenisation and stop-string matching for one completion.

Byte-level BPE tokens can end in the middle of a multi-byte UTF-8 character, and SentencePiece-style decoders
drop a word's leading space at the start of a sequence. So text is produced by decoding a small sliding window
twice: ``decode(window up to the previous read point)`` and ``decode(window including the new tokens)``; the new
text is the difference, and nothing is emitted while the decoded tail ends in U+FFFD (an incomplete character).
The window starts a few prompt tokens back so the first output token gets its context.

Stop strings: the full text is searched after each update (only where a new match can begin), the text is cut at
the first match (keeping the stop string only with ``include_stop_str_in_output``), and while streaming the last
``len(longest stop) - 1`` characters are held back so a stop string split across tokens never leaks out.
"""
from __future__ import annotations

from typing import Any, Callable

from strataserve.types.sampling import SamplingParams

#: prompt tokens used as left context for the first output token
CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"

Decode = Callable[[list[int], bool], str]


def make_decode(tokenizer: Any) -> Decode:
    """A fast ``decode(ids, skip_special_tokens)`` for an HF tokenizer (its Rust backend when equivalent)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class TokenTextCache:
    """id -> text of that single token (for logprobs' ``decoded_token``); memoised, tokenizer-wide."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self._decode([token_id], False)
        return s


def decode_all(decode: Decode, prompt_token_ids: list[int], output_token_ids: list[int], skip: bool) -> str:
    """One-shot equivalent of running ``IncrementalDetokenizer`` over every output token (lazy offline path)."""
    ctx = prompt_token_ids[-CONTEXT_TOKENS:]
    head = decode(ctx, skip)
    full = decode(ctx + output_token_ids, skip)
    return full[len(head):] if full.startswith(head) else decode(output_token_ids, skip)


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._decode = decode
        self._skip = params.skip_special_tokens
        self._tokens: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._tokens)
        self.text = ""
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_out = 0
        longest = max((len(s) for s in self._stops), default=0)
        self._holdback = 0 if self._include_stop or not longest else longest - 1
        self._longest = longest
        self._sent = 0  # characters already handed out by ``delta``
        self.stopped_by: str | None = None

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string if one now matches (the text is then cut and final)."""
        if self.stopped_by is not None:
            return self.stopped_by
        before = len(self.text)
        for t in new_token_ids:
            self._tokens.append(t)
            self._num_out += 1
            self._advance(flush=False)
        if self._stops and self._num_out >= self._min_tokens:
            return self._check_stop(before)
        return None

    def finish(self) -> None:
        """Emit what is still held back because it decoded to an incomplete character (end of the sequence)."""
        if self.stopped_by is None:
            self._advance(flush=True)

    def delta(self, finished: bool) -> str:
        """New text since the previous call, holding back a possible stop-string prefix unless finished."""
        end = len(self.text)
        if not finished and self._holdback:
            end = max(self._sent, end - self._holdback)
        out = self.text[self._sent:end]
        self._sent = end
        return out

    # ------------------------------------------------------------------ internals
    def _advance(self, flush: bool) -> None:
        toks, skip = self._tokens, self._skip
        if self._read >= len(toks):
            return
        prefix_text = self._decode(toks[self._prefix:self._read], skip)
        new_text = self._decode(toks[self._prefix:], skip)
        if len(new_text) > len(prefix_text) and (flush or not new_text.endswith(_REPLACEMENT)):
            self.text += new_text[len(prefix_text):]
            self._prefix = self._read
            self._read = len(toks)

    def _check_stop(self, before: int) -> str | None:
        text = self.text
        start = max(0, before - self._longest + 1)
        best: tuple[int, str] | None = None
        for s in self._stops:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = text[:i + len(s)] if self._include_stop else text[:i]
        self._sent = min(self._sent, len(self.text))
        self.stopped_by = s
        return s
