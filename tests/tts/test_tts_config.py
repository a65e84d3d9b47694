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


def test_base_variant_speaker_encoder_config():
    """A Base config's speaker encoder parses as the reference's config class reads it; its x-vector must be a
    talker row (enc_dim = the talker's width) and its channel lists must agree."""
    raw = json.loads(json.dumps(SHAPES["1.7B"]))
    raw["tts_model_type"] = "base"
    raw["speaker_encoder_config"] = {"enc_dim": 2048, "sample_rate": 24000}
    cfg = tts_config_from_dict(raw, SHAPES["speech_tokenizer"])
    ref = import_reference().Config(**{k: v for k, v in raw.items() if k != "model_type"}).speaker_encoder_config
    assert cfg.speaker_encoder.enc_dim == ref.enc_dim == 2048
    assert list(cfg.speaker_encoder.enc_channels) == list(ref.enc_channels)
    assert list(cfg.speaker_encoder.enc_dilations) == list(ref.enc_dilations)
    assert cfg.speaker_encoder.mel_dim == ref.mel_dim and cfg.speaker_encoder.sample_rate == ref.sample_rate
    raw["speaker_encoder_config"]["enc_dim"] = 1024
    with pytest.raises(UnsupportedTTSVariantError, match="enc_dim=1024 must equal the talker's hidden_size=2048"):
        tts_config_from_dict(raw)
    raw["speaker_encoder_config"] = {"enc_dim": 2048, "enc_channels": [8, 8, 8], "enc_kernel_sizes": [5, 3]}
    with pytest.raises(UnsupportedTTSVariantError, match="one length"):
        tts_config_from_dict(raw)
