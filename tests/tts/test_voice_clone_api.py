"""``strata serve BASE_DIR`` (a real subprocess, tiny Base checkpoint, CPU): voice cloning through
``/v1/audio/speech`` with httpx and the ``openai`` client -- ``ref_audio`` (base64) + ``ref_text``, x-vector only,
a voice registered from the checkpoint's ``voices/`` folder -- equal to the offline ``TTS``, and 400s for bad
cloning input."""
from __future__ import annotations

import base64
import io
import re

import httpx
import numpy as np
import pytest
import soundfile as sf

from _tiny_tts import make_tiny_tts
from api.api_server import launch
from strataserve.engine.tts import TTS

TEXT = "Hello world, this is a test."
REF_TEXT = "Hello there, my friend."
# codebooks 1.. sampled (0.9) as the checkpoint's default, reproducibly per seed (temperature 0 alone would make
# them greedy too)
SEEDED = {"temperature": 0, "code_temperature": 0.9, "seed": 0, "max_new_frames": 10}


def _ref_wav() -> tuple[np.ndarray, int]:
    # 22.05 kHz (resampled to the model's 24 kHz); 0.2 s = 13 frames of the tiny encoder, so that reference + new
    # frames stay within the 25 frames of left context every streamed chunk is decoded with: the tiny codec's
    # receptive field is longer than that (the real one's is not), so only then is streaming exact here
    t = np.arange(int(0.2 * 22050)) / 22050
    x = 0.3 * np.sin(2 * np.pi * 150 * t) + 0.1 * np.sin(2 * np.pi * 450 * t)
    return (x + 0.02 * np.random.default_rng(3).standard_normal(len(t))).astype(np.float32), 22050


def _pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_tts(tmp_path_factory.mktemp("tts") / "base", kind="base", seed=4, eos_boost=0.3)[0]
    wav, sr = _ref_wav()
    (path / "voices").mkdir()
    sf.write(path / "voices" / "alice.wav", wav, sr, subtype="PCM_16")
    (path / "voices" / "alice.txt").write_text(REF_TEXT)
    data, _ = sf.read(path / "voices" / "alice.wav", dtype="float32")
    offline = TTS(str(path), device="cpu")
    assert offline.voices == ["alice"]
    kw = dict(language="english", temperature=0, code_temperature=0.9, seed=0, max_new_frames=10)
    expected = {"icl": offline.generate(TEXT, voice="alice", **kw)[0],
                "xvec": offline.generate(TEXT, ref_audio=(data, sr), x_vector_only=True, **kw)[0]}
    buf = io.BytesIO()
    sf.write(buf, data, sr, format="WAV", subtype="PCM_16")
    b64 = base64.b64encode(buf.getvalue()).decode()
    srv = launch(path, tmp_path_factory.mktemp("log") / "server.log", "--max-num-seqs", "4", api_key=None)
    try:
        yield srv, expected, b64
    finally:
        srv.stop()


def _post(srv, **body):
    payload = {"model": "tiny", "input": TEXT, "language": "english", **SEEDED, **body}
    return httpx.post(f"{srv.url}/v1/audio/speech", json=payload, timeout=60)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    # the offline clip is cut after decoding reference + new frames together (the reference's rule, which may
    # keep one sample more); the server streams the new frames decoded with the reference as left context
    assert abs(len(got) - len(want)) <= 1 and len(got) > 0
    n = min(len(got), len(want))
    np.testing.assert_allclose(got[-n:], want[-n:], atol=1.5 / 32767)


def test_ref_audio_and_registered_voice_match_offline(served):
    srv, expected, b64 = served
    wrapped = "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76)) + "\n"  # as `base64 clip.wav` prints it
    for body in ({"ref_audio": b64, "ref_text": REF_TEXT}, {"ref_audio": "data:audio/wav;base64," + b64,
                                                              "ref_text": REF_TEXT}, {"voice": "alice"},
                 {"ref_audio": wrapped, "ref_text": REF_TEXT}):
        r = _post(srv, response_format="pcm", **body)
        assert r.status_code == 200, r.text
        _close(_pcm(r.content), expected["icl"].waveform)
    r = _post(srv, response_format="wav", ref_audio=b64, x_vector_only=True)
    wav, sr = sf.read(io.BytesIO(r.content), dtype="float32")
    assert sr == 24000
    _close(wav, expected["xvec"].waveform)
    assert not np.allclose(expected["xvec"].waveform[:100], expected["icl"].waveform[:100])


def test_openai_client_with_a_registered_voice(served):
    openai = pytest.importorskip("openai")
    srv, expected, _ = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
    got = client.audio.speech.create(model="tiny", voice="alice", input=TEXT, response_format="pcm",
                                     extra_body={"language": "english", **SEEDED}).content
    _close(_pcm(got), expected["icl"].waveform)
    models = httpx.get(f"{srv.url}/v1/models").json()["data"]
    assert models[0]["voices"] == ["alice"]


@pytest.mark.parametrize("body, param, match", [
    ({"ref_audio": "@@@", "ref_text": "x"}, "ref_audio", "not valid base64"),
    ({"ref_audio": base64.b64encode(b"not audio at all").decode(), "ref_text": "x"}, "ref_audio", "decoded"),
    ({"ref_audio": "data:audio/pcm;rate=24000;base64," + base64.b64encode(bytes(9600)).decode()}, "ref_text",
     "ref_text is required"),
    ({"ref_text": "x"}, "ref_text", "without ref_audio"),
    ({"voice": "bob"}, "voice", "voice 'bob'.*alice"),
    ({"voice": "alice", "instructions": "calm"}, "instructions", "instructions"),
    ({"ref_audio": "/etc/hostname", "ref_text": "x"}, "ref_audio", "base64"),  # never a server-side path
])
def test_bad_clone_input_gets_400(served, body, param, match):
    srv = served[0]
    r = _post(srv, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(match, err["message"]), err
