"""Served Qwen3-TTS throughput at concurrency: does the streamed path (per-chunk codec decode on one worker
thread, PCM encoding, HTTP) keep up with the engine as the batch grows?

A random-weight checkpoint in the released shape (``tts_serve_ttfa.write_checkpoint``) is served on loopback with
``--max-num-seqs 32``; for each concurrency C, ROUNDS waves of C streamed ``/v1/audio/speech`` requests (pcm,
greedy, ``max_new_frames`` FRAMES, a different random text each) run together. Per wave: audio frames per second
over the wave (frames from the PCM bytes: one frame is ``decode_upsample_rate`` samples of int16), time to first
audio P50 / max. Compare with ``tts_bench.py``'s engine-only batch-C frames/s (no codec, no HTTP) in the same call.

Prints one ``TTSCONC {...}`` line per wave and a final ``RESULT {...}``.

    python benchmarks/tts_serve_concurrency.py                       # H200: SHAPE=1.7B CONC=1,8,16,32 ROUNDS=3
    SHAPE=tiny CONC=1,2 ROUNDS=1 FRAMES=8 python benchmarks/tts_serve_concurrency.py   # CPU smoke run
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from _server import Server  # noqa: E402
from _speech_waves import Bodies, fps_by_concurrency, run_waves  # noqa: E402


def stand_in_audio_io() -> None:
    """The reference model code imports librosa, soundfile and onnxruntime at module level (audio I/O, its 25 Hz
    tokenizer), which writing a random checkpoint never calls; where they (or numba / scipy under librosa) are
    absent, empty modules stand in for the import only, so the device run does not need ~100 MB of wheels."""
    import importlib.machinery
    import types

    for name, attrs in (("librosa", {}), ("librosa.filters", {"mel": None}), ("soundfile", {}), ("onnxruntime", {})):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - absent, or its own dependencies are
            mod = types.ModuleType(name)
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers asks find_spec about them
            mod.__dict__.update(attrs)
            sys.modules[name] = mod
    sys.modules["librosa"].filters = sys.modules["librosa.filters"]


stand_in_audio_io()
from tts_serve_ttfa import SHAPE, write_checkpoint  # noqa: E402

CONC = [int(c) for c in os.environ.get("CONC", "1,8,16,32").split(",")]
ROUNDS = int(os.environ.get("ROUNDS", 3))
FRAMES = int(os.environ.get("FRAMES", 100))
WORDS = ("river stone light morning quiet garden window letter summer paper music harbor silver forest yellow "
         "station winter market engine violin candle mirror thunder orchard").split()


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(14)) + "." for _ in range(n)]


def bodies(model: str) -> Bodies:
    def make(c: int, seed: int) -> list[dict]:
        return [dict(model=model, input=t, voice="ryan", language="english", response_format="pcm",
                     stream_format="audio", temperature=0.0, max_new_frames=FRAMES) for t in texts(c, seed)]
    return make


def main() -> None:
    out = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_checkpoint(Path(tmp) / f"qwen3-tts-{SHAPE}")
        cfg = json.loads((folder / "speech_tokenizer" / "config.json").read_text())
        samples_per_frame = int(cfg.get("decode_upsample_rate", 1920))
        srv = Server([str(folder), "--max-num-seqs", str(max(CONC))], out / "tts_serve_concurrency.log")
        try:
            model = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]
            rows = run_waves(srv.url, CONC, ROUNDS, bodies(model), samples_per_frame, dict(shape=SHAPE))
        finally:
            srv.stop()
    summary = fps_by_concurrency(rows, CONC)
    print("RESULT " + json.dumps(dict(shape=SHAPE, frames=FRAMES, fps_by_concurrency=summary)), flush=True)


if __name__ == "__main__":
    main()
