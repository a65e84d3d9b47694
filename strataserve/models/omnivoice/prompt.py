"""OmniVoice's conditional input: style tokens, the text, optional reference audio tokens, the masked target.

Layout of one request's ``[C, c_len]`` ids (text ids repeated in every codebook row):
``[<|denoise|>] <|lang_start|>LANG<|lang_end|> <|instruct_start|>INSTRUCT<|instruct_end|>`` (absent values are
the word ``None``; ``<|denoise|>`` only with reference audio), then ``<|text_start|>REF_TEXT TEXT<|text_end|>``,
then the reference audio's tokens, then ``target_len`` mask ids. Non-verbal tags such as ``[laughter]`` are
tokenized on their own, so their ids do not depend on the neighbouring script. Text is cleaned the way the model
was trained: no line breaks, single spaces, no spaces next to CJK characters, ASCII parentheses.

``estimate_frames`` guesses the clip length from the text (the model needs it before it starts): a weighted count
of characters per script (CJK characters last longer than Latin letters, digits longer still, spaces and
punctuation shorter), scaled by the reference clip's frames per weight when there is one.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

import torch

NONVERBAL_TAGS = ("laughter", "sigh", "confirmation-en", "question-en", "question-ah", "question-oh", "question-ei",
                  "question-yi", "surprise-ah", "surprise-oh", "surprise-wa", "surprise-yo", "dissatisfaction-hnn")
_TAG_RE = re.compile(r"\[(" + "|".join(re.escape(t) for t in NONVERBAL_TAGS) + r")\]")
_CJK = r"[\u4e00-\u9fff]"
_SPACE_NEAR_CJK = re.compile(rf"(?<={_CJK})\s+|\s+(?={_CJK})")
#: with no reference clip, this text is taken to last this many frames (25 frames/s: one second)
DEFAULT_REF = ("Nice to meet you.", 25)


@dataclass(frozen=True)
class VoiceReference:
    """A voice to clone: its audio tokens ``[C, T]`` and their transcript (``ref_rms`` scales the output)."""

    tokens: torch.Tensor
    text: str
    rms: float | None = None


def clean_text(text: str) -> str:
    text = re.sub(r"[\r\n]+", "", text.strip())
    text = text.replace("\uff08", "(").replace("\uff09", ")")
    text = re.sub(r"[ \t]+", " ", text)
    return _SPACE_NEAR_CJK.sub("", text)


def _tokenize_text(text: str, tokenizer) -> list[int]:
    ids: list[int] = []
    pos = 0
    for m in _TAG_RE.finditer(text):
        for seg in (text[pos:m.start()], m.group()):
            if seg:
                ids += tokenizer(seg, add_special_tokens=False).input_ids
        pos = m.end()
    if pos < len(text):
        ids += tokenizer(text[pos:], add_special_tokens=False).input_ids
    return ids or list(tokenizer(text).input_ids)


def build_input_ids(tokenizer, text: str, target_len: int, num_codebooks: int, mask_id: int, *,
                    language: str | None = None, instruct: str | None = None, ref: VoiceReference | None = None,
                    denoise: bool = True) -> tuple[torch.Tensor, int]:
    """-> (ids long ``[C, c_len]``, the first audio column)."""
    style = ("<|denoise|>" if denoise and ref is not None else "") + \
        f"<|lang_start|>{language or 'None'}<|lang_end|><|instruct_start|>{instruct or 'None'}<|instruct_end|>"
    full = clean_text(f"{ref.text.strip()} {text.strip()}" if ref is not None and ref.text else text)
    prefix = list(tokenizer(style).input_ids) + _tokenize_text(f"<|text_start|>{full}<|text_end|>", tokenizer)
    text_rows = torch.tensor(prefix, dtype=torch.long).repeat(num_codebooks, 1)
    parts = [text_rows]
    if ref is not None:
        parts.append(ref.tokens.to(torch.long).cpu())
    parts.append(torch.full((num_codebooks, target_len), mask_id, dtype=torch.long))
    return torch.cat(parts, dim=1), len(prefix)


def _weight(ch: str) -> float:
    if ch.isspace():
        return 0.2
    if ch.isdigit():
        return 3.5
    cat = unicodedata.category(ch)
    if cat.startswith("M"):
        return 0.0
    if cat.startswith("P") or cat.startswith("S"):
        return 0.5
    o = ord(ch)
    if 0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF:
        return 3.0
    if 0xAC00 <= o <= 0xD7AF:
        return 2.5
    if 0x3040 <= o <= 0x30FF:
        return 2.2
    return 1.0


def text_weight(text: str) -> float:
    return sum(_weight(ch) for ch in _TAG_RE.sub("", text))


def estimate_frames(text: str, ref: VoiceReference | None = None, speed: float = 1.0) -> int:
    ref_text, ref_frames = (ref.text, int(ref.tokens.shape[-1])) if ref is not None and ref.text else DEFAULT_REF
    est = text_weight(text) * ref_frames / max(text_weight(ref_text), 1e-6)
    return max(1, int(est / speed))
