"""Voice cloning (Base checkpoints) vs the official reference (``qwen-tts-hf``'s ``Qwen3TTSModel``, whose
``generate_voice_clone`` / ``create_voice_clone_prompt`` are the entry points) on a tiny random Base checkpoint:
the x-vector and the reference's codec codes, greedy frames and waveforms in-context and x-vector-only (a mixed
batch), registered voices, and named errors for bad inputs."""
from __future__ import annotations

import base64
import io
import json
import shutil

import numpy as np
import pytest
import soundfile as sf
import torch

from _tiny_tts import import_reference, make_tiny_tts
from strataserve.engine.tts import TTS
from strataserve.types.speech import CloneInput
from strataserve.types.speech import TTSInputError
from strataserve.models.qwen3_tts.audio_input import decode_audio, resample
from strataserve.models.qwen3_tts.config import MissingCheckpointFileError

MAX = 12
GREEDY = dict(temperature=0.0, code_temperature=0.0, max_new_frames=MAX)
REF_GREEDY = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=MAX)
TEXTS = ["Hello world, this is a test.", "Short.", "A longer sentence to speak, with commas and more words."]


def _voice(seconds: float, sr: int, f0: float, seed: int) -> np.ndarray:
    """A voiced-like test signal: harmonics of f0 with a slow vibrato plus a little noise."""
    t = np.arange(int(seconds * sr)) / sr
    phase = 2 * np.pi * f0 * (t + 0.002 * np.sin(2 * np.pi * 3 * t))
    x = sum(np.sin(k * phase) / k for k in range(1, 6)) * 0.2
    return (x + 0.02 * np.random.default_rng(seed).standard_normal(len(t))).astype(np.float32)


def _wav_bytes(x: np.ndarray, sr: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, sr, format="WAV", subtype="FLOAT")
    return buf.getvalue()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from transformers import EncodecFeatureExtractor

    ref = import_reference()  # first: it lets qwen_tts import without torchaudio
    from qwen_tts._transformers_compat import restore_mimi_full_attention
    from qwen_tts.core.models import Qwen3TTSProcessor

    path, model, speech_tok = make_tiny_tts(tmp_path_factory.mktemp("tts") / "base", kind="base", seed=2)
    tts = TTS(str(path), device="cpu", max_num_seqs=8)
    # the reference's wrapper, assembled as its from_pretrained does (no hub access here)
    restore_mimi_full_attention(speech_tok)
    st = ref.SpeechTokenizer()
    st.model, st.config, st.device = speech_tok, speech_tok.config, torch.device("cpu")
    st.feature_extractor = EncodecFeatureExtractor(feature_size=1, sampling_rate=24000, padding_value=0.0)
    model.load_speech_tokenizer(st)
    wrapper = ref.Wrapper(model, Qwen3TTSProcessor(tokenizer=tts.model.tokenizer), {})
    refs = {"a": (_voice(0.4, 24000, 140.0, 0), 24000), "b": (_voice(0.3, 16000, 210.0, 1), 16000)}
    return path, tts, wrapper, refs


def _reference_frames(wrapper, texts, languages, items):
    """What ``generate_voice_clone`` feeds the model, from the reference's own prompt items -> frames per text."""
    tok = wrapper._tokenize_texts
    ids = tok([wrapper._build_assistant_text(t) for t in texts])
    ref_ids = [tok([wrapper._build_ref_text(it.ref_text)])[0] if it.ref_text else None for it in items]
    codes, _ = wrapper.model.generate(input_ids=ids, ref_ids=ref_ids, languages=languages,
                                      voice_clone_prompt=wrapper._prompt_items_to_voice_clone_prompt(items),
                                      non_streaming_mode=False, **wrapper._merge_generate_kwargs(**REF_GREEDY))
    return [c.tolist() for c in codes]


