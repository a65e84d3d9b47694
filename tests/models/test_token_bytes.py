"""Raw bytes of single tokens (logprobs of tokens that hold part of a UTF-8 character), checked against the
tokenizers' own decoders: byte-level BPE (the tiny test tokenizer, GPT-2 style) and SentencePiece byte fallback."""
from __future__ import annotations

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models
from transformers import PreTrainedTokenizerFast

from _tiny_models import make_tiny_tokenizer
from strataserve.models.token_bytes import token_bytes_reader

TEXT = "Héllo wörld ✓ 日本語 😀\u2028 \x85 tab\t"


def test_byte_level_bytes_agree_with_the_decoder():
    tok = make_tiny_tokenizer(512)
    read = token_bytes_reader(tok)
    for tid in range(len(tok)):
        raw = read(tid)
        # an added token written outside the byte alphabet has no bytes to give: the caller keeps its text
        assert raw is not None or tid in tok.all_special_ids
        if raw is not None:
            assert raw.decode(errors="replace") == tok.decode([tid], skip_special_tokens=False)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(read(t) for t in ids) == TEXT.encode()
    assert any(read(t) == b"\xe2" for t in range(len(tok)))  # a lone lead byte: part of a character


def test_byte_fallback_pieces():
    vocab = {"<unk>": 0, "<0xE2>": 1, "<0x9C>": 2, "<0x93>": 3, "▁hi": 4, "é": 5}
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>")
    read = token_bytes_reader(tok)
    assert [read(i) for i in (1, 2, 3, 4, 5)] == [b"\xe2", b"\x9c", b"\x93", b" hi", "é".encode()]
    assert b"".join(read(i) for i in (4, 1, 2, 3)).decode() == tok.decode([4, 1, 2, 3]) == " hi✓"


def test_other_decoders_say_nothing():
    rust = RustTokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1}, unk_token="<unk>"))
    rust.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>")
    assert token_bytes_reader(tok)(1) is None
