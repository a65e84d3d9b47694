"""The Higgs audio v2 tokenizer's decode half (audio tokens -> waveform), built from transformers' own classes.

Only what ``HiggsAudioV2TokenizerModel.decode`` runs is built and loaded (residual-VQ codebooks, ``fc2``, the
DAC acoustic decoder adjusted the way the tokenizer adjusts it), not its HuBERT semantic model or encoders, so
loading is small and needs no torchaudio. transformers' module imports torchaudio at the top although decoding
never calls it: without torchaudio installed, the import sees an empty stand-in for that one import.

``decode_batch`` decodes clips of equal length together: the decoder's convolutions see past a clip's end, so
clips of different lengths are decoded in separate groups rather than padded (padding would change their last
samples). ``encoder`` (voice cloning from raw audio) loads the whole tokenizer and needs torchaudio.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from strataserve.models.qwen3_tts.config import MissingCheckpointFileError

_PREFIXES = ("quantizer.", "fc2.", "acoustic_decoder.")


def _higgs_module() -> types.ModuleType:
    name = "transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer"
    if name in sys.modules or "torchaudio" in sys.modules or ReferenceEncoder.available():
        return importlib.import_module(name)
    stand_in = types.ModuleType("torchaudio")
    sys.modules["torchaudio"] = stand_in
    try:
        return importlib.import_module(name)
    finally:
        if sys.modules.get("torchaudio") is stand_in:
            del sys.modules["torchaudio"]


class HiggsDecoder(nn.Module):
    def __init__(self, config) -> None:  # a transformers HiggsAudioV2TokenizerConfig
        super().__init__()
        from transformers import AutoModel

        m = _higgs_module()
        self.config = config
        self.quantizer = m.HiggsAudioV2TokenizerResidualVectorQuantization(config)
        self.fc2 = nn.Linear(config.hidden_size, config.acoustic_model_config.hidden_size)
        self.acoustic_decoder = AutoModel.from_config(config.acoustic_model_config).decoder
        m.HiggsAudioV2TokenizerModel._adjust_dac_decoder(self.acoustic_decoder)

    @property
    def sample_rate(self) -> int:
        return int(self.config.sample_rate)

    @torch.inference_mode()
    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes long ``[B, C, T]`` -> float32 waveform ``[B, samples]`` (what the tokenizer's ``decode`` gives)."""
        q = self.quantizer.decode(codes.transpose(0, 1))
        return self.acoustic_decoder(self.fc2(q.transpose(1, 2)).transpose(1, 2))[:, 0, :].float()

    def decode_batch(self, clips: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each ``[C, T_i]`` -> its waveform; equal lengths share one forward."""
        dev = next(self.parameters()).device
        out: list[torch.Tensor | None] = [None] * len(clips)
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(clips):
            groups.setdefault(int(c.shape[-1]), []).append(i)
        for idx in groups.values():
            wav = self(torch.stack([clips[i] for i in idx]).to(dev))
            for j, i in enumerate(idx):
                out[i] = wav[j]
        return out  # type: ignore[return-value]


def load_higgs_decoder(folder: Path, device: torch.device) -> HiggsDecoder:
    from transformers import HiggsAudioV2TokenizerConfig

    files = [p for p in (folder / "model.safetensors",) if p.is_file()]
    if not files:
        raise MissingCheckpointFileError(f"{folder}: model.safetensors is missing (the audio tokenizer's weights)")
    dec = HiggsDecoder(HiggsAudioV2TokenizerConfig.from_pretrained(str(folder)))
    state = {}
    with safe_open(str(files[0]), framework="pt", device="cpu") as f:
        for name in f.keys():
            if name.startswith(_PREFIXES):
                state[name] = f.get_tensor(name)
    own = dec.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"{folder}/model.safetensors lacks decoder tensors: {', '.join(missing[:5])}")
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise ValueError(f"{folder}/model.safetensors has tensors this decoder does not know: {unknown[:5]}")
    dec.load_state_dict(state)
    # float32: it runs once per clip, and half precision would cost audio precision for little gain
    return dec.to(device=device, dtype=torch.float32).eval()


class ReferenceEncoder:
    """Reference clip (audio file bytes) -> audio tokens ``[C, T]`` with the whole Higgs tokenizer (loaded at the
    first use). The clip is mixed to mono, resampled to the tokenizer's rate and cut to whole frames."""

    def __init__(self, folder: Path, device: torch.device) -> None:
        self.folder, self.device = folder, device
        self._model = None

    @staticmethod
    def available() -> bool:
        try:
            return importlib.util.find_spec("torchaudio") is not None
        except ValueError:  # a stand-in module (no spec) holds the name: no real torchaudio
            return False

    @torch.inference_mode()
    def __call__(self, audio: bytes) -> tuple[torch.Tensor, float]:
        """-> (tokens ``[C, T]``, the clip's RMS; a quiet clip is raised to RMS 0.1 first, as the reference does)."""
        import io

        import soundfile as sf
        import torchaudio
        from transformers import HiggsAudioV2TokenizerModel

        if self._model is None:
            self._model = HiggsAudioV2TokenizerModel.from_pretrained(str(self.folder)).to(self.device).eval()
        try:
            data, sr = sf.read(io.BytesIO(audio), dtype="float32", always_2d=True)
        except (RuntimeError, TypeError, ValueError) as exc:
            reason = getattr(exc, "error_string", None) or exc  # libsndfile's text without the buffer's repr
            raise ValueError(f"ref_audio: not a readable audio file ({reason})") from None
        wav = torch.from_numpy(data.mean(axis=1))[None]
        rate = int(self._model.config.sample_rate)
        if sr != rate:
            wav = torchaudio.functional.resample(wav, sr, rate)
        hop = int(self._model.config.hop_length)
        wav = wav[:, : wav.shape[-1] // hop * hop]
        if wav.shape[-1] == 0:
            raise ValueError("ref_audio: the clip is shorter than one audio frame")
        rms = float(wav.pow(2).mean().sqrt())
        if 0 < rms < 0.1:
            wav = wav * (0.1 / rms)
        return self._model.encode(wav[None].to(self.device)).audio_codes[0].long().cpu(), rms
