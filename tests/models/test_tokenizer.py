"""Tokenizer + chat template loaded from the checkpoint folder, checked against transformers directly."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _tiny_models import BOS_ID, EOS_ID, IM_END_ID, IM_START_ID, make_tiny_checkpoint
from strataserve.models.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo wörld 中文 🙂"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tok"), vocab_size=400)


def test_chat_template_matches_transformers(ckpt):
    from transformers import AutoTokenizer

    tok = Tokenizer.from_pretrained(ckpt)
    ref = AutoTokenizer.from_pretrained(str(ckpt))
    text = tok.render_chat(MESSAGES)
    assert text == ref.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(MESSAGES)
    assert ids == list(ref.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"])
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1  # the template's bos, no second one
    assert ids.count(IM_START_ID) == 3 and ids.count(IM_END_ID) == 2
    no_prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert ids[:len(no_prompt)] == no_prompt and len(no_prompt) < len(ids)


def test_developer_role_renders_as_system_unless_the_template_knows_it(ckpt):
    from strataserve.assets import DEMO_MODEL_DIR

    dev = [{**MESSAGES[0], "role": "developer"}, MESSAGES[1]]
    tok = Tokenizer.from_pretrained(ckpt)
    assert tok.render_chat(dev) == tok.render_chat(MESSAGES)
    demo = Tokenizer.from_pretrained(DEMO_MODEL_DIR)  # its template raises on any role but system/user/assistant
    assert demo.render_chat(dev) == demo.render_chat(MESSAGES)
    knows = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}{# developer #}"
    assert tok.render_chat(dev, chat_template=knows).startswith("[developer:be brief]")


def test_encode_decode_round_trip_multibyte(ckpt):
    tok = Tokenizer.from_pretrained(ckpt)
    text = "naïve café — 中文 🙂 the end"
    ids = tok.encode(text)
    assert ids[0] == BOS_ID
    assert tok.decode(ids) == text
    assert max(ids) < tok.vocab_size == 400


def test_eos_ids_from_config_generation_config_and_tokenizer(ckpt, tmp_path):
    assert Tokenizer.from_pretrained(ckpt).eos_token_ids == (EOS_ID,)
    for f in ckpt.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen["eos_token_id"] = [EOS_ID, IM_END_ID]
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids == (EOS_ID, IM_END_ID) and tok.eos_token_id == EOS_ID


def test_errors(ckpt, tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="no tokenizer files"):
        Tokenizer.from_pretrained(tmp_path)
    tok = Tokenizer.from_pretrained(ckpt)
    tok.hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.render_chat(MESSAGES)


def test_generic_tokenizer_class_loads_directly_and_equals_autotokenizer(ckpt, tmp_path):
    """tokenizer_class PreTrainedTokenizerFast / TokenizersBackend is loaded by that class, skipping AutoTokenizer's
    imports; it must be the object AutoTokenizer builds. Any other class still goes through AutoTokenizer."""
    from transformers import AutoTokenizer

    from strataserve.models.tokenizer import GENERIC_TOKENIZER_CLASSES, tokenizer_class_name

    demo = Path(__file__).resolve().parents[2] / "strataserve" / "assets" / "demo_llama"
    texts = ["héllo wörld 中文 🙂", "  leading spaces and\ttabs\n", "<|im_start|>user", ""]
    for folder in (ckpt, demo):
        assert tokenizer_class_name(Path(folder)) in GENERIC_TOKENIZER_CLASSES  # the direct path is taken
        ours, ref = Tokenizer.from_pretrained(folder).hf, AutoTokenizer.from_pretrained(str(folder))
        assert type(ours) is type(ref)
        for text in texts:
            ids = ours.encode(text)
            assert ids == ref.encode(text)
            assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        assert ours.all_special_ids == ref.all_special_ids and len(ours) == len(ref)
        assert ours.chat_template == ref.chat_template
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert type(Tokenizer.from_pretrained(other).hf).__name__ == "Qwen2Tokenizer"  # through AutoTokenizer
    (other / "tokenizer_config.json").write_text("{not json")
    assert tokenizer_class_name(other) is None