def test_speaker_embedding_and_reference_codes_match(base):
    _, tts, wrapper, refs = base
    for key in ("a", "b"):  # b is at 16 kHz: resampled to 24 kHz for both encoders, as the reference does
        ours = tts.model.cloner.prompt(refs[key], "the words", x_vector_only=False)
        theirs = wrapper.create_voice_clone_prompt(ref_audio=refs[key], ref_text="the words")[0]
        torch.testing.assert_close(ours.speaker_embedding, theirs.ref_spk_embedding, rtol=1e-5, atol=1e-4)
        assert ours.ref_codes is not None and torch.equal(ours.ref_codes, theirs.ref_code)
        assert ours.ref_codes.shape[1] == 4 and len(set(map(tuple, ours.ref_codes.tolist()))) > 5  # varied
    assert tts.model.cloner.prompt(refs["a"], None, x_vector_only=True).ref_codes is None


def test_in_context_and_x_vector_batch_matches_reference(base):
    _, tts, wrapper, refs = base
    langs = ["english", "auto", "chinese"]
    modes = [dict(ref_audio=refs["a"], ref_text="Hello there, my friend."),
             dict(ref_audio=refs["b"], ref_text=None, x_vector_only=True),
             dict(ref_audio=refs["b"], ref_text="Good morning!")]
    items = [wrapper.create_voice_clone_prompt(ref_audio=m["ref_audio"], ref_text=m["ref_text"],
                                               x_vector_only_mode=m.get("x_vector_only", False))[0] for m in modes]
    expected = _reference_frames(wrapper, TEXTS, langs, items)
    outs = tts.generate(TEXTS, language=langs, ref_audio=[m["ref_audio"] for m in modes],
                        ref_text=[m["ref_text"] for m in modes],
                        x_vector_only=[m.get("x_vector_only", False) for m in modes], **GREEDY)
    assert [o.frames.tolist() for o in outs] == expected
    assert min(len(e) for e in expected) > 0
    for i, m in enumerate(modes):  # the waveform of generate_voice_clone (reference frames decoded, then cut)
        wavs, sr = wrapper.generate_voice_clone(TEXTS[i], language=langs[i], ref_audio=m["ref_audio"],
                                                ref_text=m["ref_text"], x_vector_only_mode=items[i].x_vector_only_mode,
                                                **REF_GREEDY)
        assert sr == outs[i].sample_rate and outs[i].waveform.shape == wavs[0].shape
        np.testing.assert_allclose(outs[i].waveform, wavs[0], rtol=0, atol=2e-5)


def test_registered_voices_from_folder_and_api(base, tmp_path):
    path, tts, _, refs = base
    voices = tmp_path / "voices"
    voices.mkdir()
    sf.write(voices / "alice.wav", *refs["a"], subtype="FLOAT")
    (voices / "alice.txt").write_text("Hello there, my friend.\n")
    sf.write(voices / "bob.flac", refs["b"][0], refs["b"][1], subtype="PCM_24")
    named = TTS(tts.model, max_num_seqs=4)
    assert named.voices == []
    named.model.cloner.register_folder(voices)
    assert named.voices == ["alice", "bob"]
    assert named.model.cloner.voices["bob"].ref_codes is None  # no transcript: x-vector only
    got = named.generate(TEXTS[:2], voice=["alice", "alice"], x_vector_only=[False, True], **GREEDY)
    direct = named.generate(TEXTS[:2], ref_audio=str(voices / "alice.wav"),
                            ref_text="Hello there, my friend.", x_vector_only=[False, True], **GREEDY)
    assert [o.frames.tolist() for o in got] == [o.frames.tolist() for o in direct]
    assert got[0].frames.tolist() != got[1].frames.tolist()
    # base64 of the file bytes and a data URL decode to the same prompt
    b64 = base64.b64encode(_wav_bytes(*refs["a"])).decode()
    url = named.generate(TEXTS[0], ref_audio="data:audio/wav;base64," + b64, ref_text="Hello there, my friend.",
                         **GREEDY)[0]
    assert url.frames.tolist() == got[0].frames.tolist()
    named.model.cloner.voices.clear()


