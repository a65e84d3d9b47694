"""Served OmniVoice throughput at concurrency: what ``strata serve OMNIVOICE_DIR`` delivers over HTTP (the NAR
scheduler's dynamic batches, the per-clip codec decode on its worker thread, PCM encoding) as C requests arrive
together; ``tts_serve_concurrency.py``'s protocol (``_speech_waves``) for the non-autoregressive model.

The checkpoint is ``omnivoice_bench.build_checkpoint``'s: the reference ``OmniVoice`` with random weights in the
released shape (Qwen3-0.6B backbone, 8 codebooks x 1,025, bf16) plus a released-like Higgs decoder (25 frames/s at
24 kHz), or with SHAPE=tiny the tests' tiny checkpoint. It is served on loopback with ``--max-num-seqs`` max(CONC);
for each concurrency C, ROUNDS waves of C streamed ``/v1/audio/speech`` requests (pcm, voice auto, NUM_STEP steps,
the default guidance, a fixed seed per request) run together.

Clip length: OmniVoice has no frame budget (``max_new_frames`` is a 400): the server estimates the clip length
from the text's weighted character count, divided by ``speed``. So every request's text is a different shuffle of
one word list (the same characters: the same estimate), long enough for FRAMES frames at speed 1, and ``speed``
(close to 1; it scales only the length estimate) brings the estimate to exactly FRAMES. The frames actually
received are counted from the PCM bytes (``sample_rate / frame_rate`` samples of int16 a frame) and reported per
wave (min / max). Up to 30 s (750 frames) a request is one piece; longer ones are split by the server.

Prints one ``TTSCONC {...}`` line per wave and a final ``RESULT {...}``; the server's log goes to $OUT.

    python benchmarks/omnivoice_serve_concurrency.py          # GPU: released shape, CONC=1,8,16,32 ROUNDS=3 FRAMES=250
    SHAPE=tiny CONC=1,2 ROUNDS=1 FRAMES=25 NUM_STEP=4 python benchmarks/omnivoice_serve_concurrency.py   # CPU smoke run
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

from strataserve.models.omnivoice.config import load_omnivoice_config  # noqa: E402
from strataserve.models.omnivoice.prompt import DEFAULT_REF, estimate_frames, text_weight  # noqa: E402

SHAPE = os.environ.get("SHAPE", "released")
if SHAPE not in ("released", "tiny"):
    raise ValueError(f"SHAPE={SHAPE!r}: use 'released' (the Qwen3-0.6B backbone) or 'tiny'")
CONC = [int(c) for c in os.environ.get("CONC", "1,8,16,32").split(",")]
ROUNDS = int(os.environ.get("ROUNDS", 3))
FRAMES = int(os.environ.get("FRAMES", 250))  # 10 s of audio at 25 frames/s
NUM_STEP = int(os.environ.get("NUM_STEP", 32))
WORDS = ("river stone light morning quiet garden window letter summer paper music harbor silver forest yellow "
         "station winter market engine violin candle mirror thunder orchard").split()


def served_frames(text: str, speed: float, frame_rate: int) -> int:
    """The clip length the server gives ``text`` (``OmniVoiceRequests.build``'s ``frames_of``, no reference)."""
    return max(1, int(estimate_frames(text, None, speed) * (frame_rate / 25)))


def word_list(frames: int, frame_rate: int) -> tuple[list[str], float]:
    """Fixed words (seed 0) whose text estimates >= ``frames`` at speed 1, and the speed that makes it ``frames``."""
    rng, words = random.Random(0), []
    while not words or served_frames(" ".join(words) + ".", 1.0, frame_rate) < frames:
        words.append(rng.choice(WORDS))
    text = " ".join(words) + "."
    ref_text, ref_frames = DEFAULT_REF
    raw = text_weight(text) * ref_frames / text_weight(ref_text) * (frame_rate / 25)  # the estimate before int()
    speed = raw / (frames + 0.5)  # the middle of the speeds that truncate to ``frames``
    if not 0.25 <= speed <= 4.0 or served_frames(text, speed, frame_rate) != frames:
        raise ValueError(f"FRAMES={frames}: no speed in [0.25, 4] gives exactly that many frames for a text of "
                         f"{len(words)} words (estimate {raw:.1f} at speed 1); use FRAMES >= 10")
    return words, speed


def bodies(model: str, words: list[str], speed: float) -> Bodies:
    def make(c: int, seed: int) -> list[dict]:
        rng = random.Random(seed)  # C shuffles of the same words: different texts, the same estimated length
        return [dict(model=model, input=" ".join(rng.sample(words, len(words))) + ".", voice="auto",
                     response_format="pcm", stream_format="audio", num_step=NUM_STEP, speed=speed,
                     seed=seed * 100 + i) for i in range(c)]
    return make


def write_checkpoint(folder: Path) -> Path:
    """``omnivoice_bench``'s checkpoint (it reads SHAPE itself); its reference model is freed before serving."""
    import torch
    from omnivoice_bench import build_checkpoint

    folder, model = build_checkpoint(folder)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder


def main() -> None:
    out = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_checkpoint(Path(tmp) / f"omnivoice-{SHAPE}")
        cfg = load_omnivoice_config(folder)
        samples_per_frame = cfg.sample_rate // cfg.frame_rate
        words, speed = word_list(FRAMES, cfg.frame_rate)
        srv = Server([str(folder), "--max-num-seqs", str(max(CONC))], out / "omnivoice_serve_concurrency.log")
        try:
            model = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]
            rows = run_waves(srv.url, CONC, ROUNDS, bodies(model, words, speed), samples_per_frame,
                             dict(shape=SHAPE))
        finally:
            srv.stop()
    print("RESULT " + json.dumps(dict(shape=SHAPE, frames=FRAMES, num_step=NUM_STEP, words=len(words),
                                      speed=round(speed, 6), samples_per_frame=samples_per_frame,
                                      fps_by_concurrency=fps_by_concurrency(rows, CONC))), flush=True)


if __name__ == "__main__":
    main()
