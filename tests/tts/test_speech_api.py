"""``strata serve QWEN3_TTS_DIR`` (a real subprocess, tiny checkpoint, CPU) with real clients: httpx and the
``openai`` client's ``audio.speech``, streamed and not, every format, SSE, bad inputs, disconnects, metrics."""
from __future__ import annotations

import base64
import io
import json
import re
import time

import httpx
import numpy as np
import pytest
import soundfile as sf

from api.api_server import launch
from strataserve.engine.tts import TTS

TEXT = "Hello world, this is a test."
GREEDY = {"temperature": 0, "max_new_frames": 12}
SR = 24000


@pytest.fixture(scope="module")
def served(weak_eos_ckpt, tmp_path_factory):
    # a weak eos row: every clip runs to max_new_frames, so lengths (and the disconnect test) are predictable
    path = weak_eos_ckpt
    offline = TTS(str(path), device="cpu")
    out = offline.generate(TEXT, voice="ryan", language="english", temperature=0, code_temperature=0, seed=0,
                           max_new_frames=12)[0]
    srv = launch(path, tmp_path_factory.mktemp("log") / "server.log", "--max-num-seqs", "4", api_key=None)
    try:
        yield srv, out
    finally:
        srv.stop()


def _post(srv, **body):
    payload = {"model": "tiny", "input": TEXT, "voice": "ryan", "language": "english", "seed": 0, **GREEDY, **body}
    # json.dumps writes NaN as Python clients do (httpx's own encoder refuses it)
    return httpx.post(f"{srv.url}/v1/audio/speech", content=json.dumps(payload), timeout=60,
                      headers={"content-type": "application/json"})


def _pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0


def test_wav_and_pcm_match_offline_synthesis(served):
    srv, out = served
    r = _post(srv, response_format="wav")
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    assert out.frames.shape == (11, 4)  # 12 first-codebook ids -> 11 complete frames
    wav, sr = sf.read(io.BytesIO(r.content), dtype="float32")
    assert sr == SR and wav.shape == out.waveform.shape
    np.testing.assert_allclose(wav, out.waveform, atol=1.5 / 32767)
    pcm = _pcm(_post(srv, response_format="pcm").content)
    np.testing.assert_allclose(pcm, out.waveform, atol=1.5 / 32767)


def test_temperature_0_is_one_clip_and_code_sampling_can_be_set(served, weak_eos_ckpt):
    """temperature 0 makes the code predictor greedy too (the checkpoint samples codes at 0.9): the same clip
    without a seed; code_temperature (or the reference's subtalker_temperature) samples them again, seeded as
    offline."""
    srv, out = served
    unseeded = [_post(srv, response_format="pcm", seed=None).content for _ in range(2)]
    assert unseeded[0] == unseeded[1]
    np.testing.assert_allclose(_pcm(unseeded[0]), out.waveform, atol=1.5 / 32767)
    sampled = TTS(str(weak_eos_ckpt), device="cpu").generate(TEXT, voice="ryan", language="english", temperature=0,
                                                             code_temperature=0.9, seed=0, max_new_frames=12)[0]
    for name in ("code_temperature", "subtalker_temperature"):
        pcm = _pcm(_post(srv, response_format="pcm", **{name: 0.9}).content)
        np.testing.assert_allclose(pcm, sampled.waveform, atol=1.5 / 32767)
    assert np.abs(sampled.waveform - out.waveform).max() > 0.01  # the sampled codes are another clip


def test_flac_is_lossless_and_mp3_decodes(served):
    srv, out = served
    flac, sr = sf.read(io.BytesIO(_post(srv, response_format="flac").content), dtype="float32")
    np.testing.assert_allclose(flac, out.waveform, atol=1.5 / 32767)
    r = _post(srv, response_format="mp3")
    assert r.headers["content-type"] == "audio/mpeg"
    mp3, sr = sf.read(io.BytesIO(r.content), dtype="float32")
    assert sr == SR and abs(len(mp3) - len(out.waveform)) < 2 * 1152 and np.abs(mp3).max() > 0.01


def test_openai_client_streamed_and_not(served):
    openai = pytest.importorskip("openai")
    srv, out = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
    extra = {"language": "english", "seed": 0, **GREEDY}
    whole = client.audio.speech.create(model="tiny", voice="ryan", input=TEXT, response_format="pcm",
                                       extra_body=extra).content
    with client.audio.speech.with_streaming_response.create(model="tiny", voice="ryan", input=TEXT,
                                                            response_format="pcm", extra_body=extra) as resp:
        chunks = [c for c in resp.iter_bytes() if c]
    # chunk boundaries follow timing, and each chunk is decoded with its own left context: equal to the last bit
    # of float32, so the 16-bit samples may differ by one step
    assert sum(map(len, chunks)) == len(whole)
    np.testing.assert_allclose(_pcm(b"".join(chunks)), _pcm(whole), atol=1.5 / 32767)
    np.testing.assert_allclose(_pcm(whole), out.waveform, atol=1.5 / 32767)


