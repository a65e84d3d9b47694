"""Tokenizer and chat template from an HF checkpoint folder (transformers' fast tokenizer, local files only).

Incremental detokenisation lives in the engine; this wraps encoding, the chat template and the eos ids.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from strataserve.models.hf_config import read_eos_token_ids
from strataserve.models.token_bytes import token_bytes_reader

Message = dict[str, Any]

#: ``tokenizer_class`` values naming transformers' generic tokenizer.json backend (Llama 3, Mistral, the demo model):
#: that class is loaded directly. ``AutoTokenizer`` would build the same object, but importing it first imports
#: every model's configuration (~3-4 s here; on the H200 host `strata serve`'s tokenizer took 15 s, longer than
#: the engine's whole load, run 15). Any other class (Qwen2Tokenizer, remote code, ...) goes through AutoTokenizer.
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def tokenizer_class_name(folder: Path) -> str | None:
    """``tokenizer_class`` from the folder's tokenizer_config.json (None when absent or unreadable)."""
    try:
        name = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


class Tokenizer:
    """A loaded tokenizer. ``hf`` is the underlying transformers tokenizer (for detokenisers that need it)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self.hf = hf_tokenizer
        #: every id that ends generation: config.json, generation_config.json, then the tokenizer's eos
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self._token_bytes: Callable[[int], bytes | None] | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        folder = Path(model_dir)
        if not folder.is_dir():
            raise ValueError(f"tokenizer path {str(folder)!r} is not a directory; give an HF checkpoint folder")
        if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
            raise ValueError(f"{folder}: no tokenizer files (tokenizer.json / tokenizer_config.json) found")
        try:
            if tokenizer_class_name(folder) in GENERIC_TOKENIZER_CLASSES and (folder / "tokenizer.json").is_file():
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
            else:
                from transformers import AutoTokenizer

                hf = AutoTokenizer.from_pretrained(str(folder), use_fast=True, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"{folder}: cannot load the tokenizer: {exc}") from None
        eos = read_eos_token_ids(folder)
        if hf.eos_token_id is not None:
            eos = tuple(dict.fromkeys(eos + (int(hf.eos_token_id),)))
        return cls(hf, eos)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        except TypeError:  # the Rust tokenizer's only word for text it cannot take, such as a lone surrogate
            if isinstance(text, str):
                text.encode("utf-8")  # UnicodeEncodeError (a ValueError) names the character and its position
            raise

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The raw bytes of one token (part of a UTF-8 character, for some), or None where the vocabulary does not
        say (``models/token_bytes.py``)."""
        if self._token_bytes is None:
            self._token_bytes = token_bytes_reader(self.hf)
        return self._token_bytes(token_id)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The chat template applied to ``messages`` (``[{"role": ..., "content": ...}, ...]``) as text."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
        template = kwargs.get("chat_template") or getattr(self.hf, "chat_template", None)
        messages = _developer_as_system(messages, str(template))
        try:
            return self.hf.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                               tokenize=False, **kwargs)
        except Exception as exc:  # jinja errors (e.g. a role the template rejects) are bad input
            raise ValueError(f"chat template failed on these messages: {exc}") from None

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat. The template writes its own special tokens (bos), so none are added."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False)


def _developer_as_system(messages: Sequence[Message], template: str) -> Sequence[Message]:
    """OpenAI's ``developer`` role is its new name for ``system``: a template that does not know it gets
    ``system`` (most open models' templates predate it and would refuse or mis-render it)."""
    if "developer" in template or not any(m.get("role") == "developer" for m in messages):
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
