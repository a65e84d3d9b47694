"""OmniVoice's audio decode (our decode half of the Higgs audio v2 tokenizer) against the reference decode
(transformers' ``HiggsAudioV2TokenizerModel.decode``) recorded on the H200 by ``benchmarks/record_omnivoice_ref.py``
(float32, TF32 off) from the same weights; and batching: clips decoded together equal clips decoded alone."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strataserve.models.omnivoice.codec import load_higgs_decoder

DATA = Path(__file__).resolve().parents[1] / "data" / "omnivoice_codec"


@pytest.fixture(scope="module")
def decoder():
    return load_higgs_decoder(DATA, torch.device("cpu"))


def test_decode_matches_the_recorded_reference(decoder):
    codes = torch.load(DATA / "codes.pt")
    ref = torch.load(DATA / "reference_audio.pt")
    short = codes[0, :, :5]
    out = decoder.decode_batch([codes[0], short, codes[1]])
    assert out[0].shape == ref[0].shape and out[2].shape == ref[1].shape
    for got, want in ((out[0], ref[0]), (out[2], ref[1])):
        scale = want.abs().max()
        assert scale > 0
        assert torch.allclose(got, want, atol=1e-4 * float(scale), rtol=1e-4), float((got - want).abs().max())
    assert out[1].shape[0] == 5 * decoder.config.hop_length


def test_batched_decode_equals_single(decoder):
    codes = torch.load(DATA / "codes.pt")
    together = decoder.decode_batch([codes[0], codes[1], codes[0, :, :7]])
    alone = [decoder.decode_batch([c])[0] for c in (codes[0], codes[1], codes[0, :, :7])]
    for a, b in zip(together, alone):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_missing_weights_are_named(tmp_path):
    (tmp_path / "config.json").write_text((DATA / "config.json").read_text())
    with pytest.raises(ValueError, match="model.safetensors is missing"):
        load_higgs_decoder(tmp_path, torch.device("cpu"))