def _sse_events(srv, fmt: str, **kw) -> list[dict]:
    payload = {"model": "tiny", "input": TEXT, "voice": "ryan", "language": "english", "seed": 0,
               "response_format": fmt, "stream_format": "sse", **GREEDY, **kw}
    events = []
    with httpx.stream("POST", f"{srv.url}/v1/audio/speech", json=payload, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def test_sse_mp3_deltas_join_into_the_whole_clip(served):
    """Joined, the deltas are one mp3 that decodes to the whole clip (an mp3 per chunk decoded as its first)."""
    srv, _ = served
    pcm_events = _sse_events(srv, "pcm", max_new_frames=200)
    assert len(pcm_events) > 3, len(pcm_events)  # several chunks: the case an mp3 per chunk got wrong
    pcm = _pcm(b"".join(base64.b64decode(e["audio"]) for e in pcm_events[:-1]))
    events = _sse_events(srv, "mp3", max_new_frames=200)
    assert events[-1]["type"] == "speech.audio.done"
    mp3, sr = sf.read(io.BytesIO(b"".join(base64.b64decode(e["audio"]) for e in events[:-1])), dtype="float32")
    assert sr == SR and len(mp3) == len(pcm), (len(mp3), len(pcm))  # the encoder's header: exact length


def test_sse_deltas_then_done(served):
    srv, out = served
    events = _sse_events(srv, "pcm")
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and set(kinds[:-1]) == {"speech.audio.delta"} and len(kinds) >= 3
    pcm = _pcm(b"".join(base64.b64decode(e["audio"]) for e in events[:-1]))
    np.testing.assert_allclose(pcm, out.waveform, atol=1.5 / 32767)
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == len(out.frames) and usage["input_tokens"] > 5
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


@pytest.mark.parametrize("body, status, param, match", [
    ({"input": ""}, 400, "input", "empty"),
    ({"input": "x" * 4097}, 400, "input", "4096"),
    ({"voice": "nobody"}, 400, "voice", "voice 'nobody'"),
    ({"voice": None}, 400, "voice", "voice is required for this model: one of eric, ryan, vivian"),
    ({"language": "klingon"}, 400, "language", "klingon"),
    ({"response_format": "opus"}, 400, "response_format", "opus"),
    ({"stream_format": "ws"}, 400, "stream_format", "ws"),
    ({"stream_format": "sse", "response_format": "flac"}, 400, "response_format", "flac"),
    ({"speed": 2.0}, 400, "speed", "speed"),
    ({"speed": 9.0}, 400, "speed", "less than or equal"),
    ({"top_p": 0.0}, 400, "top_p", "top_p"),
    ({"max_new_frames": 0}, 400, "max_new_frames", "max_new_frames=0"),
    ({"seed": 2**64}, 400, "seed", "less than or equal"),
    ({"temperature": float("nan")}, 400, "temperature", "finite"),
    ({"speed": float("nan")}, 400, "speed", "finite"),
    ({"temperature": -1}, 400, "temperature", "greater than or equal"),
    ({"ref_text": "hello"}, 400, "ref_text", "without ref_audio"),
    ({"seed": -(2**63) - 1}, 400, "seed", "greater than or equal"),
    ({"model": "other"}, 404, "model", "does not exist"),
    ({"input": None}, 400, "input", "input"),
    ({"ref_audio": "AAAA", "ref_text": "hi"}, 400, "ref_audio", "needs a Base checkpoint"),
])
def test_bad_requests_get_openai_errors(served, body, status, param, match):
    srv, _ = served
    r = _post(srv, **body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(match, err["message"]) and err["type"]


def _metric(srv, name: str, **labels: str) -> float:
    """The value of the sample ``name`` whose labels include ``labels`` (0 when absent)."""
    for line in httpx.get(f"{srv.url}/metrics").text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def test_disconnect_frees_the_slot_and_metrics_count(served):
    srv, _ = served
    aborted = _metric(srv, "strata:tts_request_success_total", finished_reason="abort")
    payload = {"model": "tiny", "input": TEXT, "voice": "ryan", "response_format": "pcm", "max_new_frames": 4000}
    with httpx.stream("POST", f"{srv.url}/v1/audio/speech", json=payload, timeout=60) as r:
        first = next(r.iter_bytes())
        assert first
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done = _metric(srv, "strata:tts_request_success_total", finished_reason="abort")
        if done > aborted and _metric(srv, "strata:tts_num_requests_running") == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the disconnected request was not aborted")
    assert _metric(srv, "strata:tts_time_to_first_audio_seconds_count") >= 1
    assert _metric(srv, "strata:tts_frames_total") > 0
    models = httpx.get(f"{srv.url}/v1/models").json()["data"]
    assert models[0]["id"] == "tiny" and "ryan" in models[0]["voices"]
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_serve_reports_a_broken_tts_folder(weak_eos_ckpt, tmp_path):
    import shutil

    bad = tmp_path / "no_codec"
    shutil.copytree(weak_eos_ckpt, bad)
    shutil.rmtree(bad / "speech_tokenizer")
    srv = launch(bad, tmp_path / "server.log", api_key=None, wait=False)
    try:
        assert srv.proc.wait(timeout=300) == 1
    finally:
        srv.stop()
    assert "speech_tokenizer" in srv.log_tail() and "failed to start" in srv.log_tail()


def test_sse_failure_mid_stream_is_a_last_error_event():
    """Once the 200 is out, a failure in generation (such as an engine error) is told in an ``error`` event, not
    only by a cut connection."""
    import asyncio

    from strataserve.api.speech import _sse_body

    class Failing:
        frames, input_tokens, closed = [], 0, False

        def __aiter__(self):
            return self._gen()

        async def _gen(self):
            yield np.zeros(8, np.float32)
            raise RuntimeError("speech generation failed: the engine stopped")

        async def aclose(self):
            Failing.closed = True

    async def collect():
        return [json.loads(e[6:]) async for e in _sse_body(Failing(), "pcm", SR)]

    events = asyncio.run(collect())
    assert [e["type"] for e in events] == ["speech.audio.delta", "error"] and Failing.closed
    assert "engine stopped" in events[-1]["error"]["message"]
