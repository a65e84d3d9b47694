"""Time to first audio through `strata serve` (issue 10): a random-weight Qwen3-TTS checkpoint folder in the
released shapes is written, served on loopback, and ~20 streamed `/v1/audio/speech` requests (stream_format audio,
pcm, batch 1: one at a time) are timed from sending the request to the first audio byte. Warm-up requests first.

Prints one parseable line ``TTFA {...}`` (P50/P90 in ms); writes it to $OUT/tts_serve_ttfa.json when OUT is set.

    python benchmarks/tts_serve_ttfa.py                 # H200: SHAPE=1.7B N=20
    SHAPE=tiny N=3 python benchmarks/tts_serve_ttfa.py  # CPU smoke run
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from _server import Server  # noqa: E402

SHAPE = os.environ.get("SHAPE", "1.7B")
N = int(os.environ.get("N", 20))
WARMUP = 3
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs home to sleep."


def write_checkpoint(path: Path) -> Path:
    """A checkpoint folder as the official package writes it, random weights (N(0, 0.02)) in SHAPE."""
    from safetensors.torch import save_file

    from _tiny_models import make_tiny_tokenizer
    from _tiny_tts import import_reference, make_tiny_tts, reference_rope
    from tokenizers import processors

    if SHAPE == "tiny":
        return make_tiny_tts(path)[0]
    shapes = json.loads((ROOT / "strataserve/models/qwen3_tts/public_shapes.json").read_text())
    raw, codec_raw = copy.deepcopy(shapes[SHAPE]), copy.deepcopy(shapes["speech_tokenizer"])
    ref = import_reference()
    cfg = ref.Config(**{k: v for k, v in raw.items() if k != "model_type"})
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev), reference_rope():
        model = ref.Model(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    (path / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    written = json.loads((path / "config.json").read_text())
    written["talker_config"]["torch_dtype"] = "bfloat16"  # served in bf16, as the released checkpoints are
    (path / "config.json").write_text(json.dumps(written, indent=1))
    save_file({k: v.contiguous().cpu() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    del model
    tok = make_tiny_tokenizer(1000)  # any byte-level tokenizer: the weights are random
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens(["assistant", "user"])
    tok.save_pretrained(path)
    ccfg = ref.CodecConfig(**{k: v for k, v in codec_raw.items() if k != "model_type"})
    with reference_rope():
        codec = ref.Codec(ccfg.decoder_config)
    ccfg.save_pretrained(path / "speech_tokenizer")
    save_file({f"decoder.{k}": v.contiguous() for k, v in codec.state_dict().items()},
              str(path / "speech_tokenizer" / "model.safetensors"))
    return path


def first_audio(client: httpx.Client, url: str, model: str) -> float:
    body = dict(model=model, input=TEXT, voice="ryan", language="english", response_format="pcm",
                stream_format="audio", temperature=0.0, max_new_frames=64)
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/v1/audio/speech", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"speech request failed: {r.status_code} {r.read()[:500]!r}")
        chunks = r.iter_bytes()
        for chunk in chunks:
            if chunk:
                dt = time.perf_counter() - t0
                break
        else:
            raise SystemExit("the stream ended without audio")
        for _ in chunks:  # drain: the next request runs alone (batch 1)
            pass
    return dt


def main() -> None:
    out = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = write_checkpoint(Path(tmp) / f"qwen3-tts-{SHAPE}")
        written = time.perf_counter() - t0
        srv = Server([str(folder)], out / "tts_serve.log")
        try:
            with httpx.Client(timeout=120) as client:
                model = client.get(f"{srv.url}/v1/models").json()["data"][0]["id"]
                for _ in range(WARMUP):
                    first_audio(client, srv.url, model)
                ttfa = [first_audio(client, srv.url, model) for _ in range(N)]
        finally:
            srv.stop()
    q = statistics.quantiles(ttfa, n=10)
    res = dict(shape=SHAPE, n=N, p50_ms=round(statistics.median(ttfa) * 1e3, 1), p90_ms=round(q[8] * 1e3, 1),
               min_ms=round(min(ttfa) * 1e3, 1), max_ms=round(max(ttfa) * 1e3, 1),
               values_ms=[round(v * 1e3, 1) for v in ttfa], checkpoint_write_s=round(written, 1),
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__)
    print("TTFA " + json.dumps(res), flush=True)
    if os.environ.get("OUT"):
        (out / "tts_serve_ttfa.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
