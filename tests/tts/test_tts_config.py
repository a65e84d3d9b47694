"""The committed real-shape configs (``public_shapes.json``) parse into the runner's configs as the reference's
config classes read them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import strataserve.models.qwen3_tts as pkg
from _tiny_tts import import_reference
from strataserve.models.qwen3_tts.config import UnsupportedTTSVariantError, tts_config_from_dict

SHAPES = json.loads((Path(pkg.__file__).parent / "public_shapes.json").read_text())


@pytest.mark.parametrize("name", ["1.7B", "0.6B"])
def test_public_shapes_parse_like_the_reference(name):
    raw = SHAPES[name]
    cfg = tts_config_from_dict(raw, SHAPES["speech_tokenizer"])
    ref = import_reference().Config(**{k: v for k, v in raw.items() if k != "model_type"})
    t, p = ref.talker_config, ref.talker_config.code_predictor_config
    assert (cfg.talker.hidden_size, cfg.talker.num_layers, cfg.talker.num_kv_heads, cfg.talker.head_dim) == \
        (t.hidden_size, t.num_hidden_layers, t.num_key_value_heads, t.head_dim)
    assert (cfg.code_predictor.hidden_size, cfg.code_predictor.num_layers, cfg.code_predictor.vocab_size) == \
        (p.hidden_size, p.num_hidden_layers, p.vocab_size)
    assert cfg.num_code_groups == t.num_code_groups == 16 and cfg.codec_eos_id == t.codec_eos_token_id
    # the reference's generate suppresses [vocab - 1024, vocab) except eos
    assert cfg.suppressed_ids == [i for i in range(t.vocab_size - 1024, t.vocab_size) if i != t.codec_eos_token_id]
    assert cfg.languages == ["auto", "english", "chinese"] and cfg.speakers == {"ryan": 3000}
    assert cfg.codec.total_upsample == cfg.codec.decode_upsample_rate == 1920


def test_unsupported_fields_are_named():
    raw = json.loads(json.dumps(SHAPES["1.7B"]))
    raw["talker_config"]["hidden_act"] = "gelu"
    with pytest.raises(UnsupportedTTSVariantError, match="hidden_act"):
        tts_config_from_dict(raw)
    raw = json.loads(json.dumps(SHAPES["1.7B"]))
    raw["talker_config"]["code_predictor_config"]["num_code_groups"] = 8
    with pytest.raises(UnsupportedTTSVariantError, match="num_code_groups"):
        tts_config_from_dict(raw)
