"""Record the reference audio decode (transformers' ``HiggsAudioV2TokenizerModel.decode``, the codec OmniVoice
ships with) on fixed codes, for ``tests/tts/test_omnivoice_codec.py``. Needs torchaudio (transformers refuses to
build the tokenizer without it), so it runs where torchaudio is installed (the H200 run).

Writes ``$OUT/omnivoice_codec/``: the tiny tokenizer folder (config.json, model.safetensors: the decode half with
random weights, seed 0; the encoder parts the reference builds get its own random init and are not used),
``codes.pt`` (long [2, 8, 12], seed 1) and ``reference_audio.pt`` (the reference decode of each clip, float32,
TF32 off). Copy the folder to ``tests/data/omnivoice_codec/``.

    python benchmarks/record_omnivoice_ref.py
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _tiny_omnivoice import write_tiny_codec  # noqa: E402


def main() -> None:
    from transformers import HiggsAudioV2TokenizerModel

    out = Path(os.environ.get("OUT", ".")) / "omnivoice_codec"
    write_tiny_codec(out, seed=0)
    codes = torch.randint(0, 1024, (2, 8, 12), generator=torch.Generator().manual_seed(1))
    torch.save(codes, out / "codes.pt")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    model = HiggsAudioV2TokenizerModel.from_pretrained(str(out)).to(dev).float().eval()
    with torch.no_grad():
        wav = [model.decode(codes[i:i + 1].to(dev)).audio_values[0, 0].cpu() for i in range(2)]
    torch.save(torch.stack(wav), out / "reference_audio.pt")
    print("RECORDED " + json.dumps({"device": dev, "samples": int(wav[0].numel()), "rms": float(wav[0].pow(2).mean()
                                                                                            .sqrt())}))


if __name__ == "__main__":
    main()
