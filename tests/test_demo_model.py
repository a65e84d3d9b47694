"""The embedded demo model (strataserve/assets/demo_llama): HF loads it, its tokenizer round-trips any text,
its greedy continuations are real English words, and strataserve's engine reproduces HF token for token."""
from __future__ import annotations

import gzip
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strataserve.assets import DEMO_MODEL_DIR

EVERYDAY_PROMPTS = [
    "The weather today is", "Once upon a time, there was a", "My favourite food is",
    "The best way to learn is", "In the morning I like to", "A good friend is someone who",
    "The old house at the end of the street", "She opened the door and saw", "Money is",
    "When the sun goes down,",
]
PUNCT = ".,;:!?\"'()[]{}-_*`"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def corpus_words() -> set[str]:
    with gzip.open(DEMO_MODEL_DIR / "corpus_words.txt.gz", "rt", encoding="utf-8") as f:
        return set(f.read().split())


def hf_greedy(model, ids: list[int], new_tokens: int, eos_id: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=eos_id, eos_token_id=eos_id)
    return out[0, len(ids):].tolist()


def test_folder_is_a_small_standard_llama_checkpoint(hf_model, tokenizer) -> None:
    from transformers import LlamaForCausalLM

    cfg = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert isinstance(hf_model, LlamaForCausalLM)
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()  # tied
    n_params = sum(p.numel() for p in hf_model.parameters())
    assert 1_000_000 < n_params < 10_000_000
    assert (DEMO_MODEL_DIR / "model.safetensors").stat().st_size <= 25 * 1000 * 1000
    total = sum(p.stat().st_size for p in DEMO_MODEL_DIR.rglob("*") if p.is_file())
    assert total < 30 * 1000 * 1000
    assert cfg["vocab_size"] == len(tokenizer)
    gen = json.loads((DEMO_MODEL_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.eos_token_id == cfg["eos_token_id"]
    assert gen["bos_token_id"] == tokenizer.bos_token_id == cfg["bos_token_id"]


def test_tokenizer_adds_bos_and_chat_template_uses_role_markers(tokenizer) -> None:
    ids = tokenizer("Hello there.").input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id not in ids
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a dog?"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>\nBe brief.<|eos|><|user|>\nWhat is a dog?<|eos|><|assistant|>\n"
    chat_ids = tokenizer(text, add_special_tokens=False).input_ids
    for marker in ("<|bos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|eos|>"):
        assert tokenizer.convert_tokens_to_ids(marker) in chat_ids  # each marker is one token
    with pytest.raises(Exception, match="roles are"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


_SCRIPTS = st.sampled_from([
    (0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
    (0x900, 0x97F), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x200B, 0x200D),
])
_CHARS = _SCRIPTS.flatmap(lambda r: st.characters(min_codepoint=r[0], max_codepoint=r[1]))
_TEXT = st.one_of(st.text(_CHARS, max_size=80), st.text(max_size=80),
                  st.lists(st.sampled_from(["\n", "\t", "  ", " ", "e\u0301", "👩‍👩‍👧", "🇫🇷", "日本語", "\r\n"]))
                  .map("".join))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_TEXT)
def test_tokenizer_round_trips_any_unicode(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    with_bos = tokenizer(text).input_ids
    assert tokenizer.decode(with_bos, skip_special_tokens=True) == text
    assert all(0 <= i < len(tokenizer) for i in ids)


def test_greedy_continuations_are_real_words(hf_model, tokenizer, corpus_words) -> None:
    # One left-padded batch: ten separate generate() calls take several times longer on a 2-core box.
    encoded = [tokenizer(p).input_ids for p in EVERYDAY_PROMPTS]
    width = max(map(len, encoded))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    with torch.no_grad():
        gen = hf_model.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False,
                                pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
    all_words: list[str] = []
    for prompt, out in zip(EVERYDAY_PROMPTS, gen[:, width:].tolist()):
        text = tokenizer.decode(out, skip_special_tokens=True)
        words = [w.strip(PUNCT).lower() for w in text.split()]
        words = [w for w in words if w.isalpha()]
        assert words, f"{prompt!r} continued with no words: {text!r}"
        known = [w for w in words if w in corpus_words]
        assert len(known) >= 0.8 * len(words), f"{prompt!r} -> {text!r}: {len(known)}/{len(words)} known"
        all_words += words
    # Guards the per-prompt check against a model that stops at once, or repeats one word (random weights
    # often do): most prompts run on for a while, with varied words.
    assert len(all_words) >= 60
    assert len(set(all_words)) >= 30


def test_model_predicts_unseen_plain_english(hf_model, tokenizer) -> None:
    # Written for this test (not in the corpus). Random weights score ~4000 here, the shipped model ~60.
    text = ("It was a cold morning in the little town, and the people went about their work as usual. "
            "She told her sister that she would come home early, for she was tired and wished to rest. "
            "A friend is one who knows you and loves you just the same.")
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = hf_model(ids, labels=ids).loss.item()
    assert math.exp(loss) < 150


def test_word_list_is_not_trivially_permissive(corpus_words) -> None:
    # The check above means something only if made-up words are absent from the list.
    assert {"the", "house", "friend", "morning", "weather"} <= corpus_words
    assert not {"qzxv", "blorptang", "fnordlewick"} & corpus_words


def test_strataserve_matches_hf_greedy(hf_model, tokenizer) -> None:
    from strataserve import LLM, SamplingParams

    prompts = ["The weather today is", "She opened the door and saw", "A good friend is someone who"]
    expected = [hf_greedy(hf_model, tokenizer(p).input_ids, 32, tokenizer.eos_token_id) for p in prompts]
    llm = LLM(model=str(DEMO_MODEL_DIR), device="cpu", dtype="float32", max_model_len=256,
              kv_cache_memory_gib=0.05, seed=0)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    finally:
        llm.shutdown()
    eos = tokenizer.eos_token_id
    for prompt, want, out in zip(prompts, expected, outs):
        assert list(out.prompt_token_ids) == tokenizer(prompt).input_ids  # same BOS handling as HF
        got = list(out.outputs[0].token_ids)
        strip = lambda t: t[:-1] if t and t[-1] == eos else t  # noqa: E731 - EOS may or may not be listed
        assert strip(got) == strip(want), f"{prompt!r}: strataserve {got} vs HF {want}"
        assert out.outputs[0].text == tokenizer.decode(strip(want), skip_special_tokens=True)
