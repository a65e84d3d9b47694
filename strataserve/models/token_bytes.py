"""The raw bytes of one token, for logprobs. A token may hold part of a UTF-8 character (byte-level BPE splits
an emoji into several tokens), and decoding it alone gives U+FFFD, so its own bytes come from the vocabulary:

- byte-level vocabularies (GPT-2, Llama 3, Qwen): each byte is written as one printable character (GPT-2's
  ``bytes_to_unicode`` table), so the token's string maps back to its bytes;
- byte-fallback vocabularies (SentencePiece: Llama 2, Mistral): ``<0xE2>`` is that byte, ``▁`` a space.

Other tokenizers give None: the caller keeps the decoded text.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's table read backwards: the printable character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _decoder_types(backend: Any) -> set[str]:
    """The types of the tokenizer's decoder and of its parts (a Sequence lists several)."""
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    try:
        spec = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return set()
    return {spec.get("type")} | {d.get("type") for d in spec.get("decoders") or []}


def token_bytes_reader(hf_tokenizer: Any) -> Callable[[int], bytes | None]:
    """``read(token_id)``: the token's raw bytes, or None where this tokenizer's vocabulary does not say."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    kinds = _decoder_types(backend)
    if "ByteLevel" in kinds:
        table = _byte_level_table()

        def read(token_id: int) -> bytes | None:
            piece = backend.id_to_token(token_id)
            if piece is None or any(c not in table for c in piece):
                return None  # an added token ("<|im_end|>") is not written in the byte alphabet
            return bytes(table[c] for c in piece)
        return read
    if "ByteFallback" in kinds:
        def read(token_id: int) -> bytes | None:
            piece = backend.id_to_token(token_id)
            if piece is None:
                return None
            m = _BYTE_FALLBACK.fullmatch(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode()
        return read
    return lambda token_id: None
