"""Incremental detokenisation (multi-byte safe) and stop strings, with a real byte-level BPE tokenizer."""
from __future__ import annotations

import random

import pytest
from engine_tokenizer import build_tokenizer

from strataserve.engine.detokenizer import IncrementalDetokenizer, decode_all, make_decode
from strataserve.types.sampling import SamplingParams

TEXTS = ["emoji 🙂🚀 and 日本語のテキスト。", "café naïve 中文文本 🙂", "hello world, the quick brown fox"]


def stream(tok, prompt_ids, out_ids, params, step=1):
    d = IncrementalDetokenizer(make_decode(tok), prompt_ids, params)
    pieces, stop = [], None
    for i in range(0, len(out_ids), step):
        stop = d.update(out_ids[i:i + step])
        if stop is not None:
            break
        pieces.append(d.delta(False))
    if stop is None:
        d.finish()
    pieces.append(d.delta(True))
    return pieces, d.text, stop


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_equal_full_decode_and_never_split_a_character(text):
    tok = build_tokenizer()
    prompt = tok.encode("The engine", add_special_tokens=False)
    out = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in out) or text.isascii()  # really split mid-character
    pieces, full, _ = stream(tok, prompt, out, SamplingParams())
    assert "".join(pieces) == full == tok.decode(out) == text
    assert all("\ufffd" not in p for p in pieces)
    assert decode_all(make_decode(tok), prompt, out, True) == text


def test_random_token_sequences_match_one_shot_decode():
    tok = build_tokenizer()
    rng = random.Random(0)
    dec = make_decode(tok)
    for _ in range(30):
        out = [rng.randrange(2, len(tok)) for _ in range(rng.randint(1, 25))]
        pieces, full, _ = stream(tok, [5, 6, 7], out, SamplingParams(), step=rng.randint(1, 3))
        assert "".join(pieces) == full == decode_all(dec, [5, 6, 7], out, True)


def test_skip_special_tokens():
    tok = build_tokenizer()
    out = tok.encode("hello", add_special_tokens=False) + [tok.eos_token_id] + tok.encode(" world", add_special_tokens=False)
    assert stream(tok, [5], out, SamplingParams())[1] == "hello world"
    assert stream(tok, [5], out, SamplingParams(skip_special_tokens=False))[1] == "hello</s> world"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens_is_cut_and_never_streamed(include):
    tok = build_tokenizer()
    out = tok.encode("hello world STOP there", add_special_tokens=False)
    out = [t for t in out]  # make the stop string span several tokens by spelling it out byte by byte
    spelled = []
    for t in out:
        s = tok.decode([t])
        spelled += tok.convert_tokens_to_ids(list(tok.convert_ids_to_tokens([t])[0])) if "STOP" in s else [t]
    assert len(spelled) > len(out)
    params = SamplingParams(stop=["STOP", "never"], include_stop_str_in_output=include)
    pieces, full, stop = stream(tok, [5], spelled, params)
    assert stop == "STOP"
    want = "hello world STOP" if include else "hello world "
    assert full == want and "".join(pieces) == want
    if not include:
        assert not any("S" in p for p in pieces)


def test_multibyte_stop_string_and_min_tokens():
    tok = build_tokenizer()
    out = tok.encode("日本語のテキスト。 more", add_special_tokens=False)
    pieces, full, stop = stream(tok, [5], out, SamplingParams(stop=["。"]))
    assert (full, stop, "".join(pieces)) == ("日本語のテキスト", "。", "日本語のテキスト")
    # min_tokens: no stop-string check until that many tokens exist.
    out2 = tok.encode("STOP and then STOP", add_special_tokens=False)
    _, full2, stop2 = stream(tok, [5], out2, SamplingParams(stop=["STOP"], min_tokens=len(out2)))
    assert stop2 == "STOP" and full2 == "STOP and then "


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_CHARS = ["a", "b", " ", "🙂", "日", "本", "é", "S", "T", "O", "P", "\n"]


@settings(max_examples=60, deadline=None)
@given(text=st.lists(st.sampled_from(_CHARS), min_size=1, max_size=30).map("".join),
       stop=st.sampled_from(["STOP", "🙂日", "é", "b b", "TO"]), include=st.booleans(),
       steps=st.lists(st.integers(1, 4), min_size=1, max_size=40))
def test_streaming_with_a_stop_string_equals_cutting_the_full_text(text, stop, include, steps):
    tok = build_tokenizer()
    out = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(make_decode(tok), [5], SamplingParams(stop=[stop], include_stop_str_in_output=include))
    streamed, i, k, found = "", 0, 0, None
    while i < len(out) and found is None:
        n = steps[k % len(steps)]
        found = d.update(out[i:i + n])
        i, k = i + n, k + 1
        streamed += d.delta(found is not None)
    if found is None:
        d.finish()
        streamed += d.delta(True)
    if stop in text:
        cut = text.index(stop) + (len(stop) if include else 0)
        assert found == stop and d.text == streamed == text[:cut]
    else:
        assert found is None and d.text == streamed == text
    assert "\ufffd" not in streamed
