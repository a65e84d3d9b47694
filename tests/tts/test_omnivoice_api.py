"""``strata serve OMNIVOICE_DIR`` (a real subprocess, tiny checkpoint, CPU) with real clients (httpx, the ``openai``
client's ``audio.speech``): audio equal to the offline ``TTS(model=DIR)``, a registered voice, sentence chunks
streamed as SSE, batching that does not change any request's audio, bad input -> 400, metrics. Plus loading
errors, named."""
from __future__ import annotations

import base64
import io
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from _tiny_omnivoice import import_reference, make_tiny_omnivoice
from api.api_server import launch
from strataserve.engine.tts import TTS
from strataserve.models.omnivoice.loader import load_omnivoice

TEXT = "Hello world, this is a test."
LONG = " ".join(f"Sentence number {i} goes here." for i in range(20))  # ~37 s estimated: split in pieces
BODY = {"model": "tiny", "input": TEXT, "voice": "auto", "instructions": "female, low pitch", "num_step": 4,
        "seed": 3}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path, _ = make_tiny_omnivoice(tmp_path_factory.mktemp("omnivoice") / "ckpt")
    (path / "voices").mkdir()
    ref = import_reference()  # a registered voice, saved the way the reference package saves one
    tokens = torch.randint(0, 1024, (8, 15), generator=torch.Generator().manual_seed(9))
    ref.VoiceClonePrompt(tokens, "nice to meet you.", 0.05).save(str(path / "voices" / "narrator.pt"))
    return path


@pytest.fixture(scope="module")
def served(ckpt, tmp_path_factory):
    offline = TTS(str(ckpt), device="cpu")
    try:
        outs = offline.generate([TEXT, TEXT, TEXT], instructions="female, low pitch", num_step=4, seed=[3, 4, 3],
                                voice=["auto", "auto", "narrator"])
        long = offline.generate(LONG, num_step=2, seed=1)[0]
    finally:
        offline.shutdown()
    srv = launch(ckpt, tmp_path_factory.mktemp("log") / "server.log", "--max-num-seqs", "8", api_key=None)
    try:
        yield srv, outs, long
    finally:
        srv.stop()


def _post(srv, **body):
    return httpx.post(f"{srv.url}/v1/audio/speech", json={**BODY, **body}, timeout=120)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    """16-bit audio from the server vs the offline float clip (clipped to [-1, 1] like the encoder does)."""
    assert got.shape == want.shape
    np.testing.assert_allclose(got, np.clip(want, -1.0, 1.0), atol=1.5 / 32767)


def test_wav_equals_offline_and_batching_changes_nothing(served):
    srv, outs, _ = served
    wav, sr = sf.read(io.BytesIO(_post(srv, response_format="wav").content), dtype="float32")
    assert sr == 24000 and outs[0].frames.shape[1] == 8 and len(outs[0].waveform) > 0
    _close(wav, outs[0].waveform)
    with ThreadPoolExecutor(4) as pool:  # concurrent requests share batches; each keeps its own audio
        got = list(pool.map(lambda s: _post(srv, response_format="pcm", seed=s).content, [3, 4, 3, 4]))
    for data, out in zip(got, [outs[0], outs[1], outs[0], outs[1]]):
        _close(np.frombuffer(data, "<i2").astype(np.float32) / 32767.0, out.waveform)
    assert not np.array_equal(outs[0].frames, outs[1].frames)


def test_openai_client_and_registered_voice(served):
    openai = pytest.importorskip("openai")
    srv, outs, _ = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
    data = client.audio.speech.create(model="tiny", voice="narrator", input=TEXT, response_format="pcm",
                                      instructions="female, low pitch", extra_body={"num_step": 4, "seed": 3}).content
    _close(np.frombuffer(data, "<i2").astype(np.float32) / 32767.0, outs[2].waveform)