def test_raw_pcm_data_url_is_read_at_its_rate(base):
    tts = base[1]
    x = base[3]["b"][0]
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2")
    url = "data:audio/pcm;rate=16000;base64," + base64.b64encode(pcm.tobytes()).decode()
    got = tts.model.cloner.prompt(url, "words")
    want = tts.model.cloner.prompt((pcm.astype(np.float32) / 32768.0, 16000), "words")
    torch.testing.assert_close(got.speaker_embedding, want.speaker_embedding)
    assert torch.equal(got.ref_codes, want.ref_codes)


def test_resample_equals_librosa_and_channels_are_averaged():
    import librosa  # what the reference resamples with (its default: soxr HQ, length fixed to ceil(n * ratio))

    rng = np.random.default_rng(5)
    for sr in (8000, 16000, 22050, 44100, 48000):
        x = (0.1 * rng.standard_normal(int(0.37 * sr) + 3)).astype(np.float32)
        want = librosa.resample(x, orig_sr=sr, target_sr=24000)
        got = resample(x, sr, 24000)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    stereo = np.stack([x, -0.5 * x], axis=1)
    mono, rate = decode_audio(_wav_bytes(stereo, 48000))
    assert rate == 48000 and mono.shape == x.shape
    np.testing.assert_allclose(mono, 0.25 * x, atol=1e-7)


@pytest.mark.parametrize("kw, match", [
    (dict(clone=CloneInput(ref_audio="@@not base64@@", ref_text="x")), "not valid base64"),
    (dict(clone=CloneInput(ref_audio=base64.b64encode(b"RIFF0000WAVEjunk").decode(), ref_text="x")),
     "could not be decoded"),
    (dict(clone=CloneInput(ref_audio=(np.zeros(100, np.float32), 24000), ref_text="x")), "lasts 0.00 s"),
    (dict(clone=CloneInput(ref_audio="data:audio/pcm;base64,AAAA", ref_text="x")), "even number of bytes"),
    (dict(clone=CloneInput(ref_audio=(np.ones(24000, np.float32), 24000))), "ref_text is required"),
    (dict(clone=CloneInput(ref_audio=(np.ones(24000, np.float32), 24000), ref_text="   ")), "ref_text is required"),
    (dict(clone=CloneInput(ref_text="words")), "without ref_audio"),
    (dict(voice="nobody"), "voice 'nobody' is not available"),
    (dict(voice="x", clone=CloneInput(ref_audio=(np.ones(24000, np.float32), 24000), x_vector_only=True)),
     "both given"),
    (dict(instructions="calm", clone=CloneInput(ref_audio=(np.ones(24000, np.float32), 24000),
                                                  x_vector_only=True)), "instructions"),
])
def test_bad_clone_requests_raise(base, kw, match):
    tts = base[1]
    with pytest.raises(TTSInputError, match=match):
        tts.submit("Hello.", **kw)
    assert not tts.has_unfinished() and tts.runner.states == {}


def test_clone_fields_on_a_custom_voice_model_and_missing_encoder(weak_eos_ckpt, base, tmp_path):
    custom = TTS(str(weak_eos_ckpt), device="cpu", max_num_seqs=2)
    with pytest.raises(TTSInputError, match="needs a Base checkpoint"):
        custom.submit("Hello.", voice="ryan", clone=CloneInput(ref_audio=base[3]["a"], ref_text="hi"))
    with pytest.raises(ValueError, match="Base"):
        custom.register_voice("x", base[3]["a"])
    variant = tmp_path / "no_speaker_encoder"
    shutil.copytree(weak_eos_ckpt, variant)
    cfg = json.loads((variant / "config.json").read_text())
    cfg["tts_model_type"] = "base"
    (variant / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MissingCheckpointFileError, match="speaker_encoder"):
        TTS(str(variant), device="cpu")
    # a Base checkpoint whose speech tokenizer lacks its encoder (in-context cloning needs it)
    from safetensors.torch import load_file, save_file

    no_enc = tmp_path / "no_codec_encoder"
    shutil.copytree(base[0], no_enc)
    st = no_enc / "speech_tokenizer" / "model.safetensors"
    save_file({k: v for k, v in load_file(str(st)).items() if not k.startswith("encoder.")}, str(st))
    with pytest.raises(MissingCheckpointFileError, match="no encoder"):
        TTS(str(no_enc), device="cpu")
