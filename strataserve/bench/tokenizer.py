"""The tokenizer the bench uses for text prompts and exact lengths: a model folder's ``tokenizer.json`` loaded with
the light ``tokenizers`` library (milliseconds), else ``transformers.AutoTokenizer`` (seconds of import)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


class FastTokenizer:
    """``len``, ``all_special_ids``, ``encode``, ``decode`` - the subset of a HF tokenizer the bench calls."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.all_special_ids = sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: str | Path) -> Any:
    p = Path(path)
    try:
        if (p / "tokenizer.json").is_file():
            return FastTokenizer(p / "tokenizer.json")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(p))
    except Exception as exc:  # noqa: BLE001 - any loader failure becomes one clear message
        raise ValueError(f"--tokenizer {path}: cannot load a tokenizer ({type(exc).__name__}: {exc})") from None