def test_long_input_streams_sentence_chunks(served):
    srv, _, long = served
    events = []
    with httpx.stream("POST", f"{srv.url}/v1/audio/speech", timeout=120,
                      json={**BODY, "input": LONG, "instructions": None, "num_step": 2, "seed": 1,
                            "stream_format": "sse", "response_format": "pcm"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    pcm = np.concatenate([np.frombuffer(base64.b64decode(e["audio"]), "<i2") for e in deltas]).astype(np.float32)
    # each piece is volume-normalised on its own when streamed, the offline clip as a whole: compare the lengths
    # and the frames (the audio of each piece is its frames' decode)
    assert len(pcm) == len(long.waveform)
    assert events[-1]["usage"]["output_tokens"] == len(long.frames)


@pytest.mark.parametrize("body, param, match", [
    ({"input": ""}, "input", "empty"),
    ({"voice": "nobody"}, "voice", "voice 'nobody'"),
    ({"language": "klingon"}, "language", "klingon"),
    ({"num_step": 0}, "num_step", "num_step"),
    ({"guidance_scale": -1}, "guidance_scale", "guidance_scale"),
    ({"top_k": 5}, "top_k", "not used by this model"),
    ({"ref_audio": base64.b64encode(b"RIFF").decode()}, "ref_text", "ref_text is required"),
    ({"ref_audio": "%%%", "ref_text": "hi"}, "ref_audio", "base64"),
    ({"speed": 9.0}, "speed", "less than or equal"),
])
def test_bad_requests_get_openai_errors(served, body, param, match):
    srv, _, _ = served
    r = _post(srv, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(match, err["message"]), err


def test_clone_from_raw_audio_without_encoder_is_a_named_400(served):
    srv, _, _ = served
    buf = io.BytesIO()
    sf.write(buf, np.zeros(2400, np.float32), 24000, format="WAV")
    r = _post(srv, ref_audio=base64.b64encode(buf.getvalue()).decode(), ref_text="hello")
    if r.status_code == 200:  # torchaudio present on this machine: the encoder runs
        assert len(r.content) > 44
    else:
        assert r.status_code == 400 and "torchaudio" in r.json()["error"]["message"]


def test_speed_and_metrics(served):
    srv, outs, _ = served
    fast = np.frombuffer(_post(srv, response_format="pcm", speed=2.0).content, "<i2")
    assert 0 < len(fast) < len(outs[0].waveform)
    text = httpx.get(f"{srv.url}/metrics").text
    for name in ("strata:tts_batch_size_bucket", "strata:tts_batch_padding_waste_sum",
                 "strata:tts_time_to_first_audio_seconds_count", "strata:tts_real_time_factor_count"):
        assert re.search(rf'^{re.escape(name)}{{[^}}]*model_name="tiny"', text, re.M), name
    count = re.search(r'^strata:tts_batch_size_count{model_name="tiny"} (\S+)', text, re.M)
    assert count and float(count.group(1)) >= 5


@pytest.mark.parametrize("breaks, match", [
    (lambda p: (p / "config.json").unlink(), "config.json is missing"),
    (lambda p: shutil.rmtree(p / "audio_tokenizer"), "audio_tokenizer"),
    (lambda p: (p / "model.safetensors").unlink(), "no weights found"),
    (lambda p: (p / "tokenizer.json").unlink(), "text tokenizer"),
    (lambda p: (p / "config.json").write_text(json.dumps({**json.loads((p / "config.json").read_text()),
                                                          "llm_config": {"model_type": "gpt2"}})), "gpt2"),
])
def test_loading_errors_are_named(ckpt, tmp_path, breaks, match):
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    breaks(broken)
    with pytest.raises(ValueError, match=match):
        load_omnivoice(broken, device="cpu")


def test_cloning_from_a_clip_puts_its_tokens_in_the_prompt(ckpt):
    """The encoder (the whole Higgs tokenizer, torchaudio) is stood in for; what is tested is the request built
    around its tokens: denoise tag, transcript before the text, the clip's tokens before the target."""
    from strataserve.engine.omnivoice_requests import OmniVoiceRequests
    from strataserve.types.speech import TTSInputError

    ov = load_omnivoice(ckpt, device="cpu")
    clip = torch.randint(0, 1024, (8, 6))

    def encode(audio: bytes):
        if audio == b"bad":
            raise ValueError("ref_audio: not a readable audio file")
        return clip, 0.05

    reqs, ref = OmniVoiceRequests(ov, encode_reference=encode).build("c", TEXT, ref_audio=b"ok", ref_text="hi there",
                                                                      seed=1)
    (r,) = reqs
    assert ref.rms == 0.05 and r.audio_start + 6 + r.target_len == r.cond_len
    assert torch.equal(r.input_ids[:, r.audio_start:r.audio_start + 6], clip)
    denoise = ov.tokenizer.convert_tokens_to_ids("<|denoise|>")
    assert denoise in r.input_ids[0, :3].tolist()
    plain = OmniVoiceRequests(ov).build("p", TEXT, seed=1)[0][0]
    assert denoise not in plain.input_ids[0].tolist()
    with pytest.raises(TTSInputError, match="readable"):
        OmniVoiceRequests(ov, encode_reference=encode).build("c", TEXT, ref_audio=b"bad", ref_text="hi")


def test_language_instructions_and_chunking_rules():
    from strataserve.engine.omnivoice_requests import normalize_instructions, resolve_language, split_text

    assert resolve_language("English") == "en" and resolve_language("de") == "de" and resolve_language("auto") is None
    assert normalize_instructions(" Female ,LOW pitch，british accent ") == "female, low pitch, british accent"
    assert normalize_instructions("女，低音调") == "女，低音调"
    pieces = split_text("One two three. Four five six seven! Eight, nine ten eleven twelve thirteen.", len, 20)
    assert pieces == ["One two three.", "Four five six seven!", "Eight,", "nine ten eleven", "twelve thirteen."]
    assert all(len(p) <= 20 for p in pieces)
