"""Qwen3-TTS on the engine vs the official reference (``qwen-tts-hf``) on tiny random checkpoints: greedy frames
identical (batched, chunked prefill, mid-flight arrivals, preemption), the codec's waveform within float
tolerance, seeded sampling independent of the batch, and named errors for bad checkpoints / inputs."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch


from _tiny_tts import make_tiny_tts, reference_codes  # noqa: E402
from strataserve.engine.tts import TTS  # noqa: E402
from strataserve.types.speech import SpeechParams, TTSInputError
from strataserve.models.qwen3_tts.config import MissingCheckpointFileError, UnsupportedTTSVariantError  # noqa: E402

TEXTS = ["Hello world, this is a test.", "Short.", "A somewhat longer sentence to speak, with commas and more.",
         "Good morning to you all", "Why?"]
VOICES = ["ryan", "vivian", "eric", "ryan", "vivian"]
LANGS = ["english", "auto", "chinese", "auto", "english"]  # eric + chinese/auto picks his dialect id
MAX = 16
GREEDY = dict(temperature=0.0, code_temperature=0.0, max_new_frames=MAX)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path, ref, codec = make_tiny_tts(tmp_path_factory.mktemp("tts") / "custom")
    tts = TTS(str(path), device="cpu", max_num_seqs=8)
    expected = reference_codes(ref, tts.model.tokenizer, TEXTS, LANGS, VOICES, max_new_tokens=MAX)
    return path, ref, codec, tts, expected


def test_greedy_batch_matches_reference(ckpt):
    _, _, _, tts, expected = ckpt
    outs = tts.generate(TEXTS, voice=VOICES, language=LANGS, **GREEDY)
    assert [o.frames.tolist() for o in outs] == expected
    assert tts.runner.fused_steps > 0, "all-decode steps take the fused step (the one CUDA graphs capture)"
    lengths = {len(e) for e in expected}
    assert len(lengths) > 1 and min(lengths) > 0, "the texts should end at different frames (eos and length)"
    for o, e in zip(outs, expected):
        assert o.finish_reason == ("length" if len(e) == MAX - 1 else "stop")


def test_chunked_prefill_and_mid_flight_arrivals(ckpt):
    path, _, _, tts, expected = ckpt
    small = TTS(tts.model, max_num_seqs=8, max_num_batched_tokens=7)  # every prompt spans several steps
    ids = {}
    for i in (0, 1):
        ids[small.submit(TEXTS[i], voice=VOICES[i], language=LANGS[i], params=SpeechParams(
            temperature=0.0, code_temperature=0.0, max_new_frames=MAX))] = i
    results, steps = {}, 0
    while small.has_unfinished() or len(ids) < len(TEXTS):
        if steps in (3, 6, 9) and len(ids) < len(TEXTS):  # join while others decode / prefill
            i = len(ids)
            ids[small.submit(TEXTS[i], voice=VOICES[i], language=LANGS[i], params=SpeechParams(
                temperature=0.0, code_temperature=0.0, max_new_frames=MAX))] = i
        for o in small.step():
            results[ids[o.request_id]] = o.frames.tolist()
        steps += 1
    assert [results[i] for i in range(len(TEXTS))] == expected
    assert small.runner.states == {}
    assert small.runner.fused_steps > 0


def test_preemption_recompute_keeps_frames(ckpt):
    _, _, _, tts, expected = ckpt
    tight = TTS(tts.model, max_num_seqs=8, num_blocks=8, block_size=4)
    outs = tight.generate(TEXTS, voice=VOICES, language=LANGS, **GREEDY)
    assert tight.core.scheduler.num_preemptions > 0, "the pool should be too small for all five at once"
    assert [o.frames.tolist() for o in outs] == expected


def test_waveform_matches_reference_codec(ckpt):
    _, _, codec, tts, expected = ckpt
    out = tts.generate(TEXTS[2], voice="eric", language="chinese", **GREEDY)[0]
    codes = torch.tensor(expected[2]).T[None]
    with torch.no_grad():
        ref = codec.chunked_decode(codes)[0, 0].numpy()
    assert out.waveform.dtype == np.float32 and out.waveform.shape == ref.shape
    assert out.waveform.std() > 0.05  # filled codebooks: real signal, not silence
    np.testing.assert_allclose(out.waveform, ref, rtol=0, atol=2e-5)
    # longer than one 300-frame chunk: the reference's chunking with 25 frames of left context
    long = torch.randint(0, 64, (1, 4, 330), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref_long = codec.chunked_decode(long)[0, 0].numpy()
    ours = tts.model.codec.decode(long)[0].numpy()
    np.testing.assert_allclose(ours, ref_long, rtol=0, atol=2e-5)


def test_seeded_sampling_is_independent_of_batch(ckpt):
    _, _, _, tts, _ = ckpt
    kw = dict(temperature=0.9, top_k=20, code_temperature=0.9, max_new_frames=MAX)
    alone = tts.generate(TEXTS[0], voice="ryan", language="english", seed=7, **kw)[0].frames.tolist()
    crowd = tts.generate(TEXTS[:4], voice=VOICES[:4], language=["english"] * 4, seed=[3, 7, 7, 11], **kw)
    # same text + seed in another slot of a different batch
    mixed = tts.generate([TEXTS[1], TEXTS[0]], voice=["vivian", "ryan"], language=["auto", "english"],
                         seed=[5, 7], **kw)
    assert mixed[1].frames.tolist() == alone
    assert crowd[0].frames.tolist() != crowd[1].frames.tolist() or crowd[0].frames.size == 0
    other = tts.generate(TEXTS[0], voice="ryan", language="english", seed=8, **kw)[0].frames.tolist()
    assert other != alone


def test_voice_design_with_instructions_matches_reference(tmp_path):
    path, ref, _ = make_tiny_tts(tmp_path / "design", kind="voice_design", seed=1)
    tts = TTS(str(path), device="cpu")
    assert tts.voices == ["default"]
    instr = ["A calm deep voice", None, "Fast and cheerful"]
    expected = reference_codes(ref, tts.model.tokenizer, TEXTS[:3], ["english", "auto", "chinese"],
                               [None, None, None], instructions=instr, max_new_tokens=MAX)
    outs = tts.generate(TEXTS[:3], language=["english", "auto", "chinese"], instructions=instr, **GREEDY)
    assert [o.frames.tolist() for o in outs] == expected


@pytest.mark.parametrize("kw, match", [
    (dict(text="", voice="ryan"), "empty"),
    (dict(text="   ", voice="ryan"), "empty"),
    (dict(text="x" * 4097, voice="ryan"), "limit is 4096"),
    (dict(text="hi", voice="nobody"), "voice 'nobody'"),
    (dict(text="hi", voice=None), "voice is required for this model: one of eric, ryan, vivian"),
    (dict(text="hi", voice="ryan", language="klingon"), "language 'klingon'"),
    (dict(text="hi", voice="ryan", params=SpeechParams(top_p=0.0)), "top_p"),
    (dict(text="hi", voice="ryan", params=SpeechParams(max_new_frames=0)), "max_new_frames=0"),
    (dict(text="hi", voice="ryan", params=SpeechParams(code_top_p=1.5)), "code_top_p=1.5"),
])
def test_bad_requests_raise(ckpt, kw, match):
    tts = ckpt[3]
    with pytest.raises(TTSInputError, match=match):
        tts.submit(**kw)
    assert not tts.has_unfinished() and tts.runner.states == {}


def test_checkpoint_errors_are_named(ckpt, tmp_path):
    path = ckpt[0]
    with pytest.raises(MissingCheckpointFileError, match="not a directory"):
        TTS(str(tmp_path / "nope"), device="cpu")
    bad = tmp_path / "no_codec"
    shutil.copytree(path, bad)
    shutil.rmtree(bad / "speech_tokenizer")
    with pytest.raises(MissingCheckpointFileError, match="speech_tokenizer"):
        TTS(str(bad), device="cpu")
    for field, value, match in [("tts_model_type", "karaoke", "tts_model_type='karaoke'"),
                                ("tokenizer_type", "qwen3_tts_tokenizer_25hz", "12 Hz")]:
        variant = tmp_path / f"{field}-{value}"
        shutil.copytree(path, variant)
        cfg = json.loads((variant / "config.json").read_text())
        cfg[field] = value
        (variant / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(UnsupportedTTSVariantError, match=match):
            TTS(str(variant), device="cpu")
